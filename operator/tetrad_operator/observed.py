"""What the operator observes: compact, immutable views of pods and nodes.

The informers hold these instead of whole bodies, and the pure decisions in
`lifecycle` and `packing` read only these. Building them from a body is pure too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from tetrad.api import contract
from tetrad.api.termination import TerminationMessage
from tetrad.render import gangs
from tetrad_operator.resources import Resources, pod_requests

# Pod conditions that mean "taken away by the cluster", not "the trainer failed": Kubernetes' own,
# and those a gang scheduler sets on the pods of a group it stops (Kueue: preempted, evicted).
DISRUPTION_CONDITION = "DisruptionTarget"
DISRUPTION_CONDITIONS = frozenset({DISRUPTION_CONDITION, *gangs.DISRUPTION_CONDITIONS})
# Set on a pod when the built-in gang admission removes its gate (with the time).
RELEASED_ANNOTATION = "tetrad.dev/gang-released"


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    job: str  # the Tetrad job it belongs to; "" for a pod Tetrad does not manage
    restart: int
    rank: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    namespace: str = ""
    node: str | None = None
    ip: str | None = None
    gated: bool = False  # still holds the tetrad gang gate
    released: bool = False  # the built-in admission removed the gate
    deleting_since: datetime | None = None
    grace_seconds: int = 0
    created: datetime | None = None
    scheduled_at: datetime | None = None
    unschedulable: str | None = None  # the scheduler's last word on why it cannot place the pod
    exit_code: int | None = None
    container: str | None = None  # the container that exited with exit_code
    message: str | None = None  # that container's termination message (the node's launcher writes it)
    ended: str | None = None  # why the runtime says that container ended, e.g. Error, OOMKilled, StartError
    reason: str | None = None  # pod.status.reason, e.g. Evicted
    checkpoint_request: str | None = None  # the checkpoint-now token the operator copied onto this pod
    # its gang scheduler was told no pod will replace the group's (backend.closing_annotation)
    group_closed: bool = False
    disrupted: str | None = None  # reason of a DisruptionTarget=True condition
    requests: Resources = field(default_factory=Resources)
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity_terms: tuple[Mapping[str, Any], ...] = ()  # required node-affinity selector terms
    colocated: tuple[str, str] | None = None  # see _colocation

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def deleting(self) -> bool:
        return self.deleting_since is not None

    @cached_property
    def said(self) -> TerminationMessage:
        """What the pod's node said of why it stopped (tetrad.api.termination)."""
        return TerminationMessage.parse(self.message)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PodState:
        meta = body.get("metadata", {})
        spec = body.get("spec", {})
        status = body.get("status", {})
        labels = meta.get("labels") or {}
        gates = [g.get("name") for g in spec.get("schedulingGates") or []]
        exit_code, container, message, ended = _exit_code(status)
        disrupted = next((_disruption(c) for c in status.get("conditions") or []
                          if c.get("type") in DISRUPTION_CONDITIONS and c.get("status") == "True"), None)
        scheduled = next((c.get("lastTransitionTime") for c in status.get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "True"), None)
        unschedulable = next((c.get("message") or c.get("reason") for c in status.get("conditions") or []
                              if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
        affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or {}
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            job=(labels.get(contract.LABEL_JOB, "")
                 if labels.get(contract.LABEL_MANAGED_BY) == contract.MANAGED_BY else ""),
            namespace=meta.get("namespace", ""),
            restart=_int(labels.get(contract.LABEL_RESTART)),
            rank=_int(labels.get(contract.LABEL_RANK)),
            phase=status.get("phase") or "Pending",
            node=spec.get("nodeName") or None,
            ip=status.get("podIP") or None,
            gated=contract.GANG_GATE in gates,
            released=RELEASED_ANNOTATION in (meta.get("annotations") or {}),
            deleting_since=parse_time(meta.get("deletionTimestamp")),
            grace_seconds=int(meta.get("deletionGracePeriodSeconds") or 0),
            created=parse_time(meta.get("creationTimestamp")),
            scheduled_at=parse_time(scheduled),
            unschedulable=None if spec.get("nodeName") else unschedulable,
            exit_code=exit_code,
            container=container,
            message=message,
            ended=ended,
            reason=status.get("reason") or None,
            checkpoint_request=(meta.get("annotations") or {}).get(contract.ANNOTATION_CHECKPOINT_NOW),
            group_closed=any((meta.get("annotations") or {}).get(k) == v
                             for k, v in gangs.CLOSING_ANNOTATIONS),
            disrupted=disrupted,
            requests=pod_requests(spec),
            node_selector=tuple(sorted((spec.get("nodeSelector") or {}).items())),
            tolerations=tuple(spec.get("tolerations") or ()),
            affinity_terms=tuple(affinity.get("nodeSelectorTerms") or ()),
            colocated=_colocation(labels, spec),
        )


def _disruption(condition: Mapping[str, Any]) -> str:
    reason = condition.get("reason") or "Disrupted"
    if condition.get("type") != DISRUPTION_CONDITION and condition.get("message"):
        # a scheduler's reason alone says little (Kueue's WorkloadEvicted)
        return f"{reason}: {condition['message']}"
    return str(reason)


def _colocation(labels: Mapping[str, str], spec: Mapping[str, Any]) -> tuple[str, str] | None:
    """(topologyKey, selector) of the first required pod-affinity term the pod itself matches by
    matchLabels: the pods sharing it must land in one domain of the key (a pipeline stage in one rack)."""
    terms = ((spec.get("affinity") or {}).get("podAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    for term in terms or ():
        selector = term.get("labelSelector") or {}
        match = selector.get("matchLabels") or {}
        if (term.get("topologyKey") and match and not selector.get("matchExpressions")
                and all(labels.get(k) == v for k, v in match.items())):
            return term["topologyKey"], ",".join(f"{k}={v}" for k, v in sorted(match.items()))
    return None


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def _exit_code(status: Mapping[str, Any]) -> tuple[int | None, str | None, str | None, str | None]:
    """The exit code that explains the pod's end, its container, its termination message and the
    runtime's reason: the trainer's, else a failed init container's."""
    found: tuple[int | None, str | None, str | None, str | None] = (None, None, None, None)
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(key) or []:
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if not term or term.get("exitCode") is None:
                continue
            code = int(term["exitCode"])
            if cs.get("name") == "trainer":
                return code, "trainer", term.get("message") or None, term.get("reason") or None
            if code != 0 and found[0] is None:
                found = (code, cs.get("name"), term.get("message") or None, term.get("reason") or None)
    return found


@dataclass(frozen=True)
class NodeState:
    name: str
    ready: bool
    ready_changed: datetime | None = None  # lastTransitionTime of the Ready condition
    unschedulable: bool = False
    allocatable: Resources = field(default_factory=Resources)
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[Mapping[str, Any], ...] = ()

    @cached_property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> NodeState:
        meta = body.get("metadata", {})
        spec = body.get("spec", {})
        status = body.get("status", {})
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        return cls(
            name=meta.get("name", ""),
            ready=bool(ready and ready.get("status") == "True"),
            ready_changed=parse_time(ready.get("lastTransitionTime")) if ready else None,
            unschedulable=bool(spec.get("unschedulable")),
            allocatable=Resources.from_map(status.get("allocatable") or {}),
            labels=tuple(sorted((meta.get("labels") or {}).items())),
            taints=tuple(spec.get("taints") or ()),
        )
