"""Which exit codes restart a gang, and how long a restart waits: one rule for the operator's restarts
(new pods) and the nodes' restarts in place (new processes in the same pods, tetrad.node.rounds).

Standard library only: the launcher's zip carries it (tetrad.node.bundle).
"""

from __future__ import annotations

from collections.abc import Collection

from tetrad.api.contract import EXIT_ALWAYS_RETRIED, EXIT_WORKERS_STUCK

PERMANENT = "PermanentExitCode"  # spec.runPolicy.permanentExitCodes lists it
NOT_RETRYABLE = "NonRetryableExitCode"  # spec.runPolicy.retryableExitCodes is given and lacks it


def refusal(code: int, *, retryable: Collection[int], permanent: Collection[int]) -> str | None:
    """Why a node that exited `code` does not restart the gang (PERMANENT or NOT_RETRYABLE), or None: it
    does, budget allowing. The codes of disruptions (EXIT_ALWAYS_RETRIED) always restart."""
    if code in EXIT_ALWAYS_RETRIED:
        return None
    if code in permanent:
        return PERMANENT
    if retryable and code not in retryable:
        return NOT_RETRYABLE
    return None


def in_place(code: int, *, retryable: Collection[int], permanent: Collection[int]) -> bool:
    """Whether the gang restarts in its own pods after a node exited `code`: a failure of the job's
    processes that restarts (above). Not a disruption: a preempted node (75) is going away, and one that
    failed the preflight gate (69) is excluded, so those need new pods; so does a node whose workers
    outlived their SIGKILL (74)."""
    return (code not in (0, EXIT_WORKERS_STUCK, *EXIT_ALWAYS_RETRIED)
            and refusal(code, retryable=retryable, permanent=permanent) is None)


def backoff_seconds(base: float, cap: float, restart: int) -> float:
    """The wait before the gang's `restart`-th restart (>= 1), in place or not: spec.runPolicy's
    backoffSeconds, doubling with each restart, capped at backoffMaxSeconds."""
    return 0.0 if restart <= 0 else float(min(base * 2 ** (restart - 1), cap))
