"""One evaluation of `decide`: the old status, the new one being built, and what every step shares.

`JobPass` owns the phase transitions (exactly the current phase's condition is True), the
judgement of pods whose node is gone or NotReady, the deletion of pods (forced where no kubelet
will finish it), and the end of the job (cleanPodPolicy, TTL). It reads only its arguments.
The status is the model (tetrad_operator.status reads it and writes it back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from tetrad.api.spec import (
    CheckpointStatus,
    CleanPodPolicy,
    Condition,
    GoodputStatus,
    Phase,
    RunPolicy,
    TrainingStatus,
)
from tetrad_operator import status
from tetrad_operator.lifecycle import goodput
from tetrad_operator.lifecycle.actions import Decision, DeleteJob, DeletePod, Event
from tetrad_operator.observed import NodeState, PodState, format_time, parse_time

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
    # ... and at least runPolicy.collectiveTimeoutSeconds + this
    stall_collective_margin_seconds: float = 60.0
    # a stalled gang asked to restart in place: recreated if no new round shows within this long
    in_place_ask_seconds: float = 120.0


ConditionStatus = Literal["True", "False", "Unknown"]


def set_condition(conditions: list[Condition], type_: str, value: ConditionStatus, reason: str, message: str,
                  now: datetime) -> None:
    """Upsert a condition; lastTransitionTime moves only when its status flips."""
    for c in conditions:
        if c.type == type_:
            if c.status != value:
                c.last_transition_time = format_time(now)
            c.status, c.reason, c.message = value, reason, message
            return
    conditions.append(Condition(type=type_, status=value, reason=reason, message=message,
                                last_transition_time=format_time(now)))


class JobPass:
    def __init__(self, body: Mapping[str, Any], pods: Sequence[PodState], nodes: Mapping[str, NodeState],
                 now: datetime, settings: Settings):
        self.body = body
        self.meta = body.get("metadata", {})
        self.name: str = self.meta.get("name", "")
        self.namespace: str = self.meta.get("namespace", "default")
        self.read = status.read(body.get("status"))  # as stored, the scraper's objects included
        # The next status, without the scraper's objects: what a pass learns of them is merged (`decided`).
        self.status = status.read(body.get("status"), scraped=False)
        # A field set is written: every pass writes these three, even where the stored status lacks them.
        self.status.conditions = self.status.conditions
        self.status.restarts = self.status.restarts
        self.status.disruptions = self.status.disruptions
        if self.meta.get("generation") is not None:
            self.status.observed_generation = self.meta["generation"]
        self.training = (self.read.training or TrainingStatus()).model_copy(deep=True)
        self.checkpoint = (self.read.checkpoint or CheckpointStatus()).model_copy(deep=True)
        self.trainer_time = self.read.trainer_time.model_copy(deep=True) if self.read.trainer_time else None
        self.pods = list(pods)
        self.nodes = nodes
        self.now = now
        self.script = bool((body.get("spec") or {}).get("script"))  # the job runs a script of its own
        if self.status.goodput is None:
            created = parse_time(self.meta.get("creationTimestamp")) or now
            self.status.goodput = goodput.opened(created, self.status.restarts)
        self.settings = settings
        self.decision = Decision(status=self.status)

    @property
    def ledger(self) -> GoodputStatus:
        assert self.status.goodput is not None  # opened in __init__
        return self.status.goodput

    def decided(self) -> Decision:
        """The Decision, with status.goodput as of now and what this pass learned of status.training,
        status.checkpoint and status.trainerTime."""
        goodput.refresh(self.ledger, self.read.goodput, self.phase, self.now, self.status.restarts,
                        self.trainer_time, self.checkpoint, self.script)
        for key, before, after in (("training", self.read.training, self.training),
                                   ("checkpoint", self.read.checkpoint, self.checkpoint),
                                   ("trainerTime", self.read.trainer_time, self.trainer_time)):
            if after is not None and (changed := status.changes(before, after)):
                self.decision.merged[key] = changed
        return self.decision

    @property
    def phase(self) -> Phase | None:
        return self.status.phase

    def transition(self, phase: Phase, reason: str, message: str, warning: bool = False) -> None:
        previous = self.phase
        conds = self.status.conditions
        current = self.condition(phase)
        if previous != phase or current is None or current.reason != reason:
            self.decision.events.append(Event("Warning" if warning else "Normal", reason, message))
        if previous != phase:
            goodput.settle(self.ledger, previous, self.now, goodput.ending(phase), self.trainer_time,
                           self.checkpoint, self.script)
        if previous and previous != phase:
            set_condition(conds, previous.value, "False", reason, message, self.now)
        set_condition(conds, phase.value, "True", reason, message, self.now)
        self.status.phase = phase
        self.status.message = message

    def set_condition(self, type_: str, value: ConditionStatus, reason: str, message: str) -> None:
        set_condition(self.status.conditions, type_, value, reason, message, self.now)

    def warn(self, type_: str, message: str, news: Callable[[str], bool] | None = None) -> None:
        """A warning condition (its reason is its type) True with `message`, and a Warning Event when it
        turns True or when `news(the last message)` says this one tells something new (default: it
        differs)."""
        before = self.condition(type_)
        if (before is None or before.status != "True"
                or (news(before.message) if news is not None else before.message != message)):
            self.decision.events.append(Event("Warning", type_, message))
        self.set_condition(type_, "True", type_, message)

    def unwarn(self, type_: str, reason: str, message: str) -> None:
        """A warning condition that was True turns False."""
        before = self.condition(type_)
        if before is not None and before.status == "True":
            self.set_condition(type_, "False", reason, message)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.status.conditions if c.type == type_), None)

    def since(self, type_: str) -> datetime:
        c = self.condition(type_)
        return parse_time(c.last_transition_time if c else None) or self.now

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
        self.status.completion_time = format_time(self.now)
        self.finished(policy)

    def finished(self, policy: RunPolicy) -> None:
        """The job ended: clean its pods as cleanPodPolicy says, and delete it once its TTL ran out."""
        if policy.clean_pod_policy == CleanPodPolicy.ALL:
            self.delete(self.pods)
        elif policy.clean_pod_policy == CleanPodPolicy.RUNNING:
            self.delete([p for p in self.pods if not p.terminal])
        ttl = policy.ttl_seconds_after_finished
        if ttl is not None:
            done = parse_time(self.status.completion_time) or self.now
            left = ttl - (self.now - done).total_seconds()
            if left <= 0:
                self.decision.actions.append(DeleteJob())
            else:
                self.decision.after(left)
