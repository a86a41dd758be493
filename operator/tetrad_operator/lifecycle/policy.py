"""The failure and restart policy: what counts as a failure of the current gang, which failures
end the job, and when the next incarnation may start.

Any failure of one pod restarts the whole gang (a torch.distributed job cannot lose a rank).
A failure is either the job's (a pod failed with an exit code) or a disruption (the cluster took
the pod away, or the trainer was preempted and saved a checkpoint): disruptions spend no
maxRestarts budget, only their own, maxDisruptions. A rank whose pod is missing is a failure
without a pod; nothing about it can be deleted. A gang whose rank 0 stops completing steps
(`stalled`, judged from the heartbeat the scraper copies into status.training) is a disruption; so is
a node that ended because the restart in place asked for it did not come (in_place.ask_for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from tetrad.api import restart_policy
from tetrad.api.contract import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
    REASON_RESTART_ASKED,
    REASON_STALLED,
)
from tetrad.api.spec import ParallelTrainingJobSpec, Phase, RunPolicy, TrainingStatus
from tetrad_operator.lifecycle import elastic, in_place, preflight, release
from tetrad_operator.lifecycle.actions import DeletePod
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, parse_time

# pod.status.reason values of a kubelet or the node lifecycle taking the pod away.
EVICTED_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Terminated",
                             "UnexpectedAdmissionError"})
# Permanent exit codes the trainer documents: the job's reason and what the user should read.
EXPLAINED_EXITS = {
    EXIT_OOM: ("DeviceOutOfMemory", "the trainer ran out of device memory; see the pod log for the planner's "
               "figures and the knobs to turn"),
}
# What the container runtime says of a container it could not start because the image lacks what the
# command needs (python3, say): no restart helps.
START_ERRORS = frozenset({"StartError", "ContainerCannotRun"})
MISSING_IN_IMAGE = ("executable file not found", "no such file or directory")


def backoff_seconds(policy: RunPolicy, restart: int) -> float:
    """Delay before starting gang incarnation `restart` (>= 1): doubling, capped."""
    return restart_policy.backoff_seconds(policy.backoff_seconds, policy.backoff_max_seconds, restart)


@dataclass(frozen=True)
class Failure:
    rank: int
    pod: PodState | None  # None: the rank's pod is missing
    # PodFailed, PreflightFailed, CollectiveTimeout, PodEvicted, PodDeleted, NodeLost, PodMissing, Stalled
    reason: str
    detail: str
    infrastructure: bool  # the cluster took the pod away: always retryable
    force: bool = False  # delete the pod with grace period 0
    nodes: tuple[tuple[str, str], ...] = ()  # PreflightFailed: (node, reason) of each node the pod named

    @property
    def exit_code(self) -> int | None:
        return None if self.infrastructure or self.pod is None else self.pod.exit_code

    @property
    def disruption(self) -> bool:
        """The cluster, not the job, ended the pod: such restarts spend no maxRestarts budget."""
        return self.infrastructure or self.exit_code == EXIT_PREEMPTED


def failures(m: JobPass, current: dict[int, PodState], nodes: int, expect_deleting: bool) -> list[Failure]:
    """The failures of the current incarnation, by rank; `current` maps rank to its pod."""
    out = []
    for rank, p in sorted(current.items()):
        if p.phase == "Failed":
            infra = p.reason in EVICTED_REASONS or p.disrupted is not None
            why = p.disrupted or p.reason
            if infra:
                out.append(Failure(rank, p, "PodEvicted", f"pod {p.name} was evicted ({why})", True))
            elif p.exit_code == EXIT_PREFLIGHT:
                out.append(preflight_failure(rank, p, current))
            elif p.said.reason in (REASON_STALLED, REASON_RESTART_ASKED):  # the round asked for did not come
                out.append(Failure(rank, p, p.said.reason, f"pod {p.name} ended: {p.said.message}", True))
            elif p.ended in START_ERRORS:
                out.append(Failure(rank, p, "ContainerCannotStart",
                                   f"the container of pod {p.name} could not start:"
                                   f" {p.message or p.ended}", False))
            else:
                code = "unknown" if p.exit_code is None else str(p.exit_code)
                where = f" in container {p.container}" if p.container else ""
                failed = f"pod {p.name} failed with exit code {code}{where}"
                if p.exit_code == EXIT_COLLECTIVE_TIMEOUT:  # retryable, like any code not listed as permanent
                    said = p.said.collective_timeout
                    out.append(Failure(rank, p, "CollectiveTimeout", f"{failed}: a collective timed out"
                                       f"{f' ({said})' if said else ''}", False))
                else:
                    said = f": {p.said.message}" if p.said.message else ""
                    out.append(Failure(rank, p, "PodFailed", f"{failed}{said}", False))
            continue
        if p.phase == "Succeeded":
            continue
        if (why := m.lost(p)) is not None:
            out.append(Failure(rank, p, "NodeLost", f"pod {p.name} was lost: {why}", True, force=True))
        elif p.deleting and not expect_deleting:
            out.append(Failure(rank, p, "PodDeleted",
                               f"pod {p.name} was deleted ({p.disrupted or 'externally'})", True))
    if m.phase == Phase.RUNNING:  # every rank had a pod: one that is gone now was taken away
        for rank in range(nodes):
            if rank not in current:
                out.append(Failure(rank, None, "PodMissing", f"the pod of rank {rank} disappeared", True))
                m.decision.verify = True
    return out


def preflight_failure(rank: int, pod: PodState, current: dict[int, PodState]) -> Failure:
    """A pod that failed the preflight gate: a disruption (a node's fault, not the job's) naming the nodes."""
    nodes, gang_reasons = preflight.named_nodes(pod, current)
    said = "; ".join([f"node {node}: {reason}" for node, reason in nodes] + gang_reasons) or "no reason given"
    return Failure(rank, pod, "PreflightFailed", f"pod {pod.name} failed the preflight gate: {said}", True,
                   nodes=tuple(nodes))


def stall_timeout(m: JobPass, policy: RunPolicy, training: TrainingStatus) -> float | None:
    """Seconds without a rank-0 step that make the gang stalled; None when detection is off."""
    if policy.stall_timeout_seconds is not None:
        return float(policy.stall_timeout_seconds) or None
    step_time = training.step_time_seconds
    measured = m.settings.stall_step_factor * step_time if step_time is not None else 0.0
    return max(measured, stall_floor(m, policy))


def stall_floor(m: JobPass, policy: RunPolicy) -> float:
    """The default stall timeout's floor: past the collective timeout too, so that a hung collective
    ends as CollectiveTimeout, its peers named, before the gang is restarted as Stalled."""
    return max(m.settings.stall_floor_seconds,
               policy.collective_timeout_seconds + m.settings.stall_collective_margin_seconds)


def steps_of(spec: ParallelTrainingJobSpec) -> int | None:
    """The steps the job trains for: Tetrad's trainer's; a script's are its own (None)."""
    return spec.training.steps if spec.script is None else None


def stalled(m: JobPass, policy: RunPolicy, rank0: PodState, steps: int | None) -> Failure | None:
    """A Running gang whose rank 0 completed no step for the stall timeout, counted from its last
    heartbeat or, before the first one of this incarnation (of its round of restarts in place), from
    when the gang started Running (from when the operator learned of the round)
    (then the timeout is at least the default's floor, even below an explicit stallTimeoutSeconds,
    and `stall_startup_factor` x the last measured start-up: a start-up is no stall).

    Only what the scraper saw of this incarnation is judged, and the quiet time runs to its last
    read (`training.updated`), not to now: a stall is seen, never extrapolated. A rank 0 that stops
    answering (one exiting after its last step, or too busy to answer within the scrape timeout)
    is no stall; one frozen whole is ended by its peers' collective timeout. Once rank 0 reported
    the last of the job's `steps`, no step is due: the trainer saves and exits, and a collective
    that hangs meanwhile ends at the collective timeout. A script job (`steps` None) promises a
    heartbeat with its first report (tetrad_trainer.runtime), not before: an incarnation that has not
    reported is never judged stalled.
    """
    training = m.read.training or TrainingStatus()
    timeout = stall_timeout(m, policy, training)
    # a round of restarts in place starts over as the incarnation did: its start-up is no stall
    running = max(m.since(Phase.RUNNING), in_place.round_began(m) or m.since(Phase.RUNNING))
    read = parse_time(training.updated)
    finishing = steps is not None and training.step is not None and training.step >= steps
    if timeout is None or read is None or read < running or finishing:
        return None
    beat = parse_time(training.last_step_time)
    started = beat is not None and beat >= running
    if not started and steps is None:
        return None
    since = beat if started and beat is not None else running
    source = ("spec.runPolicy.stallTimeoutSeconds" if policy.stall_timeout_seconds is not None else
              f"the default: {m.settings.stall_step_factor:g} x the step time, "
              f"at least {stall_floor(m, policy):g}s")
    startup = training.startup_seconds
    if not started:
        measured = m.settings.stall_startup_factor * startup if startup is not None else 0.0
        if (longest := max(stall_floor(m, policy), measured)) > timeout:
            timeout = longest
            source = (f"before the first step: at least {stall_floor(m, policy):g}s and "
                      f"{m.settings.stall_startup_factor:g} x the last start-up")
    quiet = (read - since).total_seconds()
    if quiet < timeout:
        if (left := (since + timedelta(seconds=timeout) - m.now).total_seconds()) > 0:
            m.decision.after(left)  # the first moment a read can tell
        else:
            m.decision.read_now = True  # the deadline passed after the last read: read again (its write,
            # the heartbeat unmoved, wakes the job: scrape.judged_at_once)
        return None
    what = f"no step since {training.last_step_time}" if started else "no step"
    return Failure(0, rank0, "Stalled", f"rank 0 ({rank0.name}) completed {what} for {int(quiet)}s, "
                   f"over the stall timeout of {timeout:g}s ({source})", True)


def fatal(policy: RunPolicy, f: Failure) -> tuple[str, str] | None:
    """(reason, message) when this failure must end the job without a restart, else None."""
    code = f.exit_code
    if f.reason == "ContainerCannotStart" and f.pod is not None and any(
            m in (f.pod.message or "") for m in MISSING_IN_IMAGE):
        return f.reason, (f"{f.detail}; spec.image must hold what the pods run: python3 with torch, "
                          "and spec.script's entry point (docs/bring-your-own.md)")
    if f.infrastructure or code is None or code == EXIT_PREEMPTED:
        return None
    why = restart_policy.refusal(code, retryable=policy.retryable_exit_codes,
                                 permanent=policy.permanent_exit_codes)
    if why == restart_policy.PERMANENT:
        if f.pod is not None and f.pod.said.reason and f.pod.said.message:
            # the node named the cause: the detail says it
            return f.pod.said.reason, f"{f.detail}; exit code {code} is not retryable"
        if code in EXPLAINED_EXITS:
            reason, explained = EXPLAINED_EXITS[code]
            return reason, f"{f.detail}: {explained}"
    return (why, f"{f.detail}; exit code {code} is not retryable") if why is not None else None


def on_failure(m: JobPass, found: list[Failure], current: Sequence[PodState], restart: int,
               policy: RunPolicy) -> None:
    """Fail the job, or restart the whole gang as incarnation restart+1 after the backoff."""
    for f in found:
        if (verdict := fatal(policy, f)) is not None:
            m.fail(*verdict, policy)
            return
    # A disruption's peers often fail too (a collective loses a rank): one disruption covers them.
    disruption = next((f for f in found if f.disruption), None)
    first = disruption or found[0]
    disruptions = in_place.disruptions_in_new_pods(m.status, restart)
    resizes = elastic.resizes(m.status)
    rounds = in_place.failed_rounds(m.status)
    failed = in_place.failures(restart, disruptions, rounds, resizes)
    if disruption is None and failed >= policy.max_restarts:
        m.fail("MaxRestartsExceeded",
               f"{first.detail}; the gang was already restarted {failed} times after failures"
               + (f", {rounds} of them in place" if rounds else "")
               + f" (maxRestarts={policy.max_restarts}; {disruptions} disruptions"
               + (f" and {resizes} resizes" if resizes else "") + " not counted)", policy)
        return
    spent = in_place.disruptions(m.status, restart)
    if disruption is not None and spent >= policy.max_disruptions:
        m.fail("DisruptionBudgetExceeded",
               f"{first.detail}; the gang was already restarted {spent} times after disruptions"
               f" (spec.runPolicy.maxDisruptions={policy.max_disruptions}); raise it if the cluster is"
               f" expected to take the job's pods this often", policy)
        return
    m.status.restarts = restart + 1
    m.status.disruptions = disruptions + (disruption is not None)
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    wait = backoff_seconds(policy, restart + 1)
    m.transition(Phase.RESTARTING, first.reason,
                 f"{first.detail}{more}; restarting the whole gang as restart {restart + 1} in {wait:g}s",
                 warning=True)
    release.withdraw(m, "Restarting", "the gang is restarting")
    forced = {f.pod.name for f in found if f.force and f.pod is not None}
    m.delete([p for p in current if p.name not in forced])
    m.decision.actions.extend(DeletePod(p.name, p.uid, force=True) for p in current if p.name in forced)
    m.decision.after(wait)


def hold_until(m: JobPass, policy: RunPolicy, restart: int, gang_timed_out: bool) -> datetime | None:
    """When the incarnation's pods may be created: after the restart backoff or a gang timeout's pause."""
    if m.phase == Phase.RESTARTING:
        if (restarting := m.condition(Phase.RESTARTING)) is not None and restarting.reason in elastic.RESIZES:
            return None
        return m.since(Phase.RESTARTING) + timedelta(seconds=backoff_seconds(policy, restart))
    if gang_timed_out:
        return m.since(release.RELEASED) + timedelta(seconds=min(policy.backoff_seconds,
                                                                 policy.backoff_max_seconds))
    return None
