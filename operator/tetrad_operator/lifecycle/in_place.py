"""Restarts in place (tetrad.node.rounds): a worker's failure restarts the gang's processes inside its own
pods, coordinated by pod 0's supervisor, without the operator. The operator gives each new incarnation's
pods the budget they may spend (`left`), and learns what they spent as rounds: from rank 0's scrape
(status.trainerTime.round, with the failure that began the round) or from the pods' termination
messages (`round`), whichever it sees first. Each round counts in status.restartsInPlace and against
maxRestarts, and is told in a RestartedInPlace Event.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from tetrad.api.spec import ParallelTrainingJobStatus, Phase, RunPolicy
from tetrad_operator.lifecycle import elastic, goodput
from tetrad_operator.lifecycle.actions import Event
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, parse_time

REASON = "RestartedInPlace"  # the Event's reason, and the label of the operator's restart counter


def failures(restarts: int, disruptions: int, restarts_in_place: int, resizes: int) -> int:
    """Restarts that spent maxRestarts: the gang's restarts after failures, in new pods or in place (not
    those the cluster caused, nor an elastic gang's resizes)."""
    return restarts - disruptions - resizes + restarts_in_place


def left(status: ParallelTrainingJobStatus, policy: RunPolicy) -> int:
    """Restarts in place the next incarnation's pods may make: what is left of maxRestarts."""
    spent = failures(status.restarts, status.disruptions, status.restarts_in_place, elastic.resizes(status))
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
    m.status.restarts_in_place += more
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
