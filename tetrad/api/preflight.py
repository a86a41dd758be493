"""The preflight gate's shared rules: the termination message a failing node writes (the trainer)
and reads back (the operator), and which nodes are slow.

The message is JSON, `{"preflight": [{"node": ..., "nodeRank": ..., "reason": ...}, ...]}`, at most
contract.TERMINATION_MESSAGE_MAX bytes; `node` is null when a failure names no node (the gang's
all-reduce timed out as a whole).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tetrad.api.contract import TERMINATION_MESSAGE_MAX


@dataclass(frozen=True)
class NodeFailure:
    node: str | None  # None: the failure is the gang's, not one node's
    node_rank: int | None
    reason: str


def termination_message(failures: Sequence[NodeFailure]) -> str:
    """The JSON message naming `failures`, cut to fit Kubernetes' limit (whole entries, then the reasons)."""
    entries = [{"node": f.node, "nodeRank": f.node_rank, "reason": f.reason} for f in failures]
    text = json.dumps({"preflight": entries})
    while len(text.encode()) > TERMINATION_MESSAGE_MAX and len(entries) > 1:
        entries.pop()
        text = json.dumps({"preflight": entries})
    if len(text.encode()) > TERMINATION_MESSAGE_MAX:
        entries[0]["reason"] = str(entries[0]["reason"])[:TERMINATION_MESSAGE_MAX // 2]
        text = json.dumps({"preflight": entries})
    return text


def parse_termination_message(text: str | None) -> list[NodeFailure]:
    """The failures a termination message names; [] when it is not a preflight message."""
    try:
        doc = json.loads(text or "")
    except ValueError:
        return []
    entries = doc.get("preflight") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return []
    out = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        node, rank, reason = e.get("node"), e.get("nodeRank"), e.get("reason")
        out.append(NodeFailure(node if isinstance(node, str) and node else None,
                               rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                               str(reason) if reason else "preflight failed"))
    return out


def slow_nodes(bandwidth: Mapping[str, float], fraction: float) -> list[str]:
    """Nodes whose bus bandwidth is below `fraction` of the median of all nodes' (0: none)."""
    if fraction <= 0 or len(bandwidth) < 2:
        return []
    floor = fraction * statistics.median(bandwidth.values())
    return sorted(node for node, bw in bandwidth.items() if bw < floor)
