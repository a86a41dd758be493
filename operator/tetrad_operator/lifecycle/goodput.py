"""status.goodput: the share of the job's wall time spent on steps that counted, and where the rest went.

The ledger lives in the status, so a restarted operator counts nothing twice: `since`, when the
current phase began, and `settled`, the time before it. Every phase change (JobPass.transition)
settles the time since `since` into the kind of the phase it leaves: Pending and GangWaiting are
queued, Restarting restarts, Suspended suspended. Time running belongs to the current incarnation
(`runningSeconds`) until it ends; then rank 0's own account of it (status.trainerTime) splits it into
start-up, preflight, checkpoint stalls and training. An incarnation cut short (a restart, a suspend)
loses its steps after the last checkpoint, which the next one trains again (`recomputed`), and the
time after its last logged step (`restarts`). A restart in place cuts the incarnation's time running so
far the same way, by rank 0's last account of the round that ended (`next_round`), as it is learned:
the next round's start until then counts as `restarts`. The kinds add up to the wall time.

The figures shown are the ledger as of `asOf`: a phase change's time, or while running the last scrape
of rank 0. Between phase changes they are refreshed at most once a minute, so that a pass that
learned nothing new writes nothing.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum

from tetrad.api.spec import (
    CheckpointStatus,
    GoodputSeconds,
    GoodputStatus,
    Phase,
    TrainerAccount,
    TrainerTimeStatus,
)
from tetrad_operator.observed import format_time, parse_time

REFRESH_SECONDS = 60.0
_KIND_OF_PHASE = {None: "queued", Phase.PENDING: "queued", Phase.GANG_WAITING: "queued",
                  Phase.RESTARTING: "restarts", Phase.SUSPENDED: "suspended"}
_TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)


class Ending(Enum):
    """How an incarnation's time running ended."""

    DONE = "done"  # the job ended (or, for the figures shown, has not yet): every step counted
    CUT = "cut"  # a restart or a suspend: the steps after the last checkpoint are trained again


def opened(created: datetime, restart: int) -> GoodputStatus:
    """The ledger of a job that has none: it starts at the job's creation."""
    return GoodputStatus(since=format_time(created), restart=restart, settled=_sum(), running_seconds=0.0)


def ending(entering: Phase) -> Ending | None:
    """How entering this phase ends the current incarnation's time running, if it does."""
    if entering in (Phase.RESTARTING, Phase.SUSPENDED):
        return Ending.CUT
    return Ending.DONE if entering in _TERMINAL else None


def settle(ledger: GoodputStatus, leaving: Phase | None, now: datetime, ended: Ending | None,
           time: TrainerTimeStatus | None, checkpoint: CheckpointStatus | None, script: bool = False) -> None:
    """The phase `leaving` ends now: its time since `since` into the ledger; when `ended`, the current
    incarnation's time running split by rank 0's account `time` (status.trainerTime) into the kinds.
    `script`: the job runs a script of its own (see `split`)."""
    now = _second(now)
    spent = _seconds(ledger.since, now)
    if leaving == Phase.RUNNING:
        ledger.running_seconds += spent
    elif leaving not in _TERMINAL:
        ledger.settled = _sum(ledger.settled, GoodputSeconds(**{_KIND_OF_PHASE[leaving]: spent}))
    if ended is not None:
        ledger.settled = _sum(ledger.settled,
                              split(ledger.running_seconds, _of(ledger, time), ended, checkpoint, script))
        ledger.running_seconds = 0.0
    ledger.since = format_time(now)


def refresh(ledger: GoodputStatus, stored: GoodputStatus | None, phase: Phase | None, now: datetime,
            restart: int, time: TrainerTimeStatus | None, checkpoint: CheckpointStatus | None,
            script: bool = False) -> None:
    """The figures shown: the ledger as of now (of the last scrape while running, of the end once the
    job ended), or the stored ones while the ledger is unchanged and they are under a minute old."""
    if ledger.running_seconds == 0 and phase != Phase.RUNNING:
        # between incarnations: the next one's figures, of its first round, are the ones to read
        ledger.restart, ledger.round = restart, 0
    time = _of(ledger, time)
    if phase in _TERMINAL:
        as_of = parse_time(ledger.since) or now
    elif phase == Phase.RUNNING and time is not None and time.updated:
        as_of = max(parse_time(time.updated) or now, parse_time(ledger.since) or now)
    else:
        as_of = now
    as_of = _second(as_of)
    if (stored is not None and stored.as_of and phase not in _TERMINAL
            and (stored.since, stored.settled, stored.restart, stored.running_seconds)
            == (ledger.since, ledger.settled, ledger.restart, ledger.running_seconds)
            and _seconds(stored.as_of, as_of) < REFRESH_SECONDS):
        ledger.fraction, ledger.wall_seconds, ledger.seconds, ledger.as_of = (
            stored.fraction, stored.wall_seconds, stored.seconds, stored.as_of)
        return
    spent = _seconds(ledger.since, as_of)
    if phase == Phase.RUNNING:
        shown = _sum(ledger.settled,
                     split(ledger.running_seconds + spent, time, Ending.DONE, checkpoint, script))
    elif phase not in _TERMINAL:
        shown = _sum(ledger.settled, GoodputSeconds(**{_KIND_OF_PHASE[phase]: spent}))
    else:
        shown = _sum(ledger.settled)
    ledger.seconds = GoodputSeconds(**{k: round(v, 2) for k, v in shown.model_dump().items()})
    wall = sum(shown.model_dump().values())
    ledger.wall_seconds = round(wall, 2)
    ledger.fraction = round(shown.productive / wall, 4) if wall > 0 else None
    ledger.as_of = format_time(as_of)


def next_round(ledger: GoodputStatus, now: datetime, round: int, previous: TrainerAccount | None,
               checkpoint: CheckpointStatus | None, script: bool = False) -> None:
    """While running, the gang restarted in place as `round`: the incarnation's time running so far is cut,
    split by rank 0's account of the round before (`previous`)."""
    ended = (TrainerTimeStatus(restart=ledger.restart, round=ledger.round, **previous.model_dump())
             if previous is not None else None)
    settle(ledger, Phase.RUNNING, now, Ending.CUT, ended, checkpoint, script)
    ledger.round = round


def split(running: float, time: TrainerTimeStatus | None, ended: Ending,
          checkpoint: CheckpointStatus | None, script: bool = False) -> GoodputSeconds:
    """An incarnation's time running, by kind, from rank 0's account of it. Before its first step all of
    it is start-up; so is an incarnation whose rank 0 never answered a scrape, unless the job runs a
    `script` of its own: one that does not use the runtime library never reports, and its time running
    counts as productive."""
    if running <= 0:
        return GoodputSeconds()
    if time is None and script:
        return GoodputSeconds(productive=running)
    if time is None or not time.startup_seconds:
        return GoodputSeconds(startup=running)
    preflight = min(time.preflight_seconds or 0.0, time.startup_seconds)
    parts = [time.startup_seconds - preflight, preflight, time.train_seconds or 0.0,
             time.checkpoint_stall_seconds or 0.0]
    # Rank 0's account may exceed the gang's time running: it started before the last pod ran (and
    # waited for it in the rendezvous). The excess comes off its start-up first.
    excess = sum(parts) - running
    for i, part in enumerate(parts):
        cut = min(part, max(excess, 0.0))
        parts[i], excess = part - cut, excess - cut
    startup, preflight, train, stall = parts
    rest = running - sum(parts)  # before rank 0's process started, and after its last log
    seconds = GoodputSeconds(startup=startup, preflight=preflight, checkpoint=stall)
    if ended is Ending.DONE:
        seconds.productive = train + rest
        return seconds
    checkpoint = checkpoint or CheckpointStatus()
    resumed = time.resumed_from
    if resumed is None and checkpoint.resumed_at_restart == time.restart:  # an older operator's account
        resumed = checkpoint.resumed_from
    kept = max(checkpoint.step or 0, resumed or 0)  # where the next incarnation resumes
    trained = (time.step or 0) - (resumed or 0) - 1  # the steps `train_seconds` covers, the first aside
    lost = max((time.step or 0) - kept, 0)
    seconds.recomputed = min(train, lost * train / trained) if trained > 0 else 0.0
    seconds.productive = train - seconds.recomputed
    seconds.restarts = rest
    return seconds


def _of(ledger: GoodputStatus, time: TrainerTimeStatus | None) -> TrainerTimeStatus | None:
    """Rank 0's account, if it is of the ledger's current incarnation and round."""
    return (time if time is not None and time.restart == ledger.restart and (time.round or 0) == ledger.round
            else None)


def _sum(*parts: GoodputSeconds) -> GoodputSeconds:
    """The kinds added up, every field set (a field left unset would not be written)."""
    return GoodputSeconds(**{name: round(sum(getattr(p, name) for p in parts), 3)
                             for name in GoodputSeconds.model_fields})


def _seconds(since: str | None, now: datetime) -> float:
    start = parse_time(since)
    return max((now - start).total_seconds(), 0.0) if start is not None else 0.0


def _second(t: datetime) -> datetime:
    """The ledger's times are stored to the second: counting from them, so must its intervals."""
    return t.replace(microsecond=0)
