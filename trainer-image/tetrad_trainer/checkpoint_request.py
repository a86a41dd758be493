"""checkpoint-now: save a checkpoint at the next step without stopping.

The operator copies the job's `tetrad.dev/checkpoint-now` annotation (any token) onto rank 0's pod;
the pod's downward-API volume projects it into a file ($TETRAD_CHECKPOINT_REQUEST_FILE), which the
kubelet rewrites when the annotation changes. Rank 0 reads the file once per step: a token it has
not served yet is a request. The ranks agree on it in the per-step all-reduce of `Preemption`, so
every rank saves the same step. Once that checkpoint commits, rank 0 exports the token with the
step and time (METRIC_REQUEST_STEP / METRIC_REQUEST_TIME), which the operator copies into
status.checkpoint.requestCommitted.
"""

from __future__ import annotations

from pathlib import Path

MAX_TOKEN_CHARS = 256  # a token is an id, not data (the gauge's label carries it)


class CheckpointRequests:
    """Rank 0's reader of checkpoint-now tokens; on other ranks, or without the file, it never asks."""

    def __init__(self, rank: int, path: Path | None):
        self.path = path if rank == 0 else None
        self.seen = ""  # a new pod's file starts empty: the operator annotates only after it runs

    def poll(self) -> str | None:
        """A token not seen before in the file, else None (an unreadable file asks nothing)."""
        if self.path is None:
            return None
        try:
            token = self.path.read_text(errors="replace").strip()[:MAX_TOKEN_CHARS]
        except OSError:
            return None
        if not token or token == self.seen:
            return None
        self.seen = token
        return token
