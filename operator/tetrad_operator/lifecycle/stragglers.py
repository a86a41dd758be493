"""Stragglers, operator side: rank 0 gathers every rank's own time per step and exports the slowest ranks
(tetrad.api.stragglers); the scraper reads them into status.stragglers. `report` judges them for the
current incarnation: a rank whose lag reaches spec.metrics.slowRankLag makes the SlowRank condition and a
Warning Event (again when it names other ranks); the condition turns False once none does.
"""

from __future__ import annotations

from tetrad.api.stragglers import is_slow
from tetrad_operator.lifecycle.machine import JobPass

SLOW_RANK = "SlowRank"  # the condition


def report(m: JobPass, restart: int, threshold: float) -> None:
    measured = m.read.stragglers
    if measured is None or measured.restart != restart:
        return  # not gathered in this incarnation yet
    slow = [r for r in measured.ranks if is_slow(r.lag, threshold)]
    if slow:
        who = ", ".join(f"rank {r.rank} on {r.node}" for r in slow)
        them = "it" if len(slow) == 1 else "them"
        lags = ", ".join(f"{r.lag:.0%}" for r in slow)
        m.warn(SLOW_RANK, f"{who}: the gang waits for {them} {lags} of every step (at step {measured.step}), "
                          f"at or above spec.metrics.slowRankLag={threshold:g}",
               news=lambda told: not told.startswith(f"{who}:"))  # other ranks; not a new step or lag
    else:
        m.unwarn(SLOW_RANK, "NoSlowRank",
                 f"restart {restart}, step {measured.step}: no rank's lag reaches {threshold:g}")

