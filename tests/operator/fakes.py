"""A tiny in-memory cluster for driving the pure lifecycle without an API server.

It applies a Decision the way the operator's handlers do (create-if-absent, delete-if-present,
status replaced) and plays scheduler and kubelet in `tick()`. Tests inject pod outcomes. Every
status it stores is validated against ParallelTrainingJobStatus: a key the model lacks fails.
"""

from __future__ import annotations

import copy
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from tetrad_operator import gang, lifecycle, status
from tetrad_operator.state import NodeState, PodState, format_time

from tetrad.api import contract
from tetrad.api.spec import ParallelTrainingJobStatus

T0 = datetime(2030, 1, 1, tzinfo=UTC)


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
            {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": format_time(since)}]},
    }


def terminated(pod: dict[str, Any], code: int, message: str | None = None) -> None:
    """What a kubelet reports when the trainer container exits (with its termination message)."""
    pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
    state = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
    pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": state}}]
    if message is not None:
        state["message"] = message


class FakeCluster:
    def __init__(self, job: dict[str, Any], nodes: list[dict[str, Any]] | None = None,
                 settings: lifecycle.Settings | None = None):
        self.job: dict[str, Any] | None = job
        self.pods: dict[str, dict[str, Any]] = {}
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes = {n["metadata"]["name"]: n for n in (nodes or [node_body("n0", cpu="64", memory="256Gi")])}
        self.now = T0
        self.settings = settings or lifecycle.Settings()
        self.events: list[lifecycle.Event] = []
        self.created: list[str] = []  # every pod creation, in order
        self.uids = itertools.count()
        self.last: lifecycle.Decision | None = None
        self.placement: dict[str, str] = {}  # pod -> node, as the admission planned it
        self.refuse: str | None = None  # the API server's answer to every pod creation, when set
        self.rejection: lifecycle.PodRejection | None = None  # as the controller counts refused passes
        self.queued: str | None = None  # what the controller reads from Kueue

    # ------------------------------------------------------------------ observation

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

    def alive(self) -> list[dict[str, Any]]:
        return [p for p in self.pods.values() if p["status"]["phase"] in ("Pending", "Running")]

    # ------------------------------------------------------------------ the operator

    def reconcile(self, admit: bool = True) -> lifecycle.Decision:
        assert self.job is not None
        d = lifecycle.decide(self.job, self.pod_states(), self.node_states(), self.now, self.settings,
                             rejection=self.rejection, queued=self.queued)
        self.apply(d)
        if admit and d.gang is not None:
            nodes = list(self.node_states().values())
            bound = [p for p in self.pod_states() if p.node]
            for a in gang.plan_admission(nodes, bound, [], [d.gang]):
                self.placement.update(a.placement)
                for p in a.request.pods:
                    self._ungate(p.name)
        self.last = d
        return d

    def apply(self, d: lifecycle.Decision) -> None:
        assert self.job is not None
        # the controller's write leaves the scraper's fields as they are
        scraped = {k: self.status[k] for k in status.SCRAPER_OWNED if self.status.get(k)}
        self.job["status"] = status.wire(d.status) | scraped
        for key, fields in d.merged.items():  # a merge patch into the scraper's status objects
            merged = {**self.status.get(key, {}), **fields}
            self.job["status"][key] = {k: v for k, v in merged.items() if v is not None}
        ParallelTrainingJobStatus.model_validate(self.job["status"])  # strict: a misspelled key fails
        self.events += d.events
        creates = [a for a in d.actions if isinstance(a, lifecycle.CreatePod) and a.name not in self.pods]
        if creates and self.refuse is not None:
            attempts = self.rejection.attempts + 1 if self.rejection else 1
            self.rejection = lifecycle.PodRejection(attempts, self.refuse)
        elif creates:
            self.rejection = None
        for a in d.actions:
            if isinstance(a, lifecycle.Ensure):
                self.objects[(a.obj["kind"], a.obj["metadata"]["name"])] = copy.deepcopy(a.obj)
            elif isinstance(a, lifecycle.CreatePod):
                if a.name not in self.pods and self.refuse is None:
                    pod = copy.deepcopy(a.obj)
                    pod["metadata"].update(uid=f"pod-{next(self.uids)}", creationTimestamp=format_time(self.now))
                    pod["status"] = {"phase": "Pending"}
                    self.pods[a.name] = pod
                    self.created.append(a.name)
            elif isinstance(a, lifecycle.DeletePod):
                pod = self.pods.get(a.name)
                if pod is None or pod["metadata"]["uid"] != a.uid:
                    continue
                if (a.force or not pod["spec"].get("nodeName")) and not pod["metadata"].get("finalizers"):
                    del self.pods[a.name]
                else:
                    pod["metadata"].setdefault("deletionTimestamp", format_time(self.now))
                    pod["metadata"]["deletionGracePeriodSeconds"] = 30
            elif isinstance(a, lifecycle.Ungate):
                for name, _ in a.pods:
                    self._ungate(name)
            elif isinstance(a, lifecycle.AnnotatePod):
                pod = self.pods.get(a.name)
                if pod is not None and pod["metadata"]["uid"] == a.uid:
                    pod["metadata"].setdefault("annotations", {}).update(a.annotations)
            elif isinstance(a, lifecycle.DeleteStaleGang):
                for key, obj in list(self.objects.items()):
                    labels = obj["metadata"].get("labels") or {}
                    if (obj["apiVersion"], key[0]) in a.kinds and labels.get(contract.LABEL_RESTART) != str(a.keep):
                        del self.objects[key]
            elif isinstance(a, lifecycle.DeleteJob):
                self.job = None
                return

    def _ungate(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod:
            pod["spec"]["schedulingGates"] = [g for g in pod["spec"].get("schedulingGates", [])
                                              if g["name"] != contract.GANG_GATE]

    # ------------------------------------------------------------------ scheduler and kubelet

    def tick(self, seconds: float = 1.0, *, schedule: bool = True, run: bool = True, kubelet_deletes: bool = True) -> None:
        self.now += timedelta(seconds=seconds)
        for name, pod in list(self.pods.items()):
            meta, spec, st = pod["metadata"], pod["spec"], pod["status"]
            if meta.get("deletionTimestamp"):
                if kubelet_deletes and spec.get("nodeName") in self.nodes and not meta.get("finalizers"):
                    del self.pods[name]
                continue
            if schedule and not spec.get("nodeName") and not spec.get("schedulingGates"):
                spec["nodeName"] = self.placement.get(name) or sorted(self.nodes)[0]
                st["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": format_time(self.now)}]
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
            if pod["status"]["phase"] == "Running" and (rank is None or pod["metadata"]["labels"][contract.LABEL_RANK] == str(rank)):
                terminated(pod, code, message)
