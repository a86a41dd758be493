"""Preemption: SIGTERM → every rank finishes its step, a checkpoint is saved, exit 75.

Kubernetes sends SIGTERM to the container's first process and SIGKILLs it after the pod's
terminationGracePeriodSeconds. The node's supervisor (tetrad.node.supervisor) forwards it to torchrun,
which forwards it to its workers, waits for them (at most its --shutdown-timeout, PET_SHUTDOWN_TIMEOUT,
default 30 s) and then exits 1, whatever the workers' exit codes were; the supervisor turns the
workers' reported codes into the node's (75 when every worker reported 75).

In each worker, `Preemption` records the signal; `requested()`, called by every rank once per step (and
twice during start-up), agrees across ranks (an all-reduce of the flag), so all ranks stop after the
same step even when only some of them were signalled. The trainer then saves, unless its last save's
duration says the save cannot finish in the time left, and returns 75. The runtime library
(tetrad_trainer.runtime) gives a script the same agreement.
"""

from __future__ import annotations

import math
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from tetrad.api.termination import TerminationMessage
from tetrad.node import exits
from tetrad.node.environment import WorkerEnv


class Preemption:
    """Records SIGTERM (and the other given signals) instead of dying; see `requested`.

    Install it first thing, before the process group exists, so that a signal during start-up is
    kept too; `connect()` once the process group is up. The time left after the signal is
    torchrun's shutdown timeout (PET_SHUTDOWN_TIMEOUT, which the pods and `tetrad run` set from
    terminationGracePeriodSeconds) less the time since the signal.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,), env: WorkerEnv | None = None):
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.remaining_s: float | None = None  # agreed by the last `requested()`; None: no deadline known
        self.checkpoint_asked = False  # agreed by the last `requested()`: some rank was asked to save now
        self.grace_s = (env or WorkerEnv.read()).shutdown_timeout_s
        self._pg: dist.ProcessGroup | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def connect(self) -> None:
        """Our own gloo group (collective): a CPU flag, never a device sync, and no interleaving with
        the training collectives."""
        if dist.is_available() and dist.is_initialized():
            self._pg = dist.new_group(backend="gloo")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.monotonic()

    def _left(self) -> float:
        if self.received_at is None or self.grace_s is None:
            return math.inf
        return self.grace_s - (time.monotonic() - self.received_at)

    def requested(self, checkpoint_asked: bool = False) -> bool:
        """True on every rank when any rank was signalled; sets `remaining_s` to the least time any
        rank has left, and `checkpoint_asked` when any rank was asked for a checkpoint now
        (tetrad_trainer.checkpoint_request: one all-reduce serves both). Collective: call it on all ranks."""
        state = torch.tensor([0.0 if self.received is None else 1.0, -self._left(), float(checkpoint_asked)],
                             dtype=torch.float64)
        if self._pg is not None:
            dist.all_reduce(state, op=dist.ReduceOp.MAX, group=self._pg)
        left = -state[1].item()
        self.remaining_s = None if math.isinf(left) else left
        self.checkpoint_asked = bool(state[2].item())
        return bool(state[0].item())

    def everyone(self, ok: bool) -> bool:
        """True when `ok` holds on every rank. Collective."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        if self._pg is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(flag.item())


def leave_final_state(rank: int, figures: str,
                      stopped: tuple[int | None, float | None] | None = None) -> None:
    """Rank 0 finishing: its last figures (exposition text) for the node's termination message, where the
    operator reads them into the job's status. Stopping on SIGTERM, `stopped` adds the last committed
    step and its Unix commit time (when this process committed it): what a suspend saved."""
    if rank != 0:
        return
    step, committed_at = stopped if stopped is not None else (None, None)
    exits.leave(TerminationMessage(stopped=stopped is not None, checkpoint_step=step,
                                   checkpoint_time=committed_at, figures=figures))
