"""What a node says of why it stopped: the pod's termination message.

The node's launcher (tetrad.node.supervisor) writes it, once, from what the node's workers left in
its exit directory; the operator reads it from the pod's status. One JSON object of at most
TERMINATION_MESSAGE_MAX bytes (Kubernetes keeps no more), every key optional:

    reason, message    the cause a worker named, e.g. EntryPointNotFound and one line naming the field
    preflight          the preflight gate's failures: [{"node", "nodeRank", "reason"}]; a null node
                       is the gang's failure, not one node's
    collectiveTimeout  the collective that timed out and the peers that did not answer
    checkpointStep     rank 0 stopped on SIGTERM: the last committed step (null: none) ...
    checkpointTime     ... and its Unix commit time, when this process committed it
    figures            rank 0's last figures (contract.SCRAPED gauges as exposition text)
    round              the round of restarts in place the node ended in (left out in round 0)

When it does not fit, the figures go first, then the preflight entries after the first, then the
texts are cut. Standard library only: the launcher ships this module to pods without Tetrad.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Final, TypeGuard

from tetrad.api.contract import (
    TERMINATION_CHECKPOINT_STEP,
    TERMINATION_CHECKPOINT_TIME,
    TERMINATION_FIGURES,
    TERMINATION_MESSAGE_MAX,
    TERMINATION_ROUND,
)

# The check whose failure a node reports without being at fault: pod 0's name did not resolve there (pod 0 not
# running, or the cluster's DNS), so the operator restarts the gang without excluding the node.
RENDEZVOUS_CHECK: Final = "rendezvous"


@dataclass(frozen=True)
class NodeFailure:
    """A preflight failure: the node (None: the gang's failure), its rank, which check failed and why.
    `reason` starts with the check's name: `devices: ...`, `cpu: ...`, `rendezvous: ...`."""

    node: str | None
    node_rank: int | None
    reason: str


def rendezvous_failure(host: str, seconds: float, error: str) -> str:
    """The reason of a node that waited `seconds` for pod 0's name `host` in vain."""
    return (f"{RENDEZVOUS_CHECK}: pod 0's name {host} did not resolve within {seconds:g} s ({error}); "
            "is pod 0 running?")


def blames_the_node(reason: str) -> bool:
    """Whether a failure says something against the node that reported it (not a rendezvous failure)."""
    return not reason.startswith(f"{RENDEZVOUS_CHECK}:")


@dataclass(frozen=True)
class TerminationMessage:
    reason: str | None = None
    message: str | None = None
    preflight: tuple[NodeFailure, ...] = ()
    collective_timeout: str | None = None
    # rank 0 stopped on SIGTERM: checkpoint_step (None: nothing committed) is what it saved
    stopped: bool = False
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    figures: str | None = None
    round: int = 0

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.reason is not None:
            doc["reason"] = self.reason
        if self.message is not None:
            doc["message"] = self.message
        if self.preflight:
            doc["preflight"] = [{"node": f.node, "nodeRank": f.node_rank, "reason": f.reason}
                                for f in self.preflight]
        if self.collective_timeout is not None:
            doc["collectiveTimeout"] = self.collective_timeout
        if self.stopped:
            doc[TERMINATION_CHECKPOINT_STEP] = self.checkpoint_step
            if self.checkpoint_time is not None:
                doc[TERMINATION_CHECKPOINT_TIME] = self.checkpoint_time
        if self.figures is not None:
            doc[TERMINATION_FIGURES] = self.figures
        if self.round:
            doc[TERMINATION_ROUND] = self.round
        return doc

    def encode(self) -> str:
        """The JSON text, cut to TERMINATION_MESSAGE_MAX bytes as the module says; "" when empty."""
        m = self
        text = _dumps(m)
        if len(text.encode()) > TERMINATION_MESSAGE_MAX:
            m = replace(m, figures=None)  # cut figures say nothing: drop them whole
            text = _dumps(m)
        while len(text.encode()) > TERMINATION_MESSAGE_MAX and len(m.preflight) > 1:
            m = replace(m, preflight=m.preflight[:-1])
            text = _dumps(m)
        if len(text.encode()) > TERMINATION_MESSAGE_MAX:
            room = TERMINATION_MESSAGE_MAX // 4
            m = replace(m, message=_cut(m.message, room), collective_timeout=_cut(m.collective_timeout, room),
                        preflight=tuple(replace(f, reason=_cut(f.reason, room) or "") for f in m.preflight))
            text = _dumps(m)
        return text

    @classmethod
    def parse(cls, text: str | None) -> TerminationMessage:
        """What a termination message says; empty for one that is missing or not Tetrad's."""
        try:
            doc = json.loads(text or "")
        except ValueError:
            return cls()
        if not isinstance(doc, dict):
            return cls()
        step, at, figures, round_ = (doc.get(k) for k in (TERMINATION_CHECKPOINT_STEP,
                                                          TERMINATION_CHECKPOINT_TIME, TERMINATION_FIGURES,
                                                          TERMINATION_ROUND))
        return cls(
            reason=_text(doc.get("reason")),
            message=_text(doc.get("message")),
            preflight=tuple(_failures(doc.get("preflight"))),
            collective_timeout=_text(doc.get("collectiveTimeout")),
            stopped=TERMINATION_CHECKPOINT_STEP in doc,
            checkpoint_step=step if _is_int(step) else None,
            checkpoint_time=float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None,
            figures=figures if isinstance(figures, str) else None,
            round=round_ if _is_int(round_) and round_ > 0 else 0,
        )


def _dumps(m: TerminationMessage) -> str:
    doc = m.to_json()
    return json.dumps(doc) if doc else ""


def _cut(text: str | None, room: int) -> str | None:
    return text if text is None or len(text) <= room else text[: room - 3] + "..."


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _failures(entries: Any) -> list[NodeFailure]:
    if not isinstance(entries, list):
        return []
    out = []
    for e in entries:
        if isinstance(e, dict):
            node, rank = e.get("node"), e.get("nodeRank")
            out.append(NodeFailure(node if isinstance(node, str) and node else None,
                                   rank if _is_int(rank) else None,
                                   str(e.get("reason") or "preflight failed")))
    return out
