"""The lifecycle's scenarios on the real controller: `FakeCluster` runs Controller.reconcile over the
in-memory Kubernetes (memory_kube.MemoryKube) and plays scheduler and kubelet in `tick()`. Tests
inject pod outcomes by editing the objects in place, as a kubelet would write them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from tetrad_operator import lifecycle
from tetrad_operator.controller import EXPECTATION_SECONDS, FINALIZER, QUEUE_READ_SECONDS, Controller
from tetrad_operator.kubeapi import ApiError, path
from tetrad_operator.lifecycle import core
from tetrad_operator.observed import NodeState, PodState, format_time
from tetrad_operator.packing import GangRequest
from tetrad_operator.settings import OperatorSettings

from tetrad.api import contract
from tetrad.render import names
from tetrad.render.gangs.kueue import API_VERSION as KUEUE_API_VERSION

from .memory_kube import MemoryKube, Refused

T0 = datetime(2030, 1, 1, tzinfo=UTC)
R = TypeVar("R")
EXTRA_LABEL = "tetrad.dev/test-extra"


def older_renderer(monkeypatch: Any) -> dict[str, bool]:
    """Render as an older operator version did (a ConfigMap key, a Service label and port more)
    while the switch it returns is on, as this one once it is off."""
    real_render = core.render
    extra = {"on": True}

    def render(job: Any, **kwargs: Any) -> Any:
        out = real_render(job, **kwargs)
        if extra["on"]:
            out.configmap["data"]["extra.json"] = "{}"
            out.service["metadata"]["labels"][EXTRA_LABEL] = "yes"
            out.service["spec"]["ports"] = [*out.service["spec"]["ports"],
                                            {"name": "extra", "port": 1234, "protocol": "TCP"}]
        return out

    monkeypatch.setattr(core, "render", render)
    return extra


def job_body(name: str = "job", nodes: int = 2, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "tetrad.dev/v1alpha1",
        "kind": "ParallelTrainingJob",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                     "creationTimestamp": format_time(T0)},
        "spec": {"nodes": nodes, "nprocPerNode": 1, "training": {"globalBatch": 24},
                 "resources": {"cpu": "4", "memory": "8Gi"}, **spec},
    }
    return body


def node_body(name: str, cpu: str = "16", memory: str = "64Gi", gpu: int = 0, ready: bool = True,
              labels: dict[str, str] | None = None, taints: list[dict[str, Any]] | None = None,
              since: datetime = T0) -> dict[str, Any]:
    alloc = {"cpu": cpu, "memory": memory, "pods": "110"}
    if gpu:
        alloc["nvidia.com/gpu"] = str(gpu)
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"taints": taints or []},
        "status": {"allocatable": alloc, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False",
             "lastTransitionTime": format_time(since)}]},
    }


def terminated(pod: dict[str, Any], code: int, message: str | None = None) -> None:
    """What a kubelet reports when the trainer container exits (with its termination message)."""
    pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
    state = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
    pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": state}}]
    if message is not None:
        state["message"] = message


class ScenarioClock:
    """The scenario's time, as tests set it (`now`), and the job loop's timer (`monotonic`), which
    moves with it and, between two passes, past every period the loop remembers things for."""

    def __init__(self, now: datetime):
        self.wall, self.elapsed = now, 0.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.elapsed


# Each pass is the loop's resync pass: it GETs the job and LISTs its pods afresh, its expectations
# have lapsed and Kueue's reason is read again, so a scenario depends on the cluster alone (the
# loop's memory within a period is test_units' matter).
PASS_APART = max(OperatorSettings.resync_seconds, EXPECTATION_SECONDS, QUEUE_READ_SECONDS) + 1.0
JOBS = path(contract.API_VERSION, contract.PLURAL, "ns")


async def decline(request: GangRequest) -> None:
    """An admission that never lets a new gang be created released (no round runs in these tests)."""
    return None


class FakeCluster:
    """One job, its namespace "ns" and the nodes, in memory; the operator's Controller over them.

    `reconcile()` is one pass of Controller.reconcile and returns its Decision; with `admit` it is
    followed, when the pass asked, by a round of the built-in gang admission (as the admission's own
    loop would run it). The admission declines to create a new gang released: the gang is created
    gated and released by that round, as the scenarios expect. Each call runs the controller's
    informers over the cluster for its while; edits made in place before it are written first
    (MemoryKube.sync).
    """

    def __init__(self, job: dict[str, Any], nodes: list[dict[str, Any]] | None = None,
                 settings: lifecycle.Settings | None = None):
        self.clock = ScenarioClock(T0)
        self.kube = MemoryKube(clock=self.clock.now)
        meta = job["metadata"]
        self.name = meta["name"]
        finalizers = [*meta.get("finalizers", []), FINALIZER]  # kopf's, added when its daemon starts
        self.kube.put(f"{JOBS}/{self.name}", {**job, "metadata": {**meta, "finalizers": finalizers}})
        for node in nodes or [node_body("n0", cpu="64", memory="256Gi")]:
            self.nodes[node["metadata"]["name"]] = node
        self.settings = settings or lifecycle.Settings()
        # a connection the operator makes to a pod (a scrape, an ask of pod 0's coordinator) goes to loopback
        operator = OperatorSettings(lifecycle=self.settings, scrape_host="127.0.0.1")
        self.controller = Controller(self.kube, operator, clock=self.clock)
        self.controller.admission.reserve = decline  # type: ignore[method-assign]
        self.loop = self.controller.job_loop(("ns", self.name))
        self.decisions: list[lifecycle.Decision] = []
        self.controller.on_decision = lambda loop, decision: self.decisions.append(decision)
        self.placement: dict[str, str] = {}  # pod -> node, as the admission planned it
        self._refuse: str | None = None
        self._queued: str | None = None
        self._events = asyncio.new_event_loop()
        weakref.finalize(self, self._events.close)

    # ------------------------------------------------------------------ observation

    @property
    def job(self) -> dict[str, Any] | None:
        return self.kube.collection(JOBS).get(self.name)

    @property
    def pods(self) -> Any:
        return self.kube.collection(path("v1", "pods", "ns"))

    @property
    def nodes(self) -> Any:
        return self.kube.collection(path("v1", "nodes"))

    @property
    def objects(self) -> dict[tuple[str, str], dict[str, Any]]:
        """What the operator ensures beside the pods: (kind, name) -> object."""
        return {(o["kind"], o["metadata"]["name"]): o for o in self.kube.objects("ns")
                if o["kind"] not in ("Pod", "Event", contract.KIND)}

    @property
    def events(self) -> list[lifecycle.Event]:
        """The job's Events the operator posted, in order."""
        return [lifecycle.Event(e["type"], e["reason"], e["message"]) for e in self.kube.objects("ns")
                if e["kind"] == "Event" and e["involvedObject"]["name"] == self.name]

    def pod_states(self) -> list[PodState]:
        return [PodState.from_body(p) for p in self.pods.values()]

    def node_states(self) -> dict[str, NodeState]:
        return {k: NodeState.from_body(v) for k, v in self.nodes.items()}

    @property
    def status(self) -> dict[str, Any]:
        assert self.job is not None
        return self.job.get("status") or {}

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def now(self) -> datetime:
        return self.clock.wall

    @now.setter
    def now(self, value: datetime) -> None:
        self.clock.elapsed += max((value - self.clock.wall).total_seconds(), 0.0)
        self.clock.wall = value

    @property
    def rejection(self) -> lifecycle.PodRejection | None:
        """The passes in a row whose pod creations the API server refused, as the loop counts them."""
        return self.loop.rejection

    def alive(self) -> list[dict[str, Any]]:
        return [p for p in self.pods.values() if p["status"]["phase"] in ("Pending", "Running")]

    # ------------------------------------------------------------------ the rest of the cluster

    @property
    def refuse(self) -> str | None:
        """The API server's answer to every pod creation (a quota, say), when set."""
        return self._refuse

    @refuse.setter
    def refuse(self, message: str | None) -> None:
        self._refuse = message

        def quota(verb: str, obj: dict[str, Any]) -> None:
            if verb == "create" and obj.get("kind") == "Pod" and self._refuse is not None:
                raise Refused(403, "Forbidden", self._refuse)

        self.kube.webhooks = [quota]

    @property
    def queued(self) -> str | None:
        """What Kueue says on the job's Workload while it does not admit the pods."""
        return self._queued

    @queued.setter
    def queued(self, reason: str | None) -> None:
        self._queued = reason
        held = {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": reason}
        self.kube.put(path(KUEUE_API_VERSION, "workloads", "ns", names.pod_group(self.name)), {
            "apiVersion": KUEUE_API_VERSION, "kind": "Workload",
            "metadata": {"name": names.pod_group(self.name)},
            "status": {"conditions": [held if reason else {"type": "QuotaReserved", "status": "True"}]}})

    # ------------------------------------------------------------------ the operator

    def reconcile(self, admit: bool = True) -> lifecycle.Decision:
        return self._run(self._pass(admit))

    async def _pass(self, admit: bool) -> lifecycle.Decision:
        self.clock.elapsed += PASS_APART
        decided = len(self.decisions)
        try:
            await self.controller.reconcile(self.loop)
        except ApiError:  # an action the API server refused (a pod creation): the loop logs it, tries again
            if len(self.decisions) == decided:
                raise
        assert len(self.decisions) == decided + 1, "the pass wrote no status"
        decision = self.decisions[-1]
        await self.kube.idle()
        job = self.job
        if job is not None and job["metadata"].get("deletionTimestamp"):  # kopf stops the job's loop
            await self.controller.close_deleted(self.loop)
            finalizers = [f for f in job["metadata"]["finalizers"] if f != FINALIZER]
            await self.kube.patch(f"{JOBS}/{self.name}", {"metadata": {"finalizers": finalizers}})
        if admit and decision.gang is not None:
            for release in await self.controller.admission.admit_once():
                self.placement.update(release.placement)
        return decision

    def _run(self, work: Awaitable[R]) -> R:
        return self._events.run_until_complete(self._session(work))

    async def _session(self, work: Awaitable[R]) -> R:
        """The controller's informers over the cluster, for the while of `work`."""
        self.kube.sync()
        await self.controller.watch()
        await self.kube.idle()
        try:
            return await work
        finally:
            await self.controller.stop()

    def _ungate(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod:
            pod["spec"]["schedulingGates"] = [g for g in pod["spec"].get("schedulingGates", [])
                                              if g["name"] != contract.GANG_GATE]

    # ------------------------------------------------------------------ scheduler and kubelet

    def tick(self, seconds: float = 1.0, *, schedule: bool = True, run: bool = True,
             kubelet_deletes: bool = True) -> None:
        self.now += timedelta(seconds=seconds)
        for name, pod in list(self.pods.items()):
            meta, spec, st = pod["metadata"], pod["spec"], pod["status"]
            if meta.get("deletionTimestamp"):
                if kubelet_deletes and spec.get("nodeName") in self.nodes and not meta.get("finalizers"):
                    del self.pods[name]
                continue
            if schedule and not spec.get("nodeName") and not spec.get("schedulingGates"):
                spec["nodeName"] = self.placement.get(name) or sorted(self.nodes)[0]
                st["conditions"] = [{"type": "PodScheduled", "status": "True",
                                     "lastTransitionTime": format_time(self.now)}]
            elif run and spec.get("nodeName") and st["phase"] == "Pending":
                st["phase"] = "Running"
                st["podIP"] = f"198.18.64.{int(meta['labels'][contract.LABEL_RANK]) + 1}"

    def settle(self, steps: int = 20, seconds: float = 1.0) -> None:
        for _ in range(steps):
            if self.job is None:
                return
            self.reconcile()
            self.tick(seconds)

    def finish(self, code: int = 0, rank: int | None = None, message: str | None = None) -> None:
        for pod in self.pods.values():
            if pod["status"]["phase"] == "Running" and (
                    rank is None or pod["metadata"]["labels"][contract.LABEL_RANK] == str(rank)):
                terminated(pod, code, message)
