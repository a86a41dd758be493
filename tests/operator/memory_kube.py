"""Kubernetes in memory: the operator's `KubeApi` (tetrad_operator.kubeapi) served from dicts, the
way controller-runtime's fake client serves Go controllers, so that unit tests run the real
controller, informers and admission without an API server.

What it models:
- objects by REST path (any group, version and plural, namespaced or cluster-scoped), each with a
  uid, a resourceVersion from one counter (etcd's revision, bumped by every change and by no
  no-op), a creationTimestamp and a metadata.generation that a change of the spec bumps;
- get, list and watch: ADDED, MODIFIED and DELETED after a resourceVersion, 410 Gone for a watch
  from a version `compact` forgot (and for every open watch, which it ends); equality label
  selectors (a=b, a!=b, a);
- create (409 AlreadyExists, generateName; a created pod is Pending), JSON merge patches and
  strategic merge patches (lists of named items merged by name, `$patch: delete`), with
  metadata.resourceVersion and metadata.uid as preconditions (409 Conflict); the status
  subresource: a patch of /status changes only the status, a patch of the object everything else;
- server-side apply, forced: a field manager owns the fields it applies, and a field it applied
  before and leaves out now is removed; fields others wrote stay (lists are atomic);
- deletion: a uid precondition (409), finalizers that hold an object with its deletionTimestamp, a
  pod on a node deleted gracefully (deletionTimestamp = now + its grace period, as the API server
  sets it) and one not bound or finished at once, and the dependents of a removed object
  (ownerReferences) deleted after it;
- admission: webhooks that may refuse a write (a quota, a policy: `webhooks`),
  SelfSubjectAccessReviews answered from `grants`, and each status validated against its model
  (a ParallelTrainingJob's against ParallelTrainingJobStatus, strictly: a field the model lacks is
  a 422, where the real API server would drop it without a word).

What it does not: defaulting and validation of built-in kinds, field selectors, paging, bookmarks,
the end of a watch after its timeout, managedFields in the objects, conflicts between field
managers, list merge keys beyond `name`, and every controller: scheduler, kubelet, garbage
collector beyond ownerReferences (tests play those; see fakes.FakeCluster).

Tests may edit the objects it holds in place (`collection`), as a kubelet or a user would write
them; `sync` turns such edits into what the API server would have made of them: a new
resourceVersion, a generation when the spec changed, a validated status and a watch event.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn
from urllib.parse import unquote

from pydantic import BaseModel, ValidationError
from tetrad_operator.kubeapi import MERGE, STRATEGIC, ApiError, Gone, path

from tetrad.api.contract import PLURAL
from tetrad.api.spec import ParallelTrainingJobStatus

ACCESS_REVIEWS = "selfsubjectaccessreviews"
Key = tuple[str, str, str, str]  # (group/version, plural, namespace or "", name)
STATUS_MODELS: dict[str, type[BaseModel]] = {PLURAL: ParallelTrainingJobStatus}  # by plural
MERGE_KEYS = {"schedulingGates": "name", "containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "name", "ports": "name"}  # strategic merge: list -> its key


class Refused(Exception):
    """An answer other than 2xx: (HTTP status, reason, message)."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


# A webhook sees every create, update and delete: (verb, the object as it would be stored); it
# refuses by raising Refused.
Webhook = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class Address:
    """A REST path: a collection (name None), or an object and perhaps its subresource."""

    group_version: str
    plural: str
    namespace: str  # "" for cluster-scoped or every namespace
    name: str | None = None
    sub: str | None = None

    @classmethod
    def parse(cls, url_path: str) -> Address:
        parts = [unquote(p) for p in url_path.strip("/").split("/")]
        group_version, rest = ((parts[1], parts[2:]) if parts[0] == "api"
                               else ("/".join(parts[1:3]), parts[3:]))
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        return cls(group_version, rest[0], namespace, *(rest[1:3] + [None] * (3 - len(rest)))[:2])

    def key(self, name: str | None = None) -> Key:
        assert name or self.name, f"{self} names no object"
        return self.group_version, self.plural, self.namespace, name or self.name or ""

    def holds(self, key: Key) -> bool:
        """Whether the collection holds the object (a collection of every namespace holds each)."""
        return key[:2] == (self.group_version, self.plural) and self.namespace in ("", key[2])


@dataclass(frozen=True)
class Request:
    verb: str
    path: str
    body: Any = None
    query: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    revision: int
    key: Key
    type: str  # ADDED, MODIFIED, DELETED
    object: dict[str, Any]


def selector_matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    """An equality-based label selector: a=b, a==b, a!=b, a (exists), comma-separated."""
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.strip() not in labels:
            return False
    return True


def merge_patch(target: Any, patch: Any, list_keys: Mapping[str, str] | None = None,
                list_key: str | None = None) -> Any:
    """RFC 7386 (maps merged, null removes, anything else replaced); with `list_keys` (field -> the
    key of its items), a strategic merge patch: such lists merge item by item, `$patch: delete`
    removes one."""
    if isinstance(patch, list) and isinstance(target, list) and list_key is not None:
        items = [copy.deepcopy(item) for item in target]
        for item in patch:
            at = next((i for i, old in enumerate(items) if old.get(list_key) == item.get(list_key)), None)
            if item.get("$patch") == "delete":
                if at is not None:
                    del items[at]
            elif at is None:
                items.append(copy.deepcopy(item))
            else:
                items[at] = merge_patch(items[at], item, list_keys)
        return items
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v, list_keys, (list_keys or {}).get(k))
    return out


def leaves(obj: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The paths of the fields an applied object sets (a list is one field)."""
    out: set[tuple[str, ...]] = set()
    for k, v in obj.items():
        if isinstance(v, dict) and v:
            out |= leaves(v, (*prefix, k))
        else:
            out.add((*prefix, k))
    return out


def remove_field(obj: dict[str, Any], at: tuple[str, ...]) -> None:
    """Remove the field at `at`, and the objects it leaves empty."""
    parent = obj
    for k in at[:-1]:
        parent = parent.get(k)  # type: ignore[assignment]
        if not isinstance(parent, dict):
            return
    parent.pop(at[-1], None)
    if len(at) > 1 and not parent:
        remove_field(obj, at[:-1])


def apply_fields(target: dict[str, Any], applied: Mapping[str, Any]) -> None:
    for k, v in applied.items():
        if isinstance(v, dict) and isinstance(target.get(k), dict):
            apply_fields(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


SYSTEM_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "deletionTimestamp",
                   "deletionGracePeriodSeconds")


class MemoryKube:
    def __init__(self, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 status_models: Mapping[str, type[BaseModel]] = STATUS_MODELS):
        self.clock = clock
        self.status_models = dict(status_models)
        self.on_error: Callable[[str, int], None] = lambda verb, status: None
        self.webhooks: list[Webhook] = []
        self.grants: set[tuple[str, str, str]] | None = None  # (verb, resource, namespace); None: all allowed
        self.requests: list[Request] = []  # every call, in order
        self.revision = 0
        self.oldest = 0  # the oldest revision a watch may start from
        self._objects: dict[Key, dict[str, Any]] = {}  # the stored objects, handed out live by `collection`
        self._published: dict[Key, dict[str, Any]] = {}  # each as the last write left it (see `sync`)
        # (object, field manager) -> its fields
        self._managed: dict[tuple[Key, str], set[tuple[str, ...]]] = {}
        self._changes: list[Change] = []
        self._watchers: list[tuple[Address, str | None, asyncio.Queue[Change | None]]] = []
        self._uids = itertools.count(1)

    # ------------------------------------------------------------------ KubeApi

    async def get(self, url_path: str) -> dict[str, Any] | None:
        self.requests.append(Request("GET", url_path))
        obj = self._objects.get(Address.parse(url_path).key())
        return copy.deepcopy(obj) if obj is not None else None

    async def snapshot(self, url_path: str, **query: Any) -> tuple[list[dict[str, Any]], str]:
        self.requests.append(Request("LIST", url_path, query=query))
        address = Address.parse(url_path)
        items = [copy.deepcopy(o) for k, o in self._objects.items()
                 if address.holds(k) and selector_matches(query.get("labelSelector"), _labels(o))]
        return items, str(self.revision)

    async def list(self, url_path: str, **query: Any) -> list[dict[str, Any]]:
        return (await self.snapshot(url_path, **query))[0]

    async def watch(self, url_path: str, resource_version: str,
                    **query: Any) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(Request("WATCH", url_path, query={**query, "resourceVersion": resource_version}))
        since = int(resource_version or 0)
        if since < self.oldest:
            raise Gone(url_path)
        address, selector = Address.parse(url_path), query.get("labelSelector")
        queue: asyncio.Queue[Change | None] = asyncio.Queue()
        for past in self._changes[bisect.bisect_right(self._changes, since, key=lambda c: c.revision):]:
            if address.holds(past.key) and selector_matches(selector, _labels(past.object)):
                queue.put_nowait(past)
        watcher = (address, selector, queue)
        self._watchers.append(watcher)
        try:
            while True:
                change = await queue.get()
                if change is None:
                    queue.task_done()
                    raise Gone(url_path)
                try:
                    yield {"type": change.type, "object": copy.deepcopy(change.object)}
                finally:
                    queue.task_done()  # the consumer asked for the next: it has handled this one
        finally:
            self._watchers.remove(watcher)

    async def create(self, url_path: str, body: Mapping[str, Any]) -> bool:
        self.requests.append(Request("POST", url_path, copy.deepcopy(body)))
        try:
            self._create(Address.parse(url_path), body)
        except Refused as e:
            if e.status != 409:
                self._refuse("POST", url_path, e)
            return False
        return True

    async def post(self, url_path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.requests.append(Request("POST", url_path, copy.deepcopy(body)))
        address = Address.parse(url_path)
        if address.plural != ACCESS_REVIEWS:
            try:
                return copy.deepcopy(self._create(address, body))
            except Refused as e:
                self._refuse("POST", url_path, e)
        attributes = body["spec"]["resourceAttributes"]
        wanted = (attributes.get("verb", ""), attributes.get("resource", ""), attributes.get("namespace", ""))
        return {**copy.deepcopy(dict(body)),
                "status": {"allowed": self.grants is None or wanted in self.grants}}

    async def patch(self, url_path: str, body: Mapping[str, Any], content_type: str = MERGE,
                    ok: tuple[int, ...] = (404,)) -> dict[str, Any] | None:
        self.requests.append(Request("PATCH", url_path, copy.deepcopy(body), {"contentType": content_type}))
        try:
            return copy.deepcopy(self._patch(Address.parse(url_path), body, content_type))
        except Refused as e:
            if e.status in ok:
                return None
            self._refuse("PATCH", url_path, e)

    async def apply(self, url_path: str, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        self.requests.append(Request("APPLY", url_path, copy.deepcopy(obj), {"fieldManager": field_manager}))
        try:
            return copy.deepcopy(self._apply(Address.parse(url_path), obj, field_manager))
        except Refused as e:
            self._refuse("PATCH", url_path, e)

    async def delete(self, url_path: str, *, uid: str | None = None, grace_seconds: int | None = None,
                     propagation: str | None = None) -> bool:
        self.requests.append(Request("DELETE", url_path, query={"uid": uid, "grace": grace_seconds,
                                                                "propagation": propagation}))
        try:
            self._delete(Address.parse(url_path).key(), uid, grace_seconds, propagation != "Orphan")
        except Refused as e:
            if e.status not in (404, 409):
                self._refuse("DELETE", url_path, e)
            return False
        return True

    async def delete_collection(self, url_path: str, label_selector: str) -> None:
        self.requests.append(Request("DELETE", url_path, query={"labelSelector": label_selector}))
        address = Address.parse(url_path)
        for key in [k for k, o in self._objects.items()
                    if address.holds(k) and selector_matches(label_selector, _labels(o))]:
            self._delete(key, None, None, True)

    async def close(self) -> None:
        pass

    # -------------------------------------------------------------- for tests: the cluster's other writers

    def collection(self, url_path: str) -> Collection:
        """The objects of a collection by name, live: edit them in place (then `sync`), set or delete them."""
        return Collection(self, Address.parse(url_path))

    def objects(self, namespace: str) -> Iterator[dict[str, Any]]:
        """Every object of a namespace, live."""
        return (o for k, o in self._objects.items() if k[2] == namespace)

    def put(self, url_path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store the object as given (its uid kept): a write of another client, or one that was
        there before the test. Returns the stored object, live."""
        address = Address.parse(url_path)
        name = obj["metadata"]["name"]
        key = address.key(name)
        new = copy.deepcopy(dict(obj))
        meta = new["metadata"]
        if address.namespace:
            meta["namespace"] = address.namespace
        old = self._objects.get(key)
        meta.setdefault("uid", old["metadata"]["uid"] if old else self._uid())
        meta.setdefault("creationTimestamp", _time(self.clock()))
        meta["generation"] = _generation(old, new) if old else meta.get("generation", 1)
        self._validate(key, new)
        return self._store(key, new, "ADDED" if old is None else "MODIFIED")

    def remove(self, url_path: str) -> None:
        """The object goes at once, finalizers or not (a kubelet's last word on a pod)."""
        self._remove(Address.parse(url_path).key(), cascade=True)

    def sync(self) -> None:
        """Turn the edits tests made in place into writes: each edited object gets a new
        resourceVersion (a new generation if its spec changed), a validated status and a watch event."""
        for key, live in list(self._objects.items()):
            before = self._published[key]
            if live == before:
                continue
            live["metadata"]["generation"] = _generation(before, live)
            try:
                self._validate(key, live)
            except Refused as e:
                raise ValueError(f"a test wrote an invalid {key}: {e.message}") from None
            self._store(key, copy.deepcopy(live), "MODIFIED")

    def compact(self) -> None:
        """Forget the changes so far, as etcd's compaction does: the open watches end with 410 Gone,
        and so does a watch from an older resourceVersion."""
        self._changes.clear()
        self.oldest = self.revision
        for _, _, queue in self._watchers:
            queue.put_nowait(None)

    async def idle(self) -> None:
        """Until every watch has handled every change."""
        for _, _, queue in list(self._watchers):
            await queue.join()

    # ------------------------------------------------------------------ the server

    def _refuse(self, verb: str, url_path: str, refused: Refused) -> NoReturn:
        """An answer the caller did not expect: ApiError, as the REST client raises it."""
        self.on_error(verb, refused.status)
        raise ApiError(refused.status, verb, url_path, {"reason": refused.reason, "message": refused.message})

    def _uid(self) -> str:
        return f"uid-{next(self._uids)}"

    def _create(self, address: Address, body: Mapping[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            meta["name"] = f"{meta['generateName']}{next(self._uids):05d}"
        key = address.key(meta["name"])
        if key in self._objects:
            raise Refused(409, "AlreadyExists", f'{address.plural} "{meta["name"]}" already exists')
        for k in SYSTEM_METADATA:
            meta.pop(k, None)
        if address.namespace:
            meta["namespace"] = address.namespace
        meta.update(uid=self._uid(), creationTimestamp=_time(self.clock()), generation=1)
        obj.pop("status", None)  # the status subresource's, written after
        if address.plural == "pods":
            obj["status"] = {"phase": "Pending"}
        self._admit("create", obj)
        return self._store(key, obj, "ADDED")

    def _patch(self, address: Address, body: Mapping[str, Any], content_type: str) -> dict[str, Any]:
        key = address.key()
        old = self._found(key)
        meta = body.get("metadata") or {}
        for field_name in ("resourceVersion", "uid"):
            if field_name in meta and meta[field_name] != old["metadata"].get(field_name):
                raise Refused(409, "Conflict", f"the object has been modified: {field_name} "
                              f"{meta[field_name]} is not {old['metadata'].get(field_name)}")
        if content_type == MERGE:
            patched = merge_patch(old, body)
        elif content_type == STRATEGIC:
            patched = merge_patch(old, body, MERGE_KEYS)
        else:
            raise Refused(415, "UnsupportedMediaType", f"{content_type} is not modelled")
        if address.sub == "status":
            new = {**copy.deepcopy(old), "status": patched.get("status")}
        else:
            new = {**patched, "status": copy.deepcopy(old.get("status"))}
        new = {k: v for k, v in new.items() if v is not None}
        new["metadata"].update({k: old["metadata"][k] for k in SYSTEM_METADATA if k in old["metadata"]})
        return self._update(key, old, new)

    def _apply(self, address: Address, applied: Mapping[str, Any], manager: str) -> dict[str, Any]:
        key = address.key(applied["metadata"]["name"])
        fields = leaves(applied)
        old = self._objects.get(key)
        if old is None:
            stored = self._create(address, applied)
        else:
            new = copy.deepcopy(old)
            for gone in self._managed.get((key, manager), set()) - fields:
                remove_field(new, gone)
            apply_fields(new, applied)
            new["metadata"].update({k: old["metadata"][k] for k in SYSTEM_METADATA if k in old["metadata"]})
            stored = self._update(key, old, new)
        self._managed[(key, manager)] = fields
        return stored

    def _update(self, key: Key, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        if new == old:
            return old  # a no-op: no new resourceVersion, no event
        new["metadata"]["generation"] = _generation(old, new)
        self._admit("update", new)
        self._validate(key, new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self._remove(key, cascade=True)  # the last finalizer went
            return new
        return self._store(key, new, "MODIFIED")

    def _delete(self, key: Key, uid: str | None, grace_seconds: int | None, cascade: bool) -> None:
        obj = self._found(key)
        meta = obj["metadata"]
        if uid is not None and uid != meta.get("uid"):
            raise Refused(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                          f"UID in object meta: {meta.get('uid')}")
        self._admit("delete", obj)
        grace = self._grace(key, obj, grace_seconds)
        if grace == 0 and not meta.get("finalizers"):
            self._remove(key, cascade)
            return
        held = meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp") and held is not None and held <= grace:
            return  # deleting already, no sooner than this would
        new = copy.deepcopy(obj)
        new["metadata"].update(deletionTimestamp=_time(self.clock() + timedelta(seconds=grace)),
                               deletionGracePeriodSeconds=grace)
        self._store(key, new, "MODIFIED")

    @staticmethod
    def _grace(key: Key, obj: Mapping[str, Any], asked: int | None) -> int:
        """A pod's grace period, as the API server sets it: the one asked for, else the one a
        deletion under way has, else the pod's own; none for a pod not bound or finished, nor for
        anything but a pod."""
        if key[:2] != ("v1", "pods"):
            return 0
        spec, meta = obj.get("spec") or {}, obj["metadata"]
        if not spec.get("nodeName") or (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return 0
        if asked is not None:
            return asked
        held = meta.get("deletionGracePeriodSeconds")
        return int(held if held is not None else spec.get("terminationGracePeriodSeconds", 30))

    def _remove(self, key: Key, cascade: bool) -> None:
        obj = self._objects.pop(key, None)
        if obj is None:
            return
        del self._published[key]
        for k in [k for k in self._managed if k[0] == key]:
            del self._managed[k]
        self.revision += 1
        self._emit(Change(self.revision, key, "DELETED", copy.deepcopy(obj)))
        uid = obj["metadata"].get("uid")
        if cascade and uid:  # the garbage collector: the dependents go after their owner
            for dependent in [k for k, o in self._objects.items()
                              if any(r.get("uid") == uid
                                     for r in o["metadata"].get("ownerReferences") or [])]:
                if dependent in self._objects:
                    self._delete(dependent, None, None, True)

    def _found(self, key: Key) -> dict[str, Any]:
        obj = self._objects.get(key)
        if obj is None:
            raise Refused(404, "NotFound", f'{key[1]} "{key[3]}" not found')
        return obj

    def _admit(self, verb: str, obj: dict[str, Any]) -> None:
        for webhook in self.webhooks:
            webhook(verb, obj)

    def _validate(self, key: Key, obj: Mapping[str, Any]) -> None:
        model = self.status_models.get(key[1])
        if model is None or obj.get("status") is None:
            return
        try:
            model.model_validate(obj["status"])
        except ValidationError as e:
            raise Refused(422, "Invalid", f"{key[1]} {key[3]}: status: {e}") from None

    def _store(self, key: Key, new: dict[str, Any], change: str) -> dict[str, Any]:
        """Write the object in place (references tests hold stay live), with a new resourceVersion."""
        self.revision += 1
        new["metadata"]["resourceVersion"] = str(self.revision)
        live = self._objects.setdefault(key, new)
        if live is not new:
            live.clear()
            live.update(new)
        self._published[key] = copy.deepcopy(live)
        self._emit(Change(self.revision, key, change, self._published[key]))
        return live

    def _emit(self, change: Change) -> None:
        self._changes.append(change)
        for address, selector, queue in self._watchers:
            if address.holds(change.key) and selector_matches(selector, _labels(change.object)):
                queue.put_nowait(change)


class Collection(MutableMapping[str, dict[str, Any]]):
    """A collection's objects by name, live; setting one is a write, deleting one removes it at once."""

    def __init__(self, kube: MemoryKube, address: Address):
        self.kube, self.address = kube, address

    def _path(self, name: str) -> str:
        a = self.address
        return path(a.group_version, a.plural, a.namespace or None, name)

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.kube._objects[self.address.key(name)]

    def __setitem__(self, name: str, obj: dict[str, Any]) -> None:
        self.kube.put(self._path(name), {**obj, "metadata": {**obj["metadata"], "name": name}})

    def __delitem__(self, name: str) -> None:
        if self.address.key(name) not in self.kube._objects:
            raise KeyError(name)
        self.kube.remove(self._path(name))

    def __iter__(self) -> Iterator[str]:
        return (k[3] for k in list(self.kube._objects) if self.address.holds(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _generation(old: Mapping[str, Any], new: Mapping[str, Any]) -> int:
    """metadata.generation: one more for each change of the spec."""
    return int(old["metadata"].get("generation", 1)) + (new.get("spec") != old.get("spec"))


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
