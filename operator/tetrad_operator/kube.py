"""A small asyncio facade over the Kubernetes REST API.

It speaks plain JSON dicts (no generated models: a 1024-pod LIST parses in milliseconds), runs
the blocking `kubernetes` client in a bounded thread pool, retries what is safe to retry, and
turns the answers the operator expects (404 on delete, 409 on create) into return values.
Authentication is the `kubernetes` client's: in-cluster service account or $KUBECONFIG.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote, urlencode

import urllib3
from kubernetes import client, config

log = logging.getLogger(__name__)

PLURALS = {
    "Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events",
    "PodGroup": "podgroups", "Workload": "workloads", "ParallelTrainingJob": "paralleltrainingjobs",
}
RETRYABLE = {429, 500, 502, 503, 504}
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"  # server-side apply (a JSON body is valid YAML)


class ApiError(Exception):
    def __init__(self, status: int, verb: str, path: str, body: Any):
        self.status = status
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        self.message = body.get("message", "") if isinstance(body, dict) else str(body)[:300]  # the server's words
        super().__init__(f"{verb} {path}: {status} {self.reason}: {self.message}")


def path(api_version: str, kind_or_plural: str, namespace: str | None = None, name: str | None = None,
         sub: str | None = None) -> str:
    """/api/v1/namespaces/ns/pods/name, /apis/group/version/plural, ... for a kind or a plural."""
    plural = PLURALS.get(kind_or_plural, kind_or_plural)
    out = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        out += f"/namespaces/{quote(namespace)}"
    out += f"/{plural}"
    if name:
        out += f"/{quote(name)}"
    if sub:
        out += f"/{sub}"
    return out


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def load_api_client(workers: int, kubeconfig: str | None = None) -> client.ApiClient:
    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:  # $KUBECONFIG read now (the client's default is fixed when it is imported)
        config.load_kube_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"),  # type: ignore[no-untyped-call]
                                client_configuration=configuration)
    configuration.connection_pool_maxsize = workers
    return client.ApiClient(configuration)


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None, workers: int = 16,
                 on_error: Callable[[str, int], None] | None = None, timeout: float = 30.0):
        self.api = api_client or load_api_client(workers)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube")
        self.on_error = on_error or (lambda verb, status: None)
        self.timeout = timeout

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.api.close()  # type: ignore[no-untyped-call]

    def call(self, verb: str, url_path: str, query: Mapping[str, Any] | None = None, body: Any = None,
             content_type: str | None = None) -> tuple[int, Any]:
        """One blocking request: (HTTP status, decoded body). No retries, no raising on status."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        full = url_path + (f"?{urlencode(query)}" if query else "")
        method, url, headers, _, _ = self.api.param_serialize(
            method=verb, resource_path=full, header_params=headers, auth_settings=["BearerToken"])
        # The REST layer JSON-encodes the body for every application/*json content type.
        rsp = self.api.call_api(method, url, header_params=headers, body=body,
                                _request_timeout=(5.0, self.timeout))
        raw = rsp.read()  # type: ignore[no-untyped-call]
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace")
        return rsp.status, data

    async def request(self, verb: str, url_path: str, *, query: Mapping[str, Any] | None = None,
                      body: Any = None, content_type: str | None = None, ok: tuple[int, ...] = ()) -> Any:
        """Return the decoded answer; None for a status in `ok`; raise ApiError otherwise.

        Connection errors and 429/5xx are retried (three times, with a short backoff); every
        write the operator does is idempotent, so a retried POST answers 409 at worst.
        """
        loop = asyncio.get_running_loop()
        delay = 0.2
        for attempt in range(4):
            try:
                status, data = await loop.run_in_executor(self.pool, self.call, verb, url_path, query, body, content_type)
            except (urllib3.exceptions.HTTPError, OSError) as e:
                self.on_error(verb, 0)
                if attempt == 3:
                    raise ApiError(0, verb, url_path, str(e)) from e
            else:
                if 200 <= status < 300:
                    return data
                if status in ok:
                    return None
                self.on_error(verb, status)
                if status not in RETRYABLE or attempt == 3:
                    raise ApiError(status, verb, url_path, data)
            await asyncio.sleep(delay)
            delay *= 2.5
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ verbs

    async def get(self, url_path: str) -> dict[str, Any] | None:
        return await self.request("GET", url_path, ok=(404,))  # type: ignore[no-any-return]

    async def list(self, url_path: str, **query: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        query = {"limit": 500, **query}
        while True:
            page = await self.request("GET", url_path, query=query)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query["continue"] = token

    async def create(self, url_path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """POST to a collection; None when the object already exists."""
        return await self.request("POST", url_path, body=body, ok=(409,))  # type: ignore[no-any-return]

    async def patch(self, url_path: str, body: Mapping[str, Any], content_type: str = MERGE,
                    ok: tuple[int, ...] = (404,)) -> dict[str, Any] | None:
        return await self.request("PATCH", url_path, body=body, content_type=content_type, ok=ok)  # type: ignore[no-any-return]

    async def apply(self, url_path: str, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of the whole object, forced: `field_manager` owns every field it sets, and
        fields it set before but leaves out now are removed."""
        return await self.request("PATCH", url_path, query={"fieldManager": field_manager, "force": "true"},  # type: ignore[no-any-return]
                                  body=json.dumps(obj), content_type=APPLY)

    async def delete(self, url_path: str, *, uid: str | None = None, grace_seconds: int | None = None,
                     propagation: str | None = None) -> bool:
        """DELETE; False when it is already gone (or was replaced: the uid precondition failed)."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            options["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if propagation:
            options["propagationPolicy"] = propagation
        return await self.request("DELETE", url_path, body=options, ok=(404, 409)) is not None
