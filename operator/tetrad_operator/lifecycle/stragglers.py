"""Stragglers, operator side: rank 0 gathers every rank's own time per step and exports the slowest ranks
(tetrad.api.stragglers); the scraper reads them into status.stragglers. `report` judges them for the
current incarnation: a rank whose lag reaches spec.metrics.slowRankLag makes the SlowRank condition and a
Warning Event (again when it names other ranks); the condition turns False once none does. The nodes it
names are kept in status.slowRankNodes with the time since when each has been named; `sustained` lists
those named longer than spec.metrics.excludeSlowNodesAfterSeconds, which a restart excludes.
"""

from __future__ import annotations

from tetrad.api.spec import Metrics, ParallelTrainingJobSpec, SlowRankNode
from tetrad.api.stragglers import is_slow
from tetrad_operator.lifecycle import preflight
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import format_time, parse_time

SLOW_RANK = "SlowRank"  # the condition


def report(m: JobPass, restart: int, threshold: float) -> None:
    measured = m.read.stragglers
    if measured is None or measured.restart != restart:
        return  # not gathered in this incarnation yet
    slow = [r for r in measured.ranks if is_slow(r.lag, threshold)]
    named = {n.node: n for n in m.status.slow_rank_nodes}
    m.status.slow_rank_nodes = [named.get(node) or SlowRankNode(node=node, since=format_time(m.now))
                                for node in sorted({r.node for r in slow})]
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


def exclude_sustained(m: JobPass, restart: int, spec: ParallelTrainingJobSpec) -> None:
    """At a restart of incarnation `restart`: the nodes `sustained` names go to status.failedNodes,
    excluded as the preflight's budget allows (lifecycle/preflight.py), and are no longer tracked."""
    if slow := sustained(m, spec.metrics):
        preflight.record(m, slow, restart, spec.preflight, cause="stayed slow")
        gone = set(preflight.excluded(m.status))
        m.status.slow_rank_nodes = [n for n in m.status.slow_rank_nodes if n.node not in gone]


def sustained(m: JobPass, metrics: Metrics) -> list[tuple[str, str]]:
    """(node, reason) for each node SlowRank has named for spec.metrics.excludeSlowNodesAfterSeconds."""
    window = metrics.exclude_slow_nodes_after_seconds
    if window is None:
        return []
    out = []
    for n in m.status.slow_rank_nodes:
        named = (m.now - (parse_time(n.since) or m.now)).total_seconds()
        if named >= window:
            out.append((n.node, f"a rank on it stayed slow for {named:.0f}s (at or above "
                                f"spec.metrics.slowRankLag={metrics.slow_rank_lag:g}; "
                                f"spec.metrics.excludeSlowNodesAfterSeconds={window})"))
    return out
