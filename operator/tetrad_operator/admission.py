"""The built-in gang admission loop: one decision at a time for the whole operator.

Job reconciles register complete, gated gangs here. A single task, woken by capacity changes
(pods ending, nodes changing) and by new requests, reads every unfinished pod in the cluster
from the operator's pod informer, asks `packing.plan_admission` which gangs fit, and removes their
gates.
Decisions are serialized, and a gang released but not yet bound counts as taking its room: the
informer shows it by the pods' release annotation, and until the watch shows that, the admitter
counts the gang from its own memory (`released`). A watch that lags can then only make room
look taken that is free, never the reverse, so two gangs that fit only one at a time can never
both be released.

A new incarnation asks first (`reserve`), before its pods exist: if it fits, by the same
decision, its pods are created already released, one write each instead of a create and an
ungating patch, and count as a released gang while they are created (`reserved`) and then until
the watch shows them (`unreserve`). Its answer comes from the loop's next round, which plans
every gang that asked since the last one, and every waiting gang, at once: a burst of new jobs
costs a plan per round, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from tetrad.api import contract
from tetrad_operator import packing
from tetrad_operator.informer import Informer
from tetrad_operator.kubeapi import STRATEGIC, KubeApi, path
from tetrad_operator.observed import RELEASED_ANNOTATION, NodeState, PodState, format_time
from tetrad_operator.operator_metrics import OperatorMetrics
from tetrad_operator.settings import OperatorSettings

log = logging.getLogger(__name__)
MIN_INTERVAL = 0.25  # seconds between two admission rounds
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
RELEASE_SEEN_SECONDS = 30.0  # how long a gang released here counts from memory if the watch never shows it

Key = tuple[str, str]
Ask = tuple[packing.GangRequest, asyncio.Future[packing.GangRelease | None]]  # a new gang, and its answer


def ungate_patch(now: datetime, pin: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Remove only the tetrad gate (strategic merge on the list's `name` key), stamp the release, and
    add the pod's pin to its nodeSelector (a gated pod's nodeSelector may gain entries, KEP-3838)."""
    spec: dict[str, Any] = {"schedulingGates": [{"name": contract.GANG_GATE, "$patch": "delete"}]}
    if pin:
        spec["nodeSelector"] = dict(pin)
    return {"metadata": {"annotations": {RELEASED_ANNOTATION: format_time(now)}}, "spec": spec}


def created_released(pod: dict[str, Any], now: datetime,
                     pin: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A rendered pod as the release would leave it: without the tetrad gate, stamped released, its
    pin in its nodeSelector."""
    meta, spec = pod["metadata"], pod["spec"]
    gates = [g for g in spec.get("schedulingGates") or [] if g.get("name") != contract.GANG_GATE]
    spec = ({k: v for k, v in spec.items() if k != "schedulingGates"}
            | ({"schedulingGates": gates} if gates else {})
            | ({"nodeSelector": {**(spec.get("nodeSelector") or {}), **pin}} if pin else {}))
    annotations = {**(meta.get("annotations") or {}), RELEASED_ANNOTATION: format_time(now)}
    return {**pod, "metadata": {**meta, "annotations": annotations}, "spec": spec}


async def ungate(kube: KubeApi, namespace: str, pods: Sequence[tuple[str, str]],
                 limit: asyncio.Semaphore, pins: Mapping[str, Mapping[str, str]] | None = None) -> None:
    now = datetime.now(UTC)

    async def one(name: str, uid: str) -> None:
        async with limit:
            patch = ungate_patch(now, (pins or {}).get(name))
            # The uid guards against a pod of the same name re-created in the meantime.
            body = {**patch, "metadata": {**patch["metadata"], "uid": uid}}
            await kube.patch(path("v1", "pods", namespace, name), body, STRATEGIC, ok=(404, 409, 422))

    await asyncio.gather(*(one(n, u) for n, u in pods))


class GangAdmitter:
    def __init__(self, kube: KubeApi, nodes: Callable[[], list[NodeState]], wake: Callable[[Key], None],
                 metrics: OperatorMetrics, limit: asyncio.Semaphore, namespaces: list[str] | None,
                 retry_seconds: float = OperatorSettings.admission_retry_seconds,
                 batch_seconds: float = OperatorSettings.batch_seconds,
                 monotonic: Callable[[], float] = time.monotonic):
        self.kube = kube
        self.nodes = nodes
        self.wake = wake
        self.metrics = metrics
        self.limit = limit
        self.namespaces = namespaces  # None: list pods cluster-wide
        self.retry_seconds = retry_seconds
        self.batch_seconds = batch_seconds
        self.monotonic = monotonic  # the timer of what it remembers: how long gangs waited, releases unseen
        self.waiting: dict[Key, packing.GangRequest] = {}
        self.reserved: dict[Key, tuple[PodState, ...]] = {}  # released at creation, not all created yet
        # Gangs released here (gates removed, or created released) that the watch may not show
        # released yet: (key, restart) -> (monotonic() of the release, its pods).
        self.released: dict[tuple[Key, int], tuple[float, tuple[PodState, ...]]] = {}
        self.deleted: set[tuple[str, str]] = set()  # (namespace, name) of those pods the watch showed deleted
        self.first_seen: dict[tuple[Key, int], float] = {}  # when a gang first asked
        # New incarnations asking to be created released, answered by the next round.
        self.asks: dict[Key, Ask] = {}
        # The operator's pod informers over `scopes()`: every unfinished pod, and the operator's own.
        self.informers: list[Informer[PodState]] = []
        self.lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._last = 0.0

    def request(self, req: packing.GangRequest) -> None:
        known = self.waiting.get(req.key)
        self.waiting[req.key] = req
        self.first_seen.setdefault((req.key, req.restart), self.monotonic())
        if known is None or known.restart != req.restart:
            self._kick.set()

    def withdraw(self, key: Key) -> None:
        if self.waiting.pop(key, None) is not None:
            for k in [k for k in self.first_seen if k[0] == key]:
                del self.first_seen[k]

    def kick(self) -> None:
        """Capacity may have changed."""
        if self.waiting:
            self._kick.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(),
                                       timeout=self.retry_seconds if self.waiting else None)
            self._kick.clear()
            if not self.waiting and not self.asks:
                continue
            await asyncio.sleep(max(self.batch_seconds, MIN_INTERVAL - (time.monotonic() - self._last)))
            self._last = time.monotonic()
            try:
                await self.admit_once()
            except Exception:
                log.exception("gang admission failed; retrying in %ss", self.retry_seconds)

    async def scopes(self) -> list[str | None]:
        """Where the pods must be watched: cluster-wide (None), or, where the operator may not and
        watches namespaces, in those only. Raises PermissionError, naming the rule to grant, when
        it may not list and watch pods there."""
        if not await self.may_watch_pods(None):
            if not self.namespaces:
                raise PermissionError("the gang admission must list and watch pods in every namespace: "
                                      "grant the operator's ServiceAccount a ClusterRole with pods "
                                      "[list, watch] (the chart's <release>-cluster) or set watchNamespaces")
            refused = [ns for ns in self.namespaces if not await self.may_watch_pods(ns)]
            if refused:
                raise PermissionError(f"the gang admission must list and watch pods in {', '.join(refused)}: "
                                      f"grant the operator's ServiceAccount pods [list, watch] there "
                                      f"(the chart's Role)")
            log.warning("may not list and watch pods in every namespace: the gang admission counts only the "
                        "pods of %s; other namespaces' pods on the same nodes are invisible to it",
                        ", ".join(self.namespaces))
            return list(self.namespaces)
        return [None]

    async def may_watch_pods(self, namespace: str | None) -> bool:
        """Whether the API server lets this operator list and watch pods in `namespace` (None: in
        every namespace at once), by SelfSubjectAccessReview: a refused watch would otherwise only
        show as a LIST every 10 s in place of the watch."""
        for verb in ("list", "watch"):
            attributes = {"verb": verb, "resource": "pods", "namespace": namespace or ""}
            review = await self.kube.post(ACCESS_REVIEWS, {
                "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes}})
            if not (review.get("status") or {}).get("allowed"):
                return False
        return True

    def on_pod_change(self, old: PodState | None, new: PodState | None) -> None:
        # A pod ended or went (room freed), a release shows in the watch, or a pod is bound (the
        # scheduler may have placed it elsewhere than a plan counted it).
        if old is not None and new is None:
            self._note_deleted(old)
        if old is None or old.terminal:
            return  # a new pod takes no room until it is released or bound
        if new is None or new.terminal or old.gated != new.gated or old.node != new.node:
            self.kick()

    def _snapshot(self) -> tuple[list[PodState], list[Sequence[PodState]], list[packing.GangRequest]]:
        """From the informer and the releases it may not show yet: the bound pods, the gangs
        released and not all bound (reservations included), and the waiting gangs whose pods
        are all still gated as requested."""
        shown = {(p.namespace, p.name): p for i in self.informers for p in i.items.values()}
        pods = [p for p in shown.values() if not p.terminal]
        by_name = {(p.namespace, p.name): p for p in pods}
        bound = [p for p in pods if p.node]
        groups: dict[tuple[str, str, int], list[PodState]] = defaultdict(list)
        for p in pods:
            if p.job:
                groups[(p.namespace, p.job, p.restart)].append(p)
        # Each in-flight gang once, each of its pods once: as the watch shows it (it knows a
        # binding), else as this admitter remembers it (being created, or released a moment ago).
        flight = {k: {p.name: p for p in g} for k, g in groups.items()
                  if any(p.released for p in g) and any(p.node is None for p in g)}
        for remembered in [*self.reserved.values(), *self._released_unseen(shown)]:
            for p in remembered:
                flight.setdefault((p.namespace, p.job, p.restart), {}).setdefault(
                    p.name, by_name.get((p.namespace, p.name), p))
        in_flight: list[Sequence[PodState]] = [list(g.values()) for g in flight.values()]
        waiting = []
        for req in list(self.waiting.values()):
            if (req.key, req.restart) in self.released:
                continue  # released a moment ago; the watch still shows its gates
            fresh = [by_name.get((req.namespace, p.name)) for p in req.pods]
            if all(f is not None and f.gated and f.uid == p.uid
                   for f, p in zip(fresh, req.pods, strict=True)):
                waiting.append(packing.GangRequest(req.namespace, req.name, req.created, req.restart,
                                                tuple(f for f in fresh if f is not None)))
        return bound, in_flight, waiting

    def room(self, key: Key, pod: PodState, limit: int) -> int:
        """How many pods like `pod` (one of job `key`'s) fit now if the job's own pods were gone."""
        bound, in_flight, _ = self._snapshot()
        others = [p for p in bound if (p.namespace, p.job) != key]
        return packing.room(self.nodes(), others, [g for g in in_flight if (g[0].namespace, g[0].job) != key],
                            pod, limit)

    def _remember_release(self, key: tuple[Key, int], pods: tuple[PodState, ...]) -> None:
        self.released[key] = (self.monotonic(), pods)
        self.deleted.difference_update((p.namespace, p.name) for p in pods)  # of an earlier gang's pods

    def _note_deleted(self, pod: PodState) -> None:
        """A pod of a gang released here was deleted: it no longer waits to be shown released."""
        if any(p.namespace == pod.namespace and p.name == pod.name and p.uid in ("", pod.uid)
               for _, pods in self.released.values() for p in pods):
            self.deleted.add((pod.namespace, pod.name))

    def _released_unseen(self, shown: dict[tuple[str, str], PodState]) -> list[tuple[PodState, ...]]:
        """The gangs released here whose release the watch does not show yet (a pod missing or
        still gated, and not ended or deleted); forgets the others, and any after RELEASE_SEEN_SECONDS."""
        unseen = []
        for k, (at, pods) in list(self.released.items()):
            names = [(p.namespace, p.name) for p in pods]
            seen = [shown.get(name) for name in names]
            if (all((s is not None and (s.terminal or not s.gated)) or (s is None and name in self.deleted)
                    for s, name in zip(seen, names, strict=True))
                    or self.monotonic() - at > RELEASE_SEEN_SECONDS):
                del self.released[k]
                self.deleted.difference_update(names)
            else:
                unseen.append(pods)
        return unseen

    async def reserve(self, req: packing.GangRequest) -> packing.GangRelease | None:
        """The release of a new incarnation's gang (its rendered pods, none created yet) if it fits
        beside the waiting gangs, decided by the next round as a release is; if so it counts as
        released until `unreserve`."""
        answer: asyncio.Future[packing.GangRelease | None] = asyncio.get_running_loop().create_future()
        self.asks[req.key] = (req, answer)
        self._kick.set()
        try:
            return await answer
        except asyncio.CancelledError:  # the job's loop stopped: no round may hold room for it
            if self.asks.get(req.key, (None, None))[1] is answer:
                del self.asks[req.key]
            elif answer.done() and not answer.cancelled() and answer.result() is not None:
                del self.reserved[req.key]  # answered yes just as it stopped: none of its pods exists
            raise

    def _answer(self, asks: dict[Key, Ask], fits: dict[Key, packing.GangRelease]) -> None:
        """Tell each asking gang its release if it fits; one that fits counts as released from now on."""
        for key, (req, answer) in asks.items():
            if answer.done():  # its loop stopped meanwhile
                continue
            if key in fits:
                self.reserved[key] = fits[key].pinned()
                self.metrics.gangs_admitted.inc()
                self.metrics.gang_wait.observe(0.0)
                log.info("the gang of %s/%s (restart %d, %d pods) fits: creating it released",
                         req.namespace, req.name, req.restart, len(req.pods))
            answer.set_result(fits.get(key))

    def unreserve(self, key: Key) -> None:
        """The reserved gang's creations are over: it counts until the watch shows its pods."""
        if pods := self.reserved.pop(key, None):
            self._remember_release((key, pods[0].restart), pods)
        self.kick()

    async def admit_once(self) -> list[packing.GangRelease]:
        async with self.lock:
            started = time.monotonic()
            asks, self.asks = self.asks, {}
            asking = {id(r) for r, _ in asks.values()}
            fits: dict[Key, packing.GangRelease] = {}
            try:  # a round that fails answers no: those gangs are created gated, and wait
                bound, in_flight, waiting = self._snapshot()
                # A new incarnation asks once its job's loop has seen, by a LIST, every pod of the last
                # one gone: where the watch still shows one, or this admitter still remembers the last
                # one released, that is lag, and its room is the new gang's.
                newer = {(r.namespace, r.name): r.restart for r, _ in asks.values()}

                def superseded(p: PodState) -> bool:
                    return p.restart < newer.get((p.namespace, p.job or ""), 0)

                bound = [p for p in bound if not superseded(p)]
                in_flight = [g for g in in_flight if not all(superseded(p) for p in g)]
                plan = packing.plan_admission(self.nodes(), bound, in_flight,
                                              [*waiting, *(r for r, _ in asks.values())])
                fits = {a.request.key: a for a in plan if id(a.request) in asking}
            finally:
                self._answer(asks, fits)
            planned = time.monotonic()
            # the new gangs that fit are created released
            plan = [a for a in plan if id(a.request) not in asking]
            for a in plan:
                req = a.request
                t = time.monotonic()
                # before the first write lands
                self._remember_release((req.key, req.restart), a.pinned())
                await ungate(self.kube, req.namespace, [(p.name, p.uid) for p in req.pods], self.limit,
                             a.pins)
                if self.waiting.get(req.key) is not None and self.waiting[req.key].restart == req.restart:
                    del self.waiting[req.key]
                asked = self.first_seen.pop((req.key, req.restart), None)
                if asked is not None:
                    self.metrics.gang_wait.observe(self.monotonic() - asked)
                self.metrics.gangs_admitted.inc()
                log.info("released the gang of %s/%s (restart %d, %d pods; plan %.2fs, ungate %.2fs)",
                         req.namespace, req.name, req.restart, len(req.pods), planned - started,
                         time.monotonic() - t)
                self.wake(req.key)
            return plan
