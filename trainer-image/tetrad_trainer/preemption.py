"""Preemption: SIGTERM → every rank finishes its step, a checkpoint is saved, exit 75.

Kubernetes sends SIGTERM to the container's first process and SIGKILLs it after the pod's
terminationGracePeriodSeconds. torchrun forwards SIGTERM to its workers, waits for them (at most
its --shutdown-timeout, PET_SHUTDOWN_TIMEOUT, default 30 s) and then exits 1, whatever the
workers' exit codes were. Two pieces turn that into EXIT_PREEMPTED (75):

- In each worker, `Preemption` records the signal; `requested()`, called by every rank once per
  step (and twice during start-up), agrees across ranks (an all-reduce of the flag), so all ranks
  stop after the same step even when only some of them were signalled. The trainer then saves,
  unless its last save's duration says the save cannot finish in the time left, and returns 75,
  which it reports with `report_exit`.
- `python -m tetrad_trainer.preemption torchrun ...` (the pods' command: on a worker node it first
  waits for the master's name, tetrad_trainer.rendezvous) runs torchrun as a child, forwards SIGTERM,
  SIGINT and SIGHUP, and exits with the workers' own code: 75 when every local worker reported
  75, 78 (EXIT_CONFIG_ERROR) or else 77 (EXIT_OOM) when any reported it, 79 (EXIT_COLLECTIVE_TIMEOUT)
  when one reported it or left an NCCL flight-recorder dump (tetrad_trainer.collective), torchrun's
  code otherwise.

Orphans: the supervisor gets SIGTERM when its parent dies (`tetrad run` SIGKILLed), torchrun
gets SIGTERM when the supervisor dies, and a worker gets SIGKILL when torchrun dies
(PR_SET_PDEATHSIG), so no process of a node outlives the one that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from tetrad.api.contract import (
    ENV_EXIT_DIR,
    ENV_TERMINATION_LOG,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
    TERMINATION_CHECKPOINT_STEP,
    TERMINATION_CHECKPOINT_TIME,
    TERMINATION_FIGURES,
    TERMINATION_LOG,
    TERMINATION_MESSAGE_MAX,
)
from tetrad_trainer import collective, preflight, rendezvous

# torchrun's own setting (--shutdown-timeout): how long it waits for the workers after SIGTERM.
ENV_TORCHRUN_SHUTDOWN_TIMEOUT = "PET_SHUTDOWN_TIMEOUT"


class Preemption:
    """Records SIGTERM (and the other given signals) instead of dying; see `requested`.

    Install it first thing, before the process group exists, so that a signal during start-up is
    kept too; `connect()` once the process group is up. The time left after the signal is
    torchrun's shutdown timeout (PET_SHUTDOWN_TIMEOUT, which the pods and `tetrad run` set from
    terminationGracePeriodSeconds) less the time since the signal.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.remaining_s: float | None = None  # agreed by the last `requested()`; None: no deadline known
        self.checkpoint_asked = False  # agreed by the last `requested()`: some rank was asked to save now
        timeout = os.environ.get(ENV_TORCHRUN_SHUTDOWN_TIMEOUT, "")
        self.grace_s = float(timeout) if timeout.replace(".", "", 1).isdigit() else None
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


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return


def report_exit(code: int) -> None:
    """Tell the supervising `python -m tetrad_trainer.preemption` this worker's exit code."""
    directory = os.environ.get(ENV_EXIT_DIR)
    if directory:
        rank = os.environ.get("RANK", str(os.getpid()))
        tmp = Path(directory) / f".rank-{rank}"
        tmp.write_text(str(code))
        tmp.replace(Path(directory) / f"rank-{rank}")


def leave_termination_message(figures: str, stopped: tuple[int | None, float | None] | None = None) -> None:
    """Rank 0 finishing: its last figures (exposition text) into the pod's termination message, where the
    operator reads them into the job's status ($TETRAD_TERMINATION_LOG, else Kubernetes' file when it
    exists). Stopping on SIGTERM, `stopped` adds the last committed step and its Unix commit time (when
    this process committed it): what a suspend saved."""
    if os.environ.get("RANK", "0") != "0":
        return
    path = Path(os.environ.get(ENV_TERMINATION_LOG) or TERMINATION_LOG)
    message: dict[str, int | float | str | None] = {}
    if stopped is not None:
        step, committed_at = stopped
        message[TERMINATION_CHECKPOINT_STEP] = step
        if committed_at is not None:
            message[TERMINATION_CHECKPOINT_TIME] = committed_at
    if len(json.dumps({**message, TERMINATION_FIGURES: figures})) <= TERMINATION_MESSAGE_MAX:
        message[TERMINATION_FIGURES] = figures  # else the figures go: a cut message would say nothing
    if ENV_TERMINATION_LOG in os.environ or path.exists():
        with contextlib.suppress(OSError):
            path.write_text(json.dumps(message))


def node_exit_code(torchrun_code: int, worker_codes: list[int], nproc: int | None) -> int:
    """The exit code of a node from torchrun's and its workers' reported codes."""
    if torchrun_code == 0:
        return 0
    # A cause reported by any worker is the node's: a config error, out of memory, a failed preflight gate,
    # a collective timeout (its peers on the node were stopped because of it).
    for permanent in (EXIT_CONFIG_ERROR, EXIT_OOM, EXIT_PREFLIGHT, EXIT_COLLECTIVE_TIMEOUT):
        if permanent in worker_codes:
            return permanent
    if worker_codes and all(c == EXIT_PREEMPTED for c in worker_codes) and (nproc is None or len(worker_codes) == nproc):
        return EXIT_PREEMPTED
    return torchrun_code if torchrun_code > 0 else 128 - torchrun_code  # -N: killed by signal N


def supervise(command: list[str]) -> int:
    """Wait for the master's name (a worker node), check the node, then run `command` (torchrun ...)
    with signals forwarded; return the node's exit code."""
    if (failed := rendezvous.wait_for_master()) is not None:
        return failed
    if (failed := preflight.before_torchrun()) is not None:
        return failed
    with tempfile.TemporaryDirectory(prefix="tetrad-exit-") as exit_dir:
        env = {**os.environ, ENV_EXIT_DIR: exit_dir}
        child: subprocess.Popen[bytes] | None = None
        received: list[int] = []
        forwarded = False

        def forward_once() -> None:
            # torchrun's graceful stop is one SIGTERM: a second one interrupts its wait for the workers.
            nonlocal forwarded
            if child is not None and received and not forwarded:
                forwarded = True
                child.send_signal(signal.SIGTERM)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            received.append(signum)
            forward_once()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        child = subprocess.Popen(command, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        forward_once()  # a signal that came before torchrun existed
        code = child.wait()
        reported = [int(p.read_text()) for p in Path(exit_dir).glob("rank-*")]
        preflight_failures = preflight.reported_failures(exit_dir)
        if (timed_out := collective.node_summary(exit_dir)) is not None:  # NCCL aborts without reporting
            reported.append(EXIT_COLLECTIVE_TIMEOUT)
    nproc = os.environ.get("PET_NPROC_PER_NODE")
    final = node_exit_code(code, reported, int(nproc) if nproc and nproc.isdigit() else None)
    if final != code:
        print(f"[tetrad] torchrun exited {code}; the workers reported {sorted(set(reported))}: exiting {final}",
              file=sys.stderr, flush=True)
    if final == EXIT_PREFLIGHT:
        preflight.write_termination_message(preflight_failures)
    if final == EXIT_COLLECTIVE_TIMEOUT and timed_out is not None:
        collective.write_termination_message(timed_out)
    return final


def main() -> None:
    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.exit("usage: python -m tetrad_trainer.preemption torchrun [ARGS...]")
    die_with_parent(signal.SIGTERM)
    sys.exit(supervise(command))


if __name__ == "__main__":
    main()
