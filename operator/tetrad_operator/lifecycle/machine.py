"""One evaluation of `decide`: the old status, the new one being built, and what every step shares.

`JobPass` owns the phase transitions (exactly the current phase's condition is True), the
judgement of pods whose node is gone or NotReady, the deletion of pods (forced where no kubelet
will finish it), and the end of the job (cleanPodPolicy, TTL). It reads only its arguments.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tetrad.api.spec import CleanPodPolicy, Phase, RunPolicy
from tetrad_operator.lifecycle.actions import Decision, DeleteJob, DeletePod, Event
from tetrad_operator.state import NodeState, PodState, format_time, parse_time

TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)


@dataclass(frozen=True)
class Settings:
    """The lifecycle's tunables; the operator reads them from TETRAD_OPERATOR_<NAME> (settings.py)."""

    node_lost_seconds: float = 60.0  # a pod's node NotReady this long: the pod is lost
    stuck_terminating_seconds: float = 30.0  # past its grace period: force-delete the pod
    node_unknown_seconds: float = 10.0  # bound to a node we have never seen: lost after this long
    pod_create_attempts: int = 3  # passes whose pod creations the API server rejects before the job fails
    stall_floor_seconds: float = 300.0  # the default stall timeout is at least this (start-up included)
    stall_step_factor: float = 10.0  # ... and at least this many times the measured step time
    stall_startup_factor: float = 2.0  # before the first step: at least this many times the last start-up
    stall_collective_margin_seconds: float = 60.0  # ... and at least runPolicy.collectiveTimeoutSeconds + this


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                  now: datetime) -> None:
    """Upsert a condition; lastTransitionTime moves only when its status flips."""
    for c in conditions:
        if c.get("type") == type_:
            if c.get("status") != status:
                c["lastTransitionTime"] = format_time(now)
            c.update(status=status, reason=reason, message=message)
            return
    conditions.append({"type": type_, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": format_time(now)})


def get_condition(status: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


# Status fields only the scraper writes: a pass never writes them, so a restart keeps them.
SCRAPER_OWNED = ("training", "checkpoint", "preflight")


class JobPass:
    def __init__(self, body: Mapping[str, Any], pods: Sequence[PodState], nodes: Mapping[str, NodeState],
                 now: datetime, settings: Settings):
        self.body = body
        self.meta = body.get("metadata", {})
        self.name: str = self.meta.get("name", "")
        self.namespace: str = self.meta.get("namespace", "default")
        self.status: dict[str, Any] = copy.deepcopy(dict(body.get("status") or {}))
        for key in SCRAPER_OWNED:
            self.status.pop(key, None)
        self.status.setdefault("conditions", [])
        self.status.setdefault("restarts", 0)
        self.status.setdefault("disruptions", 0)
        if self.meta.get("generation") is not None:
            self.status["observedGeneration"] = self.meta["generation"]
        self.pods = list(pods)
        self.nodes = nodes
        self.now = now
        self.settings = settings
        self.decision = Decision(status=self.status)

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    def transition(self, phase: Phase, reason: str, message: str, warning: bool = False) -> None:
        previous = self.phase
        conds = self.status["conditions"]
        current = self.condition(phase)
        if previous != phase or current is None or current.get("reason") != reason:
            self.decision.events.append(Event("Warning" if warning else "Normal", reason, message))
        if previous and previous != phase:
            set_condition(conds, previous, "False", reason, message, self.now)
        set_condition(conds, phase.value, "True", reason, message, self.now)
        self.status["phase"] = phase.value
        self.status["message"] = message

    def set_condition(self, type_: str, status: str, reason: str, message: str) -> None:
        set_condition(self.status["conditions"], type_, status, reason, message, self.now)

    def merge(self, key: str, fields: dict[str, Any]) -> None:
        """Merge `fields` into status.<key>, one of SCRAPER_OWNED (the Decision carries them: see Decision.merged)."""
        assert key in SCRAPER_OWNED, key
        self.decision.merged[key] = {**self.decision.merged.get(key, {}), **fields}

    def condition(self, type_: str) -> dict[str, Any] | None:
        return get_condition(self.status, type_)

    def since(self, type_: str) -> datetime:
        c = self.condition(type_)
        return parse_time(c.get("lastTransitionTime") if c else None) or self.now

    # ------------------------------------------------------------------ pods the cluster took away

    def lost(self, pod: PodState) -> str | None:
        """Why the pod's node can no longer run it, or None."""
        if pod.node is None or pod.terminal:
            return None
        node = self.nodes.get(pod.node)
        if node is None:
            seen = pod.scheduled_at or pod.created
            if seen is None or (self.now - seen).total_seconds() >= self.settings.node_unknown_seconds:
                return f"node {pod.node} no longer exists"
            self.decision.after(self.settings.node_unknown_seconds)
            return None
        if not node.ready:
            since = node.ready_changed or self.now
            waited = (self.now - since).total_seconds()
            if waited >= self.settings.node_lost_seconds:
                return f"node {pod.node} has not been Ready for {int(waited)}s"
            self.decision.after(self.settings.node_lost_seconds - waited)
        return None

    def stuck(self, pod: PodState) -> bool:
        if pod.deleting_since is None:
            return False
        limit = pod.grace_seconds + self.settings.stuck_terminating_seconds
        waited = (self.now - pod.deleting_since).total_seconds()
        if waited >= limit:
            return True
        self.decision.after(limit - waited)
        return False

    def delete(self, pods: Sequence[PodState]) -> None:
        """Delete these pods; force those no kubelet will finish deleting."""
        for p in pods:
            forced = self.lost(p) is not None or (p.node is not None and p.node not in self.nodes)
            if p.deleting:
                if forced or self.stuck(p):
                    self.decision.actions.append(DeletePod(p.name, p.uid, force=True))
            else:
                self.decision.actions.append(DeletePod(p.name, p.uid, force=forced))
        if pods:
            self.decision.after(2.0)  # until the pods are gone

    # ------------------------------------------------------------------ the end of the job

    def fail(self, reason: str, message: str, policy: RunPolicy) -> None:
        self.transition(Phase.FAILED, reason, message, warning=True)
        self.status["completionTime"] = format_time(self.now)
        self.finished(policy)

    def finished(self, policy: RunPolicy) -> None:
        """The job ended: clean its pods as cleanPodPolicy says, and delete it once its TTL ran out."""
        if policy.clean_pod_policy == CleanPodPolicy.ALL:
            self.delete(self.pods)
        elif policy.clean_pod_policy == CleanPodPolicy.RUNNING:
            self.delete([p for p in self.pods if not p.terminal])
        ttl = policy.ttl_seconds_after_finished
        if ttl is not None:
            done = parse_time(self.status.get("completionTime")) or self.now
            left = ttl - (self.now - done).total_seconds()
            if left <= 0:
                self.decision.actions.append(DeleteJob())
            else:
                self.decision.after(left)
