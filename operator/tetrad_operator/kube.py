"""A small asyncio client of the Kubernetes REST API: the operator's `KubeApi` (kubeapi.py) against
a real API server.

It speaks plain JSON dicts (no generated models; orjson parses a 1024-pod LIST in milliseconds)
over one aiohttp session, retries what is safe to retry, turns the answers the operator expects (404 on
delete, 409 on create) into return values, and streams watches. Credentials are the `kubernetes`
client's: in-cluster service account or $KUBECONFIG, token refresh included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from kubernetes import client, config

from tetrad_operator.kubeapi import MERGE, ApiError, Gone

log = logging.getLogger(__name__)

RETRYABLE = {429, 500, 502, 503, 504}
APPLY = "application/apply-patch+yaml"  # server-side apply (a JSON body is valid YAML)
WATCH_SECONDS = 300  # the server ends each watch after this long; the client allows 30 s more


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """The in-cluster service account, or $KUBECONFIG (read now: the client fixes its default at import)."""
    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig or os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return configuration


def tls_context(configuration: client.Configuration) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if configuration.cert_file:
        ctx.load_cert_chain(configuration.cert_file, configuration.key_file)
    if not configuration.verify_ssl:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx


class Kube:
    """At most `workers` requests in flight (watches aside); the session opens on first use, in
    the running event loop."""

    def __init__(self, configuration: client.Configuration | None = None, workers: int = 16,
                 on_error: Callable[[str, int], None] | None = None, timeout: float = 30.0):
        self.configuration = configuration or load_configuration()
        self.in_flight = asyncio.Semaphore(workers)
        self.on_error = on_error or (lambda verb, status: None)
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=5.0)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            c = self.configuration
            tls = tls_context(c) if c.host.startswith("https:") else None
            self._session = aiohttp.ClientSession(c.host,
                                                  connector=aiohttp.TCPConnector(ssl=tls or False, limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        # refreshed when due
        token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token
        return headers

    def _route(self) -> dict[str, Any]:
        """The kubeconfig's proxy and TLS server name, for requests and watches alike."""
        return {"proxy": self.configuration.proxy or None,
                "server_hostname": getattr(self.configuration, "tls_server_name", None) or None}

    async def send(self, verb: str, url_path: str, query: Mapping[str, Any] | None = None, body: Any = None,
                   content_type: str | None = None, decode: bool = True) -> tuple[int, Any]:
        """One request: (HTTP status, decoded body; {} for a success not `decode`d). No retries, no
        raising on status."""
        data = None if body is None else body if isinstance(body, (str, bytes)) else orjson.dumps(body)
        ctype = (content_type or "application/json") if data is not None else None
        async with self.in_flight, self.session.request(
                verb, url_path, params=query, data=data, headers=self._headers(ctype), timeout=self.timeout,
                **self._route()) as rsp:
            raw = await rsp.read()
        if not decode and 200 <= rsp.status < 300:
            return rsp.status, {}
        try:
            return rsp.status, orjson.loads(raw) if raw else None
        except ValueError:
            return rsp.status, raw.decode(errors="replace")

    async def request(self, verb: str, url_path: str, *, query: Mapping[str, Any] | None = None,
                      body: Any = None, content_type: str | None = None, ok: tuple[int, ...] = (),
                      decode: bool = True) -> Any:
        """Return the decoded answer; None for a status in `ok`; raise ApiError otherwise.

        Connection errors and 429/5xx are retried (three times, with a short backoff); every
        write the operator does is idempotent, so a retried POST answers 409 at worst.
        """
        delay = 0.2
        for attempt in range(4):
            try:
                status, data = await self.send(verb, url_path, query, body, content_type, decode)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                self.on_error(verb, 0)
                if attempt == 3:
                    raise ApiError(0, verb, url_path, str(e) or type(e).__name__) from e
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

    async def watch(self, url_path: str, resource_version: str,
                    **query: Any) -> AsyncIterator[dict[str, Any]]:
        """The watch events after `resource_version` (bookmarks included) until the server ends the
        stream; Gone when that version is too old, ApiError for any other refusal."""
        params = {**query, "watch": "true", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_SECONDS)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=WATCH_SECONDS + 30)
        async with self.session.get(url_path, params=params, headers=self._headers(None), timeout=timeout,
                                    **self._route()) as rsp:
            if rsp.status == 410:
                raise Gone(url_path)
            if rsp.status != 200:
                raise ApiError(rsp.status, "WATCH", url_path, await rsp.text())
            rest = b""
            async for chunk in rsp.content.iter_any():
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = orjson.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        if status.get("code") == 410:
                            raise Gone(url_path)
                        raise ApiError(int(status.get("code") or 0), "WATCH", url_path, status)
                    yield event

    # ------------------------------------------------------------------ verbs

    async def get(self, url_path: str) -> dict[str, Any] | None:
        return await self.request("GET", url_path, ok=(404,))  # type: ignore[no-any-return]

    async def snapshot(self, url_path: str, **query: Any) -> tuple[list[dict[str, Any]], str]:
        """Every object of a LIST, page by page, and the resourceVersion to watch it from."""
        items: list[dict[str, Any]] = []
        query = {"limit": 500, **query}
        while True:
            page = await self.request("GET", url_path, query=query)
            items += page.get("items") or []
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return items, meta.get("resourceVersion", "")
            query["continue"] = meta["continue"]

    async def list(self, url_path: str, **query: Any) -> list[dict[str, Any]]:
        return (await self.snapshot(url_path, **query))[0]

    async def create(self, url_path: str, body: Mapping[str, Any]) -> bool:
        """POST to a collection; False when the object already exists. The answer is not decoded."""
        return await self.request("POST", url_path, body=body, ok=(409,), decode=False) is not None

    async def post(self, url_path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a request object (a review) and return the server's answer."""
        return await self.request("POST", url_path, body=body)  # type: ignore[no-any-return]

    async def patch(self, url_path: str, body: Mapping[str, Any], content_type: str = MERGE,
                    ok: tuple[int, ...] = (404,)) -> dict[str, Any] | None:
        return await self.request("PATCH", url_path, body=body,  # type: ignore[no-any-return]
                                  content_type=content_type, ok=ok)

    async def apply(self, url_path: str, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of the whole object, forced: `field_manager` owns every field it sets, and
        fields it set before but leaves out now are removed."""
        return await self.request("PATCH", url_path,  # type: ignore[no-any-return]
                                  query={"fieldManager": field_manager, "force": "true"},
                                  body=orjson.dumps(obj), content_type=APPLY)

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

    async def delete_collection(self, url_path: str, label_selector: str) -> None:
        await self.request("DELETE", url_path, query={"labelSelector": label_selector}, ok=(404,))
