"""Restarts in place (tetrad.node.rounds): a worker's failure restarts the gang's processes inside its own
pods, coordinated by pod 0's supervisor, without the operator. The operator gives each new incarnation's
pods the budget they may spend (`left`), and learns what they spent as rounds: from rank 0's scrape
(status.trainerTime.round, with the failure that began the round) or from the pods' termination
messages (`round`), whichever it sees first. Each round counts in status.restartsInPlace and against
maxRestarts, and is told in a RestartedInPlace Event. A gang that stalls is asked to restart in place too
(`ask_for`, tetrad.node.rounds.ask): such a round is a disruption (status.disruptionsInPlace). A user asks
for one with a tetrad.dev/restart-in-place token (`restart_asked`): the workers save a checkpoint first,
and the round spends no budget (status.askedInPlace).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from tetrad.api import contract
from tetrad.api.spec import InPlaceAsk, ParallelTrainingJob, ParallelTrainingJobStatus, Phase, RunPolicy
from tetrad_operator.lifecycle import elastic, goodput
from tetrad_operator.lifecycle.actions import AskInPlace, Event
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, format_time, parse_time

REASON = "RestartedInPlace"  # the Event's reason, and the label of the operator's restart counter


def failures(restarts: int, disruptions: int, failed_rounds: int, resizes: int) -> int:
    """Restarts that spent maxRestarts: the gang's restarts after failures, in new pods or in place (not
    those the cluster caused or a stall began, nor an elastic gang's resizes)."""
    return restarts - disruptions - resizes + failed_rounds


def failed_rounds(status: ParallelTrainingJobStatus) -> int:
    """Rounds in place after the job's failures: all but those the operator asked for (after a stall, or
    for a user)."""
    return status.restarts_in_place - status.disruptions_in_place - status.asked_in_place


def disruptions_in_new_pods(status: ParallelTrainingJobStatus, restart: int) -> int:
    """status.disruptions as of incarnation `restart`: at most one an incarnation (a write the operator
    lost may leave it ahead)."""
    return min(status.disruptions, restart)


def disruptions(status: ParallelTrainingJobStatus, restart: int) -> int:
    """Restarts that spent maxDisruptions before incarnation `restart`'s next: in new pods and in place."""
    return disruptions_in_new_pods(status, restart) + status.disruptions_in_place


def left(status: ParallelTrainingJobStatus, policy: RunPolicy) -> int:
    """Restarts in place the next incarnation's pods may make: what is left of maxRestarts."""
    spent = failures(status.restarts, status.disruptions, failed_rounds(status), elastic.resizes(status))
    return max(policy.max_restarts - spent, 0)


def observe(m: JobPass, restart: int, pods: Iterable[PodState], policy: RunPolicy) -> None:
    """The rounds incarnation `restart` has begun, as far as rank 0's figures or its pods' termination
    messages tell, into the status and the goodput ledger, with an Event for each new one."""
    time = m.trainer_time
    seen, cause = 0, None
    started = parse_time(m.status.start_time)  # a resumed job's: figures from before its suspend are stale
    if (time is not None and time.restart == restart and time.round
            and (started is None or (parse_time(time.updated) or started) >= started)):
        seen, cause = time.round, time.round_cause
    ended = max((p.said.round for p in pods if p.restart == restart), default=0)
    if ended > seen:
        seen, cause = ended, None
    if seen <= m.status.round:
        return
    more = seen - m.status.round
    asked = m.status.in_place_ask
    ours = (asked is not None and asked.restart == restart and m.status.round <= asked.round < seen
            and (asked.accepted or (asked.accepted is None and cause in (None, asked.cause))))
    by_user = ours and asked is not None and asked.token is not None
    m.status.restarts_in_place += more
    m.status.disruptions_in_place += ours and not by_user
    m.status.asked_in_place += by_user
    if m.phase == Phase.RUNNING:  # the ledger cuts the round it counts by rank 0's last account of it
        account = None
        if time is not None and time.restart == restart:
            account = time.account() if (time.round or 0) == m.ledger.round else time.previous_round
        goodput.next_round(m.ledger, m.now, seen, account, m.checkpoint, m.script)
    m.status.round = seen
    rounds = f"{more} more rounds, up to round {seen}" if more > 1 else f"round {seen}"
    m.decision.events.append(Event("Warning", REASON, (
        f"the gang of restart {restart} restarted in its own pods ({rounds})"
        + (f" after {cause}" if cause else "")
        + (f"; round {asked.round + 1} the operator asked for "
           + ("as tetrad.dev/restart-in-place asked, after every worker saved" if by_user
              else "after a stall, a disruption")
           if ours and asked is not None else "")
        + f"; {left(m.status, policy)} of spec.runPolicy.maxRestarts={policy.max_restarts} left")))


def next_incarnation(m: JobPass) -> None:
    """A new incarnation's pods begin at round 0."""
    m.status.round = 0


def round_began(m: JobPass) -> datetime | None:
    """When the operator learned of the current incarnation's round (None in round 0): the goodput
    ledger's cut of the round before."""
    if m.status.round and m.ledger.round == m.status.round:
        return parse_time(m.ledger.since)
    return None


def current_ask(m: JobPass, restart: int) -> InPlaceAsk | None:
    """The operator's ask of the incarnation's current round, if it made one."""
    asked = m.status.in_place_ask
    return asked if asked is not None and (asked.restart, asked.round) == (restart, m.status.round) else None


def pending(m: JobPass, asked: InPlaceAsk | None) -> bool:
    """Whether a new round may still answer the ask (Settings.in_place_ask_seconds); if so, the pass comes
    back when it may no longer."""
    if asked is None or asked.accepted is False:
        return False
    waited = (m.now - (parse_time(asked.time) or m.now)).total_seconds()
    if waited >= m.settings.in_place_ask_seconds:
        return False
    m.decision.after(m.settings.in_place_ask_seconds - waited)
    return True


def ask_for(m: JobPass, stall: str, rank0: PodState, restart: int, policy: RunPolicy) -> bool:
    """A stalled gang (`stall` says how): ask pod 0's coordinator to restart it in place, once per round,
    while maxDisruptions has a restart left; True while that ask (or a user's) may still be answered by a
    new round, False when the gang must be recreated instead. If a node does not stop for the round, the
    nodes end with the stall as their reason (policy.failures)."""
    asked = current_ask(m, restart)
    if pending(m, asked):
        return True
    if asked is not None and asked.token is None:
        return False  # the stall's ask was refused, or came to nothing
    if disruptions(m.status, restart) >= policy.max_disruptions or rank0.ip is None:
        return False  # the disruption budget is spent (the recreate fails the job), or pod 0 has no address
    m.status.in_place_ask = InPlaceAsk(restart=restart, round=m.status.round, time=format_time(m.now),
                                       cause=stall)
    m.decision.actions.append(AskInPlace(rank0.name, rank0.uid, restart, m.status.round, stall))
    m.decision.events.append(Event("Warning", "Stalled", (
        f"{stall}; asked pod 0's coordinator to restart the gang in its own pods (round "
        f"{m.status.round + 1}); if no round {m.status.round + 1} shows within "
        f"{m.settings.in_place_ask_seconds:g}s the gang is recreated")))
    m.decision.after(m.settings.in_place_ask_seconds)
    return True


def not_in_place(m: JobPass, restart: int) -> str:
    """Why a stalled gang is recreated rather than restarted in place, as the end of the stall's words."""
    asked = current_ask(m, restart)
    if asked is None or asked.token is not None:
        return ""  # not asked: maxDisruptions is spent, or pod 0 has no address
    if asked.accepted is False:
        return "; pod 0's coordinator did not restart it in place (it refused, or did not answer)"
    return f"; no round {asked.round + 1} in place came within {m.settings.in_place_ask_seconds:g}s of asking"


def restart_asked(m: JobPass, job: ParallelTrainingJob, rank0: PodState, restart: int) -> None:
    """A tetrad.dev/restart-in-place token not acted on yet, on a running gang: ask pod 0's coordinator to
    restart it in its own pods, every worker saving a checkpoint first (as on SIGTERM). A refusal is told
    in a Warning Event (controller); a node that does not stop ends with the reason RestartAsked, and the
    gang is recreated as a disruption (policy.failures)."""
    token = (m.meta.get("annotations") or {}).get(contract.ANNOTATION_RESTART_IN_PLACE)
    if (not token or m.status.restart_requested == token or rank0.phase != "Running" or rank0.deleting
            or rank0.ip is None or pending(m, current_ask(m, restart))):
        return  # nothing new, or not now: a round the operator asked for is on its way
    m.status.restart_requested = token
    asked = f"{contract.ANNOTATION_RESTART_IN_PLACE}={token!r}"
    if job.spec.script is None and not job.spec.checkpoint.enabled:
        m.decision.events.append(Event("Warning", "RestartNotInPlace", (
            f"{asked} ignored: checkpointing is off (spec.checkpoint.enabled=false), so the restarted "
            "gang would begin again from step 0")))
        return
    why = f"a restart asked ({asked})"
    round = m.status.round
    m.status.in_place_ask = InPlaceAsk(restart=restart, round=round, time=format_time(m.now), cause=why,
                                       token=token)
    m.decision.actions.append(AskInPlace(rank0.name, rank0.uid, restart, round, why, save=True))
    m.decision.events.append(Event("Normal", "RestartAsked", (
        f"{asked}: asked pod 0's coordinator to restart the gang in its own pods (round {round + 1}); "
        "every worker saves a checkpoint first, and the round spends no budget")))
