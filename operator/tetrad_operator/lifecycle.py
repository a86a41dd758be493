"""The job's state machine, as one pure function.

    decide(job body, observed pods, observed nodes, now) -> Decision(status, actions, events, ...)

It reads only its arguments, so every transition is unit-testable and any handler can call it
again at any time: the actions it returns are idempotent (deterministic names, create-if-absent,
delete-if-present), and everything it must remember lives in the job's status or in the pods'
restart label. That is what makes the operator safe to kill at any moment.

Phases: Pending -> GangWaiting -> Running -> Succeeded, with Restarting between gang incarnations,
Failed at any point and Suspended while spec.runPolicy.suspend is true. Each phase has a
condition of the same type; exactly the current phase's condition is True.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from tetrad.api import InvalidJob, ParallelTrainingJob, ResolvedConfig, parse
from tetrad.api.contract import EXIT_PREEMPTED
from tetrad.api.spec import CleanPodPolicy, Phase, RunPolicy, Scheduler
from tetrad.render import render
from tetrad.render.objects import pod as render_pod
from tetrad.resolve import resolve
from tetrad_operator.gang import GangRequest
from tetrad_operator.state import NodeState, PodState, format_time, parse_time

GANG_RELEASED = "GangReleased"
# pod.status.reason values of a kubelet or the node lifecycle taking the pod away.
EVICTED_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Terminated", "UnexpectedAdmissionError"})
TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)


@dataclass(frozen=True)
class Settings:
    node_lost_seconds: float = 60.0  # a pod's node NotReady this long: the pod is lost
    stuck_terminating_seconds: float = 30.0  # past its grace period: force-delete the pod
    node_unknown_seconds: float = 10.0  # bound to a node we have never seen: lost after this long


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Ensure:
    """Create the object, or bring an existing one to this content (Service, ConfigMap, PodGroup)."""

    obj: dict[str, Any]


@dataclass(frozen=True)
class CreatePod:
    obj: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    force: bool = False  # grace period 0: no kubelet will ever confirm the deletion


@dataclass(frozen=True)
class Ungate:
    """Remove the gang scheduling gate from these pods (name, uid)."""

    pods: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class DeleteJob:
    """The TTL after finishing ran out."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


Action = Ensure | CreatePod | DeletePod | Ungate | DeleteJob


@dataclass
class Decision:
    status: dict[str, Any]
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # reconcile again after this long even without events
    # The outcome rests on a pod being absent: confirm with a fresh list before acting, since a
    # watch cache can lag (e.g. right after a paused replica resumes).
    verify: bool = False
    gang: GangRequest | None = None  # a complete, gated gang asking the built-in admission to go

    def after(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


# --------------------------------------------------------------------------- status helpers


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


def backoff_seconds(policy: RunPolicy, restart: int) -> float:
    """Delay before starting gang incarnation `restart` (>= 1): doubling, capped."""
    if restart <= 0:
        return 0.0
    return float(min(policy.backoff_seconds * 2 ** (restart - 1), policy.backoff_max_seconds))


@dataclass(frozen=True)
class Failure:
    pod: PodState
    reason: str  # PodFailed, PodEvicted, PodDeleted, NodeLost, PodMissing
    detail: str
    infrastructure: bool  # the cluster took the pod away: always retryable
    force: bool = False  # delete it with grace period 0

    @property
    def exit_code(self) -> int | None:
        return None if self.infrastructure else self.pod.exit_code

    @property
    def disruption(self) -> bool:
        """The cluster, not the job, ended the pod: such restarts spend no maxRestarts budget."""
        return self.infrastructure or self.exit_code == EXIT_PREEMPTED


# --------------------------------------------------------------------------- the decision


class _Machine:
    """One evaluation of decide(): the old status, the new one being built, and the helpers."""

    def __init__(self, body: Mapping[str, Any], pods: Sequence[PodState], nodes: Mapping[str, NodeState],
                 now: datetime, settings: Settings):
        self.body = body
        self.meta = body.get("metadata", {})
        self.name: str = self.meta.get("name", "")
        self.namespace: str = self.meta.get("namespace", "default")
        self.old: dict[str, Any] = dict(body.get("status") or {})
        self.status: dict[str, Any] = copy.deepcopy(self.old)
        self.status.pop("training", None)  # the scraper owns it
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

    def condition(self, type_: str) -> dict[str, Any] | None:
        return get_condition(self.status, type_)

    def since(self, type_: str) -> datetime:
        c = self.condition(type_)
        return parse_time(c.get("lastTransitionTime") if c else None) or self.now

    # ------------------------------------------------------------------ deletions

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
            force = self.lost(p) is not None or (p.node is not None and p.node not in self.nodes)
            if p.deleting:
                if force or self.stuck(p):
                    self.decision.actions.append(DeletePod(p.name, p.uid, force=True))
            else:
                self.decision.actions.append(DeletePod(p.name, p.uid, force=force))
        if pods:
            self.decision.after(2.0)  # until the pods are gone


def _failures(m: _Machine, current: Sequence[PodState], expect_deleting: bool) -> list[Failure]:
    out = []
    for p in sorted(current, key=lambda p: p.rank):
        if p.phase == "Failed":
            infra = p.reason in EVICTED_REASONS or p.disrupted is not None
            why = p.disrupted or p.reason
            if infra:
                out.append(Failure(p, "PodEvicted", f"pod {p.name} was evicted ({why})", True))
            else:
                code = "unknown" if p.exit_code is None else str(p.exit_code)
                where = f" in container {p.container}" if p.container else ""
                out.append(Failure(p, "PodFailed", f"pod {p.name} failed with exit code {code}{where}", False))
            continue
        if p.phase == "Succeeded":
            continue
        if (why := m.lost(p)) is not None:
            out.append(Failure(p, "NodeLost", f"pod {p.name} was lost: {why}", True, force=True))
        elif p.deleting and not expect_deleting:
            out.append(Failure(p, "PodDeleted", f"pod {p.name} was deleted ({p.disrupted or 'externally'})", True))
    return out


def _fatal(policy: RunPolicy, f: Failure) -> str | None:
    """Why this failure must end the job without a restart, or None."""
    code = f.exit_code
    if f.infrastructure or code is None or code == EXIT_PREEMPTED:
        return None
    if code in policy.permanent_exit_codes:
        return "PermanentExitCode"
    if policy.retryable_exit_codes and code not in policy.retryable_exit_codes:
        return "NonRetryableExitCode"
    return None


def _parse_job(body: Mapping[str, Any]) -> tuple[ParallelTrainingJob | None, str]:
    doc = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    job, problems = parse(doc)
    if job is None:
        return None, "; ".join(str(p) for p in problems)
    return job, ""


def decide(body: Mapping[str, Any], pods: Sequence[PodState], nodes: Mapping[str, NodeState], now: datetime,
           settings: Settings | None = None, resolved: ResolvedConfig | InvalidJob | None = None) -> Decision:
    """The next status and the actions that move the cluster toward it.

    `pods` are the job's pods (any restart), `nodes` every node by name. `resolved` may carry a
    cached resolve() result for this spec generation; it is computed when absent.
    """
    m = _Machine(body, pods, nodes, now, settings or Settings())
    job, problem = _parse_job(body)
    if job is not None and resolved is None:
        try:
            resolved = resolve(job)
        except InvalidJob as e:
            resolved = e
    if isinstance(resolved, InvalidJob):
        problem = str(resolved)
    if job is None or not isinstance(resolved, ResolvedConfig):
        if m.phase not in TERMINAL:
            m.transition(Phase.FAILED, "InvalidSpec", f"the spec is invalid: {problem}", warning=True)
            m.status["completionTime"] = format_time(now)
        policy = job.spec.run_policy if job is not None else RunPolicy()
        _finished(m, policy.clean_pod_policy, policy.ttl_seconds_after_finished)
        return m.decision

    m.status["worldSize"] = resolved.world_size
    m.status["mesh"] = resolved.layout.label()
    policy = job.spec.run_policy
    if m.phase in TERMINAL:
        _finished(m, policy.clean_pod_policy, policy.ttl_seconds_after_finished)
        return m.decision
    if policy.suspend:
        _suspended(m)
        return m.decision
    if m.phase == Phase.SUSPENDED:
        m.transition(Phase.PENDING, "Resumed", "the job was resumed")
        m.status.pop("startTime", None)
    if not m.phase:
        m.transition(Phase.PENDING, "Created", "creating the job's objects")
    m.status.setdefault("startTime", format_time(now))

    deadline = policy.active_deadline_seconds
    if deadline is not None:
        start = parse_time(m.status["startTime"]) or now
        left = deadline - (now - start).total_seconds()
        if left <= 0:
            _fail(m, "DeadlineExceeded", f"the job was active longer than activeDeadlineSeconds={deadline}", policy)
            return m.decision
        m.decision.after(left)

    _active(m, job, resolved)
    return m.decision


def _fail(m: _Machine, reason: str, message: str, policy: RunPolicy) -> None:
    m.transition(Phase.FAILED, reason, message, warning=True)
    m.status["completionTime"] = format_time(m.now)
    _finished(m, policy.clean_pod_policy, policy.ttl_seconds_after_finished)


def _finished(m: _Machine, clean: CleanPodPolicy, ttl: int | None) -> None:
    if clean == CleanPodPolicy.ALL:
        m.delete(m.pods)
    elif clean == CleanPodPolicy.RUNNING:
        m.delete([p for p in m.pods if not p.terminal])
    if ttl is not None:
        done = parse_time(m.status.get("completionTime")) or m.now
        left = ttl - (m.now - done).total_seconds()
        if left <= 0:
            m.decision.actions.append(DeleteJob())
        else:
            m.decision.after(left)


def _suspended(m: _Machine) -> None:
    if m.phase != Phase.SUSPENDED:
        m.transition(Phase.SUSPENDED, "Suspended", "spec.runPolicy.suspend is true: pods deleted, the job is kept")
        m.status.pop("startTime", None)
        if m.condition(GANG_RELEASED):
            set_condition(m.status["conditions"], GANG_RELEASED, "False", "Suspended", "the job is suspended", m.now)
    m.delete(m.pods)


def _active(m: _Machine, job: ParallelTrainingJob, cfg: ResolvedConfig) -> None:
    spec, policy = job.spec, job.spec.run_policy
    recorded = int(m.status.get("restarts") or 0)
    restart = max([recorded, *(p.restart for p in m.pods)])
    if restart > recorded and m.phase == Phase.RUNNING:
        m.transition(Phase.RESTARTING, "Recovered", f"found pods of restart {restart}; continuing with it")
    m.status["restarts"] = restart
    old = [p for p in m.pods if p.restart < restart]
    current = {p.rank: p for p in m.pods if p.restart == restart and 0 <= p.rank < spec.nodes}
    builtin = spec.gang.scheduler == Scheduler.BUILTIN
    released = m.condition(GANG_RELEASED) or {}
    gang_timed_out = builtin and released.get("status") == "False" and released.get("reason") == "GangTimeout"
    expect_deleting = gang_timed_out or m.phase == Phase.PENDING  # our own re-creation after suspend/timeout

    # 1. Any failure in the current gang: fail the job, or restart the whole gang.
    failures = _failures(m, list(current.values()), expect_deleting)
    if m.phase == Phase.RUNNING:
        for rank in range(spec.nodes):
            if rank not in current:
                gone = PodState(name=f"rank {rank}", uid="", job=m.name, restart=restart, rank=rank, phase="Unknown")
                failures.append(Failure(gone, "PodMissing", f"the pod of rank {rank} disappeared", True))
                m.decision.verify = True
    if failures:
        _on_failure(m, failures, list(current.values()), restart, policy)
        return

    # 2. Pods of earlier incarnations must be gone before a new one starts.
    if old:
        m.delete(old)
        return

    # 3. Create the incarnation's missing pods, after the restart backoff.
    missing = [r for r in range(spec.nodes) if r not in current]
    if missing:
        if any(p.deleting for p in current.values()):
            m.delete([p for p in current.values() if p.deleting])  # force them when stuck
            return
        hold = _hold_until(m, policy, restart, gang_timed_out)
        if hold is not None and hold > m.now:
            m.decision.after((hold - m.now).total_seconds())
            return
        if m.phase == Phase.RESTARTING:
            m.transition(Phase.PENDING, "Restarted", f"creating the pods of restart {restart}")
        if not current:  # a new incarnation: its Service, ConfigMap and PodGroup, then every pod
            rendered = render(job, restart=restart, config=cfg)
            m.decision.actions.extend(Ensure(o) for o in (rendered.service, rendered.configmap, rendered.pod_group) if o)
            m.decision.actions.extend(CreatePod(p) for p in rendered.pods)
        else:  # only the missing pods (rendering a 1024-pod gang takes a while)
            m.decision.actions.extend(CreatePod(render_pod(job, cfg, rank=r, restart=restart)) for r in missing)
        if builtin and (not released or released.get("status") == "True"):
            set_condition(m.status["conditions"], GANG_RELEASED, "False", "Creating",
                          f"creating the {spec.nodes} pods of restart {restart}", m.now)
        return

    pods = [current[r] for r in range(spec.nodes)]
    # 4. Every pod finished: success.
    if all(p.phase == "Succeeded" for p in pods):
        m.transition(Phase.SUCCEEDED, "Succeeded", f"all {spec.nodes} pods succeeded")
        m.status["completionTime"] = format_time(m.now)
        _finished(m, policy.clean_pod_policy, policy.ttl_seconds_after_finished)
        return

    # 5. The built-in gang: admission, release of the remaining gates, and the gang timeout.
    if builtin and _builtin_gang(m, job, pods, restart, policy):
        return

    # 6. Running once every pod runs (or already succeeded); GangWaiting before.
    if all(p.phase in ("Running", "Succeeded") for p in pods):
        if m.phase != Phase.RUNNING:
            m.transition(Phase.RUNNING, "AllPodsRunning", f"all {spec.nodes} pods are running")
    elif m.phase != Phase.GANG_WAITING:
        m.transition(Phase.GANG_WAITING, "WaitingForScheduler",
                     f"all {spec.nodes} pods exist; waiting for {spec.gang.scheduler.value} to place and start them")


def _hold_until(m: _Machine, policy: RunPolicy, restart: int, gang_timed_out: bool) -> datetime | None:
    if m.phase == Phase.RESTARTING:
        return m.since(Phase.RESTARTING) + timedelta(seconds=backoff_seconds(policy, restart))
    if gang_timed_out:
        return m.since(GANG_RELEASED) + timedelta(seconds=min(policy.backoff_seconds, policy.backoff_max_seconds))
    return None


def _on_failure(m: _Machine, failures: list[Failure], current: list[PodState], restart: int, policy: RunPolicy) -> None:
    for f in failures:
        if (reason := _fatal(policy, f)) is not None:
            _fail(m, reason, f"{f.detail}; exit code {f.exit_code} is not retryable", policy)
            return
    # A disruption's peers often fail too (a collective loses a rank): one disruption covers them.
    disruption = next((f for f in failures if f.disruption), None)
    first = disruption or failures[0]
    disruptions = min(int(m.status.get("disruptions") or 0), restart)
    if disruption is None and restart - disruptions >= policy.max_restarts:
        _fail(m, "MaxRestartsExceeded",
              f"{first.detail}; the gang was already restarted {restart - disruptions} times after failures"
              f" (maxRestarts={policy.max_restarts}; {disruptions} disruptions not counted)", policy)
        return
    m.status["restarts"] = restart + 1
    m.status["disruptions"] = disruptions + (disruption is not None)
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    wait = backoff_seconds(policy, restart + 1)
    m.transition(Phase.RESTARTING, first.reason,
                 f"{first.detail}{more}; restarting the whole gang as restart {restart + 1} in {wait:g}s", warning=True)
    if m.condition(GANG_RELEASED):
        set_condition(m.status["conditions"], GANG_RELEASED, "False", "Restarting", "the gang is restarting", m.now)
    forced = {f.pod.name for f in failures if f.force}
    real = [p for p in current if p.uid]
    m.delete([p for p in real if p.name not in forced])
    m.decision.actions.extend(DeletePod(p.name, p.uid, force=True) for p in real if p.name in forced)
    m.decision.after(wait)


def _builtin_gang(m: _Machine, job: ParallelTrainingJob, pods: list[PodState], restart: int, policy: RunPolicy) -> bool:
    """Drive the scheduling gates; True when this step decided the reconcile's outcome."""
    spec, conds = job.spec, m.status["conditions"]
    gated = [p for p in pods if p.gated]
    if len(gated) == len(pods):
        if m.phase != Phase.GANG_WAITING:
            m.transition(Phase.GANG_WAITING, "WaitingForCapacity",
                         f"all {spec.nodes} pods are gated until the whole gang fits on the free capacity")
        set_condition(conds, GANG_RELEASED, "False", "WaitingForCapacity",
                      "waiting until free allocatable resources fit every pod", m.now)
        created = parse_time(m.meta.get("creationTimestamp"))
        m.decision.gang = GangRequest(m.namespace, m.name, created, restart, tuple(pods))
        return True
    if gated:  # released part-way (the operator stopped mid-release): finish the release
        m.decision.actions.append(Ungate(tuple((p.name, p.uid) for p in gated)))
    set_condition(conds, GANG_RELEASED, "True", "Admitted", "the whole gang fits; scheduling gates removed", m.now)
    unbound = [p for p in pods if p.node is None and not p.terminal]
    if not unbound:
        return False
    waited = (m.now - m.since(GANG_RELEASED)).total_seconds()
    timeout = spec.gang.timeout_seconds
    if waited < timeout:
        m.decision.after(timeout - waited)
        return False
    set_condition(conds, GANG_RELEASED, "False", "GangTimeout",
                  f"{len(unbound)} of {spec.nodes} pods were still unscheduled {timeout}s after release; "
                  "re-creating the gang behind its gate", m.now)
    m.transition(Phase.GANG_WAITING, "GangTimeout", m.condition(GANG_RELEASED)["message"], warning=True)  # type: ignore[index]
    m.delete(pods)
    return True
