"""The preflight gate's shared rule: which nodes are slow (the gang check names them, the operator
judges the figures it reads). Its failures travel in the termination message (tetrad.api.termination)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping


def slow_nodes(bandwidth: Mapping[str, float], fraction: float) -> list[str]:
    """Nodes whose bus bandwidth is below `fraction` of the median of all nodes' (0: none)."""
    if fraction <= 0 or len(bandwidth) < 2:
        return []
    floor = fraction * statistics.median(bandwidth.values())
    return sorted(node for node, bw in bandwidth.items() if bw < floor)
