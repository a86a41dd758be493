"""Stragglers: the rule that names a slow rank, shared by the trainer (rank 0 gathers every rank's own time
per step and exports the slowest) and the operator (which judges what it scraped into status.stragglers).

A rank's own time per step is what it spends on its own work: its compute and its wait for the next batch,
not its waits for peers inside collectives. In a synchronous gang every step lasts as long as the slowest
rank's own time, so a rank's lag, (its own time - the median of its peers') / the step time, is the share
of every step the gang spends waiting for it. Its peers are the other ranks that do the same work: those of
its pipeline stage (stages differ in their layers, the first holds the embedding, the last the output).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

SLOWEST_EXPORTED = 3  # how many of the slowest ranks rank 0 exports (and status.stragglers lists)


@dataclass(frozen=True)
class RankTime:
    rank: int
    node: str
    own_s: float  # per step: compute and data wait
    stage: int = 0  # its pipeline stage: ranks are compared within one


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    own_s: float
    lag: float


def slowest(times: Sequence[RankTime], step_s: float,
            k: int = SLOWEST_EXPORTED) -> tuple[float, list[Straggler]]:
    """The median rank's own time and the k ranks of the largest lag, largest first. Ranks whose own time
    was not measured (NaN) are left out; a rank without peers has no lag."""
    known = [t for t in times if math.isfinite(t.own_s)]
    if not known:
        return math.nan, []

    lags: dict[int, float] = {}
    for stage in {t.stage for t in known}:
        group = sorted((t for t in known if t.stage == stage), key=lambda t: t.own_s)
        values = [t.own_s for t in group]
        for i, t in enumerate(group):
            peers = _median_without(values, i)
            lags[t.rank] = max(0.0, (t.own_s - peers) / step_s) if peers is not None and step_s > 0 else 0.0
    ranked = sorted(known, key=lambda t: (-lags[t.rank], -t.own_s, t.rank))

    return statistics.median(t.own_s for t in known), [Straggler(t.rank, t.node, t.own_s, lags[t.rank])
                                                       for t in ranked[:k]]


def _median_without(ordered: Sequence[float], i: int) -> float | None:
    """The median of the ascending `ordered` without its i-th value (None: nothing left)."""
    n = len(ordered) - 1
    if n < 1:
        return None

    def at(j: int) -> float:
        return ordered[j if j < i else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def is_slow(lag: float, threshold: float) -> bool:
    """Whether a rank with this lag is named slow (threshold 0: never)."""
    return threshold > 0 and lag >= threshold
