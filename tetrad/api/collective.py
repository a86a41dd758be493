"""The collective-timeout termination message: the node writes it (the trainer's supervisor), the
operator reads it from the pod's status into the job's Event and condition.

The message is JSON, `{"collectiveTimeout": "<one line: the collective, its group, the peers that
did not answer>"}`, at most contract.TERMINATION_MESSAGE_MAX bytes.
"""

from __future__ import annotations

import json

from tetrad.api.contract import TERMINATION_MESSAGE_MAX

KEY = "collectiveTimeout"


def termination_message(summary: str) -> str:
    text = json.dumps({KEY: summary})
    while len(text.encode()) > TERMINATION_MESSAGE_MAX:
        summary = summary[: len(summary) * 3 // 4]
        text = json.dumps({KEY: summary})
    return text


def parse_termination_message(text: str | None) -> str | None:
    """The summary a termination message carries; None when it is not a collective timeout's."""
    try:
        doc = json.loads(text or "")
    except ValueError:
        return None
    summary = doc.get(KEY) if isinstance(doc, dict) else None
    return summary if isinstance(summary, str) and summary else None
