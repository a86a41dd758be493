"""Per-job reconciliation: read the cluster, decide through `lifecycle.decide`, write the outcome.

One loop per job (run by a kopf daemon) wakes on the job's pod events, node changes, spec
changes and its own requeue time. Each pass takes the job's body as the loop last saw it (kopf's
watch, or the answer to its own last write), its pods and the nodes from the operator's informers
(with a consistent LIST of the pods once per resync period), asks the pure state machine what to
do, then writes: the
status first (guarded by resourceVersion, so a stale pass cannot double-count a restart), then
the actions. Nothing the operator remembers in memory is needed for correctness; the memory
below (one `JobLoop` per job, gone with the loop) only avoids redundant API calls and work, and
counts the passes whose pod creations the API server refused (a restarted operator counts anew).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp

from tetrad.api import contract
from tetrad.api.contract import API_VERSION, KIND, PLURAL
from tetrad.api.spec import Checkpoint, GoodputStatus, ParallelTrainingJobStatus, Phase
from tetrad.node import rounds
from tetrad.render import gangs, names
from tetrad.render.objects import rounds_gang, rounds_port
from tetrad_operator import lifecycle, scrape, status
from tetrad_operator.admission import GangAdmitter, created_released, ungate
from tetrad_operator.informer import Informer
from tetrad_operator.kubeapi import ApiError, KubeApi, object_path, path
from tetrad_operator.lifecycle import (
    AnnotatePod,
    AskInPlace,
    CreatePod,
    DeleteJob,
    DeletePod,
    DeleteStaleGang,
    Ensure,
    PodRejection,
    ResolvedJob,
    Ungate,
    closing,
    in_place,
)
from tetrad_operator.observed import NodeState, PodState, format_time
from tetrad_operator.operator_metrics import OperatorMetrics
from tetrad_operator.packing import GangRequest
from tetrad_operator.settings import OperatorSettings

log = logging.getLogger(__name__)
Key = tuple[str, str]
EXPECTATION_SECONDS = 30.0  # how long a created pod may take to show up in the watch
COMPONENT = "tetrad-operator"
FIELD_MANAGER = "tetrad-operator"  # server-side apply of the Service, ConfigMap and PodGroup
REFUSED = (400, 403, 422)  # a pod creation the API server refuses for good: quota, webhook, invalid field
QUEUE_READ_SECONDS = 2.0  # how often a job its scheduler holds reads why (Kueue: its Workload)
FINALIZER = "tetrad.dev/operator"  # kopf's, on every job whose loop runs (see main.kopf_settings)
FINALIZER_WAIT_SECONDS = 2.0  # a new job whose finalizer kopf never adds runs without it after this long


class Clock(Protocol):
    """The time of a pass (`now`, for the decisions and what the operator writes) and the loop's own
    timer (`monotonic`, for what it remembers: expectations, resyncs, reads it spares)."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()


@dataclass
class PodView:
    """What a job's loop knows of its pods beyond what the informer holds."""

    expected: dict[str, float] = field(default_factory=dict)  # pods created (name: when), not yet shown
    gone: set[str] = field(default_factory=set)  # uids of pods the informer still has but the API has not
    last_listed: float = -1e9  # clock.monotonic() of the last consistent LIST of the job's pods


@dataclass
class Scraping:
    """The live figures' scrape of rank 0: the one in flight, and when the next one is due."""

    task: asyncio.Task[None] | None = None
    next_at: float = 0.0  # clock.monotonic()
    # A pass wanted a read now (Decision.read_now) while one was in flight, started before that pass's
    # judgment: the one in flight wakes the loop when it ends, so the judgment waits for no timed pass.
    owed: bool = False

    def busy(self, now: float, due: bool = False) -> bool:
        """A scrape is in flight, or the next is not due yet (`due`: one is due now, interval or not)."""
        return (self.task is not None and not self.task.done()) or (not due and now < self.next_at)


@dataclass
class JobLoop:
    """What one job's loop remembers between passes; it lives exactly as long as the loop."""

    key: Key
    clock: Clock = SYSTEM_CLOCK
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    phase: str = ""
    goodput: GoodputStatus | None = None  # as the last pass wrote it
    pods: PodView = field(default_factory=PodView)
    scraping: Scraping = field(default_factory=Scraping)
    # the spec of one (metadata.uid, metadata.generation), parsed and resolved once
    spec: tuple[tuple[str, int | None], ResolvedJob] | None = None
    rejection: PodRejection | None = None  # passes in a row whose pod creations were refused
    queue_read: tuple[int, float, str | None] | None = None  # (restart, clock.monotonic(), Kueue's reason)
    # the job's newest body seen: a GET, a status write's answer, the watch
    body: dict[str, Any] | None = None
    body_read: float = -1e9  # clock.monotonic() of the last GET of the job
    awaiting_kopf: bool = False  # the last pass waited for kopf's finalizer on this new job
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock.monotonic()

    def keep(self, body: dict[str, Any], *, read: bool = False) -> None:
        """Hold `body` if it is newer than the one held. A watch event only advances a held body
        (one that lags behind our own write must not undo it); a read (a GET, a write's answer)
        also fills an empty one. resourceVersions are etcd revisions, compared as numbers; one
        that is not a number drops the held body, and the next pass GETs the job."""
        if self.body is None:
            if read:
                self.body = body
            return
        try:
            newer = int(body["metadata"]["resourceVersion"]) > int(self.body["metadata"]["resourceVersion"])
        except (KeyError, TypeError, ValueError):
            self.body = None
            return
        if newer:
            self.body = body

    def first_seen(self, body: dict[str, Any]) -> None:
        """The job as the watch showed it when the loop started. A job never reconciled (no status)
        is taken as it is, without a GET: its first pass writes the status, guarded by the
        resourceVersion, before it acts, so a body that lags costs only a conflict and a read."""
        if not body.get("status"):
            self.body, self.body_read = body, self.clock.monotonic()

    def awaits_finalizer(self, body: dict[str, Any]) -> bool:
        return self.finalizer_wait(body) > 0

    def finalizer_wait(self, body: dict[str, Any]) -> float:
        """How long this new job's first status write may still wait for kopf's finalizer (0: it need
        not). kopf patches it onto the job in the cycle that starts the loop, and a status write
        racing that patch loses (409) and is done over, decision and all. The watch event that
        brings the finalizer wakes the loop at once (`Controller.job_seen`): the wait ends with an
        event, not a timer; FINALIZER_WAIT_SECONDS only bounds it if kopf never adds it."""
        if body.get("status") or FINALIZER in (body["metadata"].get("finalizers") or []):
            return 0.0
        return max(0.0, FINALIZER_WAIT_SECONDS - (self.clock.monotonic() - self.started))

    def list_due(self, body: dict[str, Any], resync_seconds: float) -> bool:
        """Whether this pass reads the job's pods with a consistent LIST instead of the informer:
        once per resync period, from the loop's first pass on. Never for a job not reconciled yet
        (no status: a pass writes it before creating anything), which has no pod of ours that a
        lagging watch could hide; `reconcile` starts its period there."""
        return bool(body.get("status")) and self.clock.monotonic() - self.pods.last_listed > resync_seconds

    def count_creations(self, results: list[Any]) -> list[ApiError]:
        """Count the passes in a row whose pod creations the API server refused for good (a quota,
        an admission webhook, an invalid field): `decide` fails the job after a few. `results` are
        the pass's pod creations (None or the exception); one pod created resets the count, other
        errors (transient ones: 429, 5xx, connections) leave it alone. Returns the refusals."""
        refused = [r for r in results if isinstance(r, ApiError) and r.status in REFUSED]
        if any(not isinstance(r, BaseException) for r in results):
            self.rejection = None
        if refused:
            attempts = self.rejection.attempts + 1 if self.rejection is not None else 1
            self.rejection = PodRejection(attempts, refused[0].message or str(refused[0]))
        return refused

    def resolved(self, body: dict[str, Any]) -> ResolvedJob:
        meta = body["metadata"]
        of = (meta.get("uid", ""), meta.get("generation"))
        if self.spec is None or self.spec[0] != of:
            self.spec = (of, lifecycle.resolve_job(body))
        return self.spec[1]


class Controller:
    def __init__(self, kube: KubeApi, settings: OperatorSettings, namespaces: list[str] | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        self.kube = kube
        self.settings = settings
        self.clock = clock
        self.jobs: dict[Key, JobLoop] = {}
        self.metrics = OperatorMetrics(lambda: self.phases,
                                       lambda: {k: j.goodput for k, j in list(self.jobs.items())})
        kube.on_error = self.metrics.api_error
        self.limit = asyncio.Semaphore(settings.api_concurrency)
        # Every unfinished pod and the operator's own (theirs grouped by job), from `start`; every node.
        self.pod_informers: list[Informer[PodState]] = []
        self.node_informer = self._node_informer()
        self.session: aiohttp.ClientSession | None = None
        self.admission = GangAdmitter(kube, self.nodes, self.wake, self.metrics, self.limit, namespaces,
                                   retry_seconds=settings.admission_retry_seconds,
                                   batch_seconds=settings.batch_seconds, monotonic=clock.monotonic)
        self._tasks: list[asyncio.Task[None]] = []
        self.instance = socket.gethostname()
        # Told each pass's decision once its status is written, before its actions (tests record them).
        self.on_decision: Callable[[JobLoop, lifecycle.Decision], None] = lambda loop, decision: None

    @property
    def phases(self) -> dict[Key, str]:
        """The phase each running job loop last wrote."""
        return {k: j.phase for k, j in list(self.jobs.items())}

    # ------------------------------------------------------------------ lifetime

    async def start(self) -> None:
        """Start watching, scraping and admitting; returns once every informer holds its first LIST."""
        self.session = aiohttp.ClientSession()
        await self.watch()
        self._tasks.append(asyncio.create_task(self.admission.run(), name="gang admission"))

    async def watch(self) -> None:
        """Start the informers; returns once each holds its first LIST."""
        # One pod watch serves the job loops and the gang admission: its scopes are the admission's.
        self.pod_informers = self.admission.informers = [
            Informer(self.kube, path("v1", "pods", ns), pod_view, self.on_pod_change, group=job_key)
            for ns in await self.admission.scopes()]
        self.node_informer = self._node_informer()
        informers: list[Informer[Any]] = [*self.pod_informers, self.node_informer]
        self._tasks += [asyncio.create_task(i.run(), name=f"watch {i.url_path}") for i in informers]
        await asyncio.gather(*(i.synced.wait() for i in informers))

    def _node_informer(self) -> Informer[NodeState]:
        return Informer(self.kube, path("v1", "nodes"), NodeState.from_body, self.on_node_change)

    async def stop(self) -> None:
        scrapes = (j.scraping.task for j in self.jobs.values() if j.scraping.task is not None)
        tasks, self._tasks = [*self._tasks, *scrapes], []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session:
            await self.session.close()
        await self.kube.close()

    # ------------------------------------------------------------------ observations

    def pods(self, loop: JobLoop) -> list[PodState]:
        """The job's pods from the informer, minus pods known to be gone that it still holds."""
        return [p for i in self.pod_informers for p in i.group(loop.key) if p.uid not in loop.pods.gone]

    async def listed_pods(self, loop: JobLoop) -> list[PodState]:
        """The job's pods from a consistent LIST; remembers informer entries that no longer exist.

        A watch can lag behind the API server: a pod deleted a moment ago may still be held.
        """
        indexed = {p.uid for p in self.pods(loop)}  # before the LIST: what it lacks is gone
        namespace, name = loop.key
        items = await self.kube.list(path("v1", "pods", namespace), labelSelector=names.pod_selector(name))
        listed = [PodState.from_body(b) for b in items]
        loop.pods.gone.update(indexed - {p.uid for p in listed})
        loop.pods.last_listed = self.clock.monotonic()
        return listed

    def nodes(self) -> list[NodeState]:
        return list(self.node_informer.items.values())

    # ------------------------------------------------------------------ wake-ups

    def wake(self, key: Key) -> None:
        if (loop := self.jobs.get(key)) is not None:
            loop.wake.set()

    def job_seen(self, key: Key, body: dict[str, Any]) -> None:
        """The job's body from kopf's watch: the next pass reads it instead of GETting the job. A
        new job's loop waiting for kopf's finalizer goes on as soon as a body shows it."""
        if (loop := self.jobs.get(key)) is not None:
            loop.keep(body)
            if loop.awaiting_kopf and loop.body is not None and not loop.awaits_finalizer(loop.body):
                loop.wake.set()

    def on_pod_change(self, old: PodState | None, new: PodState | None) -> None:
        if old == new:
            return  # e.g. a condition's probe time: nothing the decisions look at changed
        self.admission.on_pod_change(old, new)
        pod = new or old
        assert pod is not None
        if pod.job:
            self.wake((pod.namespace, pod.job))

    def on_node_change(self, old: NodeState | None, new: NodeState | None) -> None:
        if old == new:
            return  # a heartbeat: nothing the decisions look at changed
        self.admission.kick()
        if old is not None and new is not None and old.ready == new.ready:
            return
        name = (new or old).name  # type: ignore[union-attr]
        for informer in self.pod_informers:
            for key, pods in list(informer.groups.items()):
                if any(p.node == name for p in pods.values()):
                    self.wake(key)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the per-job loop

    async def run_job(self, namespace: str, name: str, stopped: Any,
                      body: dict[str, Any] | None = None) -> None:
        """The body of the job's kopf daemon: reconcile until the job is gone or kopf stops us.
        `body` is the job as kopf's watch last showed it."""
        key = (namespace, name)
        loop = self.job_loop(key, body)
        wake = loop.wake
        failures = 0
        delay: float | None = 0.0
        try:
            while not stopped:
                if delay:
                    await _sleep(wake, stopped, delay)
                    if stopped:
                        continue
                    if not loop.awaiting_kopf:  # a new job's first write waited for one event, now here
                        await asyncio.sleep(self.settings.batch_seconds)  # let a burst of events land
                wake.clear()
                try:
                    delay = await self.reconcile(loop)
                    failures = 0
                except Exception as e:
                    failures += 1
                    delay = min(0.5 * 2 ** failures, 30.0)
                    self.metrics.reconcile_errors.inc()
                    log.warning("reconcile of %s/%s failed (%s); retrying in %.1fs", namespace, name, e,
                                delay, exc_info=not isinstance(e, ApiError))
                if delay is None:
                    break
            else:
                # kopf stopped the loop; a job being deleted still tells Kueue that no pod will replace
                # its pods
                try:
                    await self.close_deleted(loop)
                except ApiError as e:
                    log.warning("closing the deleted job %s/%s failed: %s", namespace, name, e)
        finally:
            if self.jobs.get(key) is loop:
                del self.jobs[key]
            self.admission.withdraw(key)
            if loop.scraping.task is not None:
                loop.scraping.task.cancel()

    def job_loop(self, key: Key, body: dict[str, Any] | None = None) -> JobLoop:
        """A new loop for the job, known to the controller's wake-ups; `body` as kopf's watch showed it."""
        loop = self.jobs[key] = JobLoop(key, self.clock)
        if body is not None:
            loop.first_seen(body)
        return loop

    async def reconcile(self, loop: JobLoop) -> float | None:
        """One read-decide-write pass; the delay until the next one, or None when the job is gone.

        The pods come from the informer, except on a loop's first pass (unless the job was never
        reconciled), once per resync period, and whenever a decision rests on a pod being absent:
        then from a consistent LIST. The job is the newest body the loop has seen: GET on its
        first pass (unless never reconciled: `JobLoop.first_seen`), once per resync period and
        after a status write lost to a newer version (the write's resourceVersion guard catches
        any lag).
        """
        started = time.perf_counter()
        key = namespace, name = loop.key
        job_path = path(API_VERSION, PLURAL, namespace, name)
        if loop.body is None or self.clock.monotonic() - loop.body_read > self.settings.resync_seconds:
            loop.body, loop.body_read = await self.kube.get(job_path), self.clock.monotonic()
        if (body := loop.body) is None:
            return None
        if body["metadata"].get("deletionTimestamp"):
            # ownerReferences let the garbage collector remove the rest
            await self._close(loop, body)
            return None
        wait = loop.finalizer_wait(body)
        loop.awaiting_kopf = wait > 0
        if loop.awaiting_kopf:
            return wait  # the watch event that brings kopf's finalizer wakes the loop (job_seen)
        now = self.clock.now()
        nodes = self.node_informer.items  # by name; decide only reads it
        stale = loop.list_due(body, self.settings.resync_seconds)
        if not body.get("status"):
            loop.pods.last_listed = self.clock.monotonic()  # a new job's resync starts with its first pass
        pods = await self.listed_pods(loop) if stale else self.pods(loop)
        spec = loop.resolved(body)
        queued = await self._queued(loop, spec, pods)
        room = self._room(loop, spec, pods)
        decision = lifecycle.decide(body, pods, nodes, now, self.settings.lifecycle, spec=spec,
                                    rejection=loop.rejection, queued=queued, room=room)
        if decision.verify and not stale:
            pods = await self.listed_pods(loop)
            decision = lifecycle.decide(body, pods, nodes, now, self.settings.lifecycle, spec=spec,
                                        rejection=loop.rejection, queued=queued, room=room)
        if not await self._write_status(loop, job_path, body, decision.status, decision.merged):
            return 0.05  # the job changed under us: read it again
        self._count(status.read(body.get("status")), decision.status)
        loop.phase, loop.goodput = decision.status.phase or "", decision.status.goodput
        self.on_decision(loop, decision)
        # The events go beside the actions: a new job's pods need not wait for its Created event.
        await asyncio.gather(*(self._post_event(body, e.type, e.reason, e.message) for e in decision.events),
                             self._apply(body, loop, pods, decision.actions, decision.release_at_creation))
        if decision.gang is not None:
            self.admission.request(decision.gang)
        else:
            self.admission.withdraw(key)
        delay = min(decision.requeue_after if decision.requeue_after is not None
                    else self.settings.resync_seconds,
                    self.settings.resync_seconds)
        delay = max(delay, 0.1)
        if decision.status.phase == Phase.RUNNING:
            self._maybe_scrape(body, loop, pods, decision.status, due=decision.read_now)
            delay = min(delay, self.settings.scrape_interval_seconds)
        self.metrics.reconcile_duration.observe(time.perf_counter() - started)
        return delay

    async def close_deleted(self, loop: JobLoop) -> None:
        body = await self.kube.get(path(API_VERSION, PLURAL, *loop.key))
        if body is not None and body["metadata"].get("deletionTimestamp"):
            await self._close(loop, body)

    async def _close(self, loop: JobLoop, body: dict[str, Any]) -> None:
        """The job goes: its pods' annotations say so (Kueue then lets them go)."""
        if (job := loop.resolved(body).job) is not None:
            await asyncio.gather(*(self._annotate_pod(loop.key[0], a)
                                   for a in closing.close_group(job.spec, self.pods(loop))))

    # ------------------------------------------------------------------ writes

    async def _write_status(self, loop: JobLoop, job_path: str, body: dict[str, Any],
                            new: ParallelTrainingJobStatus,
                            merged: dict[str, dict[str, Any]] | None = None) -> bool:
        """Write the pass's status over the body it read, guarded by that body's resourceVersion;
        False when the job changed or went meanwhile."""
        patch = status.patch(body.get("status") or {}, new, merged)
        if patch is None:
            return True
        rv = body["metadata"]["resourceVersion"]
        rsp = await self.kube.patch(f"{job_path}/status",
                                    {"metadata": {"resourceVersion": rv}, "status": patch}, ok=(404, 409))
        if rsp is None:
            loop.body = None  # changed or gone: the next pass reads it
            return False
        loop.keep(rsp, read=True)
        return True

    def _count(self, old: ParallelTrainingJobStatus, new: ParallelTrainingJobStatus) -> None:
        before, after = old.phase, new.phase
        if before is None and after is not None:
            self.metrics.jobs_created.inc()
        if new.restarts_in_place > old.restarts_in_place:
            self.metrics.restarts.labels(in_place.REASON).inc(new.restarts_in_place - old.restarts_in_place)
        if before == after:
            return
        reason = next((c.reason for c in new.conditions if c.type == after), "")
        if after == Phase.SUCCEEDED:
            self.metrics.jobs_succeeded.inc()
        elif after == Phase.FAILED:
            self.metrics.jobs_failed.labels(reason).inc()
        elif after == Phase.RESTARTING and new.restarts > old.restarts:
            self.metrics.restarts.labels(reason).inc()

    async def _post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        now = format_time(self.clock.now())
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"],
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_, "reason": reason, "message": message[:1000],
            "source": {"component": COMPONENT}, "reportingComponent": f"tetrad.dev/{COMPONENT}",
            "reportingInstance": self.instance, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            await self.kube.create(path("v1", "events", meta["namespace"]), event)
        except ApiError as e:
            log.warning("could not record event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], e)

    def _expected(self, loop: JobLoop, observed: Iterable[PodState]) -> dict[str, float]:
        """Pods this operator created that the watch has not shown yet (stale entries expire)."""
        exp = loop.pods.expected
        seen = {p.name for p in observed}
        cutoff = self.clock.monotonic() - EXPECTATION_SECONDS
        for name in [n for n, t in exp.items() if n in seen or t < cutoff]:
            del exp[name]
        return exp

    async def _apply(self, job: dict[str, Any], loop: JobLoop, pods: list[PodState],
                     actions: list[lifecycle.Action], release: GangRequest | None = None) -> None:
        namespace = loop.key[0]
        expected = self._expected(loop, pods)
        if not expected:  # objects of an incarnation whose creation is under way are ensured already
            # PodGroups last: the Workload API admits a PodGroup only once its Workload exists.
            ensures = [a.obj for a in actions if isinstance(a, Ensure)]
            for group in ([o for o in ensures if o["kind"] != "PodGroup"],
                          [o for o in ensures if o["kind"] == "PodGroup"]):
                await asyncio.gather(*(self._ensure(job, o) for o in group))
        creates = [a for a in actions if isinstance(a, CreatePod) and a.name not in expected]
        # A whole new built-in gang that fits now goes without its gates (none of it created yet).
        released = None
        if release is not None and len(creates) == len(release.pods) and not expected:
            released = await self.admission.reserve(release)
        if released is not None:
            now = self.clock.now()
            creates = [CreatePod(created_released(a.obj, now, released.pins.get(a.name))) for a in creates]
        calls: list[Awaitable[None]] = [self._create_pod(loop, a) for a in creates]
        for a in actions:
            if isinstance(a, DeletePod):
                expected.pop(a.name, None)
                calls.append(self._delete_pod(loop, a))
        calls += [self._delete_stale_gang(namespace, job, a)
                  for a in actions if isinstance(a, DeleteStaleGang)]
        calls += [self._annotate_pod(namespace, a) for a in actions if isinstance(a, AnnotatePod)]
        calls += [self._ask_in_place(loop, pods, a) for a in actions if isinstance(a, AskInPlace)]
        ungates = [p for a in actions if isinstance(a, Ungate) for p in a.pods]
        if ungates:
            calls.append(ungate(self.kube, namespace, ungates, self.limit))
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            if released is not None:
                self.admission.unreserve(loop.key)
        if creates:
            await self._count_refusals(job, loop, results[:len(creates)])
        if any(isinstance(a, DeleteJob) for a in actions):
            meta = job["metadata"]
            log.info("deleting %s/%s: ttlSecondsAfterFinished ran out", namespace, meta["name"])
            await self.kube.delete(path(API_VERSION, PLURAL, namespace, meta["name"]), uid=meta["uid"],
                                   propagation="Background")
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    def _room(self, loop: JobLoop, spec: lifecycle.ResolvedJob, pods: list[PodState]) -> int | None:
        """An elastic job's room (GangAdmitter.room), counted on a pod of its newest incarnation while a
        shrink or a grow is to be judged, and once for a gang first seen running whole at spec.nodes (its
        pods ran before a pass saw them wait); not again while it runs whole."""
        job = spec.job
        if job is None or job.spec.elastic is None or not pods:
            return None
        newest = max(pods, key=lambda p: p.restart)
        gang = [p for p in pods if p.restart == newest.restart]
        last = status.read((loop.body or {}).get("status")).elastic
        counted = last is not None and last.room is not None
        if counted and len(gang) == job.spec.nodes and all(p.phase == "Running" for p in gang):
            return None  # status.elastic.room keeps its last count
        return self.admission.room(loop.key, newest, job.spec.nodes)

    async def _queued(self, loop: JobLoop, spec: lifecycle.ResolvedJob, pods: list[PodState]) -> str | None:
        """Why the job's scheduler holds its group, while a pod waits: read from the backend's
        `queue_object` (Kueue: its Workload's QuotaReserved=False message), at most every
        QUEUE_READ_SECONDS per incarnation (a gang's pod events come many a second; a new
        incarnation reads it at once)."""
        job = spec.job
        if job is None or (backend := gangs.backend(job.spec)).queue_object is None:
            return None
        waiting = [p for p in pods if p.phase == "Pending" and p.node is None and not p.deleting]
        if not waiting:
            return None
        restart = max(p.restart for p in waiting)
        group = backend.group_name(loop.key[1], restart)
        if (loop.queue_read and loop.queue_read[0] == restart
                and self.clock.monotonic() - loop.queue_read[1] < QUEUE_READ_SECONDS):
            return loop.queue_read[2]
        reason = backend.queued_reason(await self.kube.get(path(*backend.queue_object, loop.key[0], group)))
        loop.queue_read = (restart, self.clock.monotonic(), reason)
        return reason

    async def _ensure(self, job: dict[str, Any], obj: dict[str, Any]) -> None:
        """Server-side apply the object, unless an object of that name belongs to someone else.

        The operator's field manager owns what it renders: a field it stops rendering is removed
        from the object at the next incarnation.
        """
        url = object_path(obj)
        existing = await self.kube.get(url)
        if existing is not None:
            owners = {r.get("uid") for r in existing["metadata"].get("ownerReferences") or []}
            if job["metadata"]["uid"] not in owners:
                message = (f"{obj['kind']} {obj['metadata']['name']} exists and is not owned by this job; "
                           "delete it or rename the job")
                await self._post_event(job, "Warning", "ObjectConflict", message)
                raise ApiError(409, "PATCH", url, {"reason": "Conflict", "message": message})
        await self.kube.apply(url, obj, FIELD_MANAGER)

    async def _delete_stale_gang(self, namespace: str, job: dict[str, Any], action: DeleteStaleGang) -> None:
        """The group objects of earlier incarnations. A Workload API PodGroup goes once its pods are
        gone (the apiserver's PodGroupProtection finalizer holds it until then)."""
        selector = f"{contract.LABEL_JOB}={job['metadata']['name']},{contract.LABEL_RESTART}!={action.keep}"
        for api_version, kind in action.kinds:
            await self.kube.delete_collection(path(api_version, kind, namespace), selector)

    async def _annotate_pod(self, namespace: str, action: AnnotatePod) -> None:
        """A merge patch of the pod's annotations, if it is still the pod (uid) the decision saw."""
        body = {"metadata": {"uid": action.uid, "annotations": action.annotations}}
        async with self.limit:
            await self.kube.patch(path("v1", "pods", namespace, action.name), body, ok=(404, 409))

    async def _ask_in_place(self, loop: JobLoop, pods: list[PodState], action: AskInPlace) -> None:
        """Ask pod 0's coordinator of restarts in place for the next round, and write its answer into
        status.inPlaceAsk.accepted (a refusal, or no answer, and the lifecycle recreates a stalled gang;
        a user's ask is told refused in a Warning Event)."""
        job = loop.resolved(loop.body or {}).job
        pod0 = next((p for p in pods if p.name == action.name and p.uid == action.uid), None)
        host = self.settings.scrape_host or (pod0.ip if pod0 is not None else None)
        gang = rounds_gang(job, action.restart) if job is not None else ""
        accepted = bool(job is not None and host and await asyncio.to_thread(
            rounds.ask, host, rounds_port(job.spec), gang, action.round, action.why, action.save))
        log.info("%s/%s: pod 0's coordinator %s the restart in place of round %d", *loop.key,
                 "took" if accepted else "refused (or did not answer)", action.round)
        if action.save and not accepted and loop.body is not None:
            await self._post_event(loop.body, "Warning", "RestartNotInPlace", (
                f"{action.why}: pod 0's coordinator did not take it (a failure or another restart in "
                "place was under way, a node had not joined yet, or it did not answer); set a new token "
                "to ask again"))
        held = ((loop.body or {}).get("status") or {}).get("inPlaceAsk") or {}
        if (held.get("restart"), held.get("round")) != (action.restart, action.round):
            return  # another ask since (the lifecycle's): this answer is not its
        try:
            written = await self.kube.patch(path(API_VERSION, PLURAL, *loop.key, "status"),
                                            {"status": {"inPlaceAsk": {"accepted": accepted}}})
        except ApiError as e:
            log.warning("could not write the answer of %s/%s's coordinator: %s", *loop.key, e)
            return
        if written is not None:
            loop.keep(written, read=True)

    async def _create_pod(self, loop: JobLoop, action: CreatePod) -> None:
        async with self.limit:
            created = await self.kube.create(path("v1", "pods", loop.key[0]), action.obj)
        loop.pods.expected[action.name] = self.clock.monotonic()
        if created:
            self.metrics.pods_created.inc()

    async def _count_refusals(self, job: dict[str, Any], loop: JobLoop, results: list[Any]) -> None:
        refused = loop.count_creations(results)
        if refused:
            more = f" ({len(refused) - 1} more pods refused alike)" if len(refused) > 1 else ""
            await self._post_event(job, "Warning", "FailedCreatePod", f"{refused[0]}{more}")

    async def _delete_pod(self, loop: JobLoop, action: DeletePod) -> None:
        async with self.limit:
            found = await self.kube.delete(path("v1", "pods", loop.key[0], action.name), uid=action.uid,
                                           grace_seconds=0 if action.force else None)
        if not found:  # already gone (or replaced): the informer may hold a stale entry
            loop.pods.gone.add(action.uid)
        self.metrics.pods_deleted.labels(str(action.force).lower()).inc()

    # ------------------------------------------------------------------ live training figures

    def _maybe_scrape(self, job: dict[str, Any], loop: JobLoop, pods: list[PodState],
                      decided: ParallelTrainingJobStatus, due: bool = False) -> None:
        now = self.clock.monotonic()
        if loop.scraping.busy(now, due):
            loop.scraping.owed |= due  # due and busy: a read is in flight
            return
        restart = decided.restarts
        rank0 = next((p for p in pods if p.rank == 0 and p.restart == restart and p.phase == "Running"), None)
        host = self.settings.scrape_host or (rank0.ip if rank0 else None)
        if not host or self.session is None:
            return
        spec = job.get("spec") or {}
        port = int((spec.get("metrics") or {}).get("port") or 9400)
        checkpoint_path = (spec.get("checkpoint") or {}).get("path") or Checkpoint().path
        loop.scraping.next_at = now + self.settings.scrape_interval_seconds
        loop.scraping.task = asyncio.create_task(self._scrape(loop.key, host, port, checkpoint_path, restart),
                                                 name=f"scrape {loop.key}")

    async def _scrape(self, key: Key, host: str, port: int, checkpoint_path: str, restart: int) -> None:
        try:
            await self._read_rank0(key, host, port, checkpoint_path, restart)
        finally:
            if (loop := self.jobs.get(key)) is not None and loop.scraping.owed:
                loop.scraping.owed = False
                loop.wake.set()

    async def _read_rank0(self, key: Key, host: str, port: int, checkpoint_path: str, restart: int) -> None:
        """Rank 0's figures into the job's status; a read that answers a judgment wakes the job's loop."""
        assert self.session is not None
        read = await scrape.fetch(self.session, host, port, self.settings.scrape_timeout_seconds)
        if read is None:
            self.metrics.scrapes.labels("unreachable").inc()
            return
        held = (loop.body if (loop := self.jobs.get(key)) is not None and loop.body is not None else {})
        stored = status.read({"trainerTime": (held.get("status") or {}).get("trainerTime")}).trainer_time
        patch = scrape.status_patch(read, checkpoint_path, restart, self.clock.now(), stored)
        try:
            written = await self.kube.patch(path(API_VERSION, PLURAL, key[0], key[1], "status"),
                                            {"status": patch})
            if written is not None and (loop := self.jobs.get(key)) is not None:
                loop.keep(written, read=True)
                if scrape.judged_at_once(patch, held.get("status") or {}):
                    loop.wake.set()
            self.metrics.scrapes.labels("ok").inc()
        except ApiError as e:
            self.metrics.scrapes.labels("error").inc()
            log.warning("could not write training figures of %s/%s: %s", key[0], key[1], e)


def pod_view(body: Mapping[str, Any]) -> PodState | None:
    """The operator's pods, all of them; another's only while it may take room on a node."""
    pod = PodState.from_body(body)
    return pod if pod.job or not pod.terminal else None


def job_key(pod: PodState) -> Key | None:
    return (pod.namespace, pod.job) if pod.job else None


async def _sleep(wake: asyncio.Event, stopped: Any, timeout: float) -> None:
    """Until woken, stopped, or the timeout."""
    waits = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
