"""One watched kind kept in memory, as compact views: a LIST, then a WATCH from its
resourceVersion, and a new LIST whenever the server has forgotten that version (410 Gone) or the
stream breaks.

Each change reaches `on_change(old, new)` (None where the object is absent) in the event loop,
one JSON parse and one view per event: the operator's own informer, because kopf's per-object
machinery cost far more than the views for a thousand pods and nodes. A view of None leaves the
object out, as if absent; a group of None leaves it ungrouped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

from tetrad_operator.kubeapi import Gone, KubeApi

log = logging.getLogger(__name__)
V = TypeVar("V")
RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0, 10.0)  # after a failed LIST or a broken watch, then 10 s each


def object_key(obj: Mapping[str, Any]) -> str:
    """namespace/name, or the name alone for a cluster-scoped object (a node's store is by name)."""
    meta = obj.get("metadata") or {}
    return f"{meta['namespace']}/{meta.get('name', '')}" if meta.get("namespace") else meta.get("name", "")


class Informer(Generic[V]):
    def __init__(self, kube: KubeApi, url_path: str, view: Callable[[Mapping[str, Any]], V | None],
                 on_change: Callable[[V | None, V | None], None], *, selector: str | None = None,
                 group: Callable[[V], Hashable | None] | None = None):
        self.kube = kube
        self.url_path = url_path
        self.view = view
        self.on_change = on_change
        self.query = {"labelSelector": selector} if selector else {}
        self.group_of = group
        self.items: dict[str, V] = {}  # by object_key
        self.groups: dict[Hashable, dict[str, V]] = {}  # by group_of(view), then namespace/name
        self.synced = asyncio.Event()  # set once the first LIST is in

    def group(self, key: Hashable) -> list[V]:
        return list(self.groups.get(key, {}).values())

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                version = await self._relist()
                self.synced.set()
                while True:  # each watch ends after kube.WATCH_SECONDS; go on from the last version seen
                    version = await self._watch(version)
                    failures = 0
            except Gone:
                log.info("watch of %s expired; listing again", self.url_path)
            except Exception as e:  # a failed LIST, a refused or broken watch, a garbled event: go on
                delay = RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)]
                failures += 1
                log.warning("watch of %s failed (%s); listing again in %.1fs", self.url_path, e or repr(e),
                            delay)
                await asyncio.sleep(delay)

    async def _relist(self) -> str:
        """Replace the store by a LIST, telling each difference; the version to watch from."""
        objects, version = await self.kube.snapshot(self.url_path, **self.query)
        listed = {object_key(o): o for o in objects}
        for key in [k for k in self.items if k not in listed]:
            self._put(key, None)
        for key, obj in listed.items():
            self._put(key, self.view(obj))
        return version

    async def _watch(self, version: str) -> str:
        async for event in self.kube.watch(self.url_path, version, **self.query):
            obj = event.get("object") or {}
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            kind = event.get("type")
            if kind == "BOOKMARK":
                continue
            self._put(object_key(obj), None if kind == "DELETED" else self.view(obj))
        return version

    def _put(self, key: str, new: V | None) -> None:
        old = self.items.pop(key, None) if new is None else self.items.get(key)
        if new is not None:
            self.items[key] = new
        if self.group_of is not None:
            if old is not None and (members := self.groups.get(self.group_of(old))) is not None:
                members.pop(key, None)
                if not members:
                    del self.groups[self.group_of(old)]
            if new is not None and (group := self.group_of(new)) is not None:
                self.groups.setdefault(group, {})[key] = new
        if old is not None or new is not None:
            try:
                self.on_change(old, new)
            except Exception:
                log.exception("handling a change of %s failed", key)
