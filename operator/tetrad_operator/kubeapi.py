"""What the operator asks of the Kubernetes API server: the `KubeApi` protocol, its errors and paths.

Objects are plain JSON dicts, addressed by their REST paths (`path`). The verbs turn the answers
the operator expects into return values (an object already there, one already gone, a conflict
where the caller says it is fine) and raise `ApiError` for any other refusal: a quota or an
admission webhook saying no (403, 400, 422), a write that lost to a newer resourceVersion (409).
`tetrad_operator.kube.Kube` speaks it to a real API server; tests/operator/memory_kube.py holds
the objects in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol
from urllib.parse import quote

PLURALS = {
    "Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events",
    "PodGroup": "podgroups", "Workload": "workloads", "ParallelTrainingJob": "paralleltrainingjobs",
}
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, verb: str, path: str, body: Any):
        self.status = status
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        # the server's words
        self.message = body.get("message", "") if isinstance(body, dict) else str(body)[:300]
        super().__init__(f"{verb} {path}: {status} {self.reason}: {self.message}")


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


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


class KubeApi(Protocol):
    """The Kubernetes API as the operator uses it. Every write is idempotent: a retried one answers
    as if it had been done once."""

    on_error: Callable[[str, int], None]  # (verb, HTTP status; 0: no answer) of every failed call

    async def get(self, url_path: str) -> dict[str, Any] | None:
        """The object; None when there is none."""
        ...

    async def snapshot(self, url_path: str, **query: Any) -> tuple[list[dict[str, Any]], str]:
        """Every object of a collection (`labelSelector` and the like in `query`) and the
        resourceVersion to watch it from."""
        ...

    async def list(self, url_path: str, **query: Any) -> list[dict[str, Any]]:
        """`snapshot`'s objects."""
        ...

    def watch(self, url_path: str, resource_version: str, **query: Any) -> AsyncIterator[dict[str, Any]]:
        """The collection's watch events ({"type": ADDED|MODIFIED|DELETED|BOOKMARK, "object": ...})
        after `resource_version`, until the server ends the stream; Gone when that version is too
        old."""
        ...

    async def create(self, url_path: str, body: Mapping[str, Any]) -> bool:
        """POST the object to its collection; False when one of its name exists already."""
        ...

    async def post(self, url_path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a request object (a SelfSubjectAccessReview) and return the server's answer."""
        ...

    async def patch(self, url_path: str, body: Mapping[str, Any], content_type: str = MERGE,
                    ok: tuple[int, ...] = (404,)) -> dict[str, Any] | None:
        """Patch the object (a path ending in /status: its status) and return it; None for an
        answer in `ok`. A metadata.resourceVersion or metadata.uid in `body` is a precondition:
        409 when the object has another."""
        ...

    async def apply(self, url_path: str, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of the whole object, forced: `field_manager` owns every field it sets, and
        fields it set before but leaves out now are removed."""
        ...

    async def delete(self, url_path: str, *, uid: str | None = None, grace_seconds: int | None = None,
                     propagation: str | None = None) -> bool:
        """DELETE; False when it is already gone (or was replaced: the uid precondition failed)."""
        ...

    async def delete_collection(self, url_path: str, label_selector: str) -> None:
        """DELETE every object of the collection the selector matches."""
        ...

    async def close(self) -> None:
        ...
