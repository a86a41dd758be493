"""How a node's workers tell its supervisor how they ended: the exit directory.

The supervisor makes a fresh directory for each torchrun it starts and names it in $TETRAD_EXIT_DIR.
Each worker leaves there, atomically (a temporary name, then a rename):

    rank-R              its exit code, as text
    message-rank-R.json what it has to say (a tetrad.api.termination.TerminationMessage): the cause it
                        exited for (reason and message), the preflight failures it saw, the collective
                        that timed out, and, from rank 0, its last figures and committed checkpoint

A worker that dies without a word (SIGKILL, a segfault, NCCL's abort) leaves nothing; an NCCL abort
leaves its flight recorder dump (tetrad.node.collective). `node_exit_code` and `compose` turn the
directory into the node's exit code and its one termination message.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from tetrad.api.contract import (
    ENV_EXIT_DIR,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
)
from tetrad.api.termination import NodeFailure, TerminationMessage

CODE_PREFIX = "rank-"
STARTED_PREFIX = "started-rank-"  # a worker the launcher runs: it reports its code whenever it ends itself
MESSAGE_PREFIX = "message-rank-"


def _rank() -> str:
    return os.environ.get("RANK", str(os.getpid()))


def _write(directory: Path, name: str, text: str) -> None:
    tmp = directory / f".{name}"
    tmp.write_text(text)
    tmp.replace(directory / name)


def _exit_dir() -> Path | None:
    directory = os.environ.get(ENV_EXIT_DIR)
    return Path(directory) if directory else None


def report_start() -> None:
    """This worker runs under the launcher, which reports its exit code however it ends, short of a signal
    (os._exit included: `report_on_exit`)."""
    if (directory := _exit_dir()) is not None:
        _write(directory, f"{STARTED_PREFIX}{_rank()}", "")


def started_ranks(directory: Path) -> set[int]:
    return set(_by_rank(directory, STARTED_PREFIX))


def report_exit(code: int) -> None:
    """This worker's exit code, for its supervisor (nothing without one)."""
    if (directory := _exit_dir()) is not None:
        _write(directory, f"{CODE_PREFIX}{_rank()}", str(code))


def leave(message: TerminationMessage) -> None:
    """What this worker has to say, merged into what it said before (nothing without a supervisor)."""
    if (directory := _exit_dir()) is None:
        return
    path = directory / f"{MESSAGE_PREFIX}{_rank()}.json"
    said = TerminationMessage.parse(path.read_text()) if path.exists() else TerminationMessage()
    merged = replace(
        said,
        reason=message.reason or said.reason, message=message.message or said.message,
        preflight=said.preflight + message.preflight,
        collective_timeout=message.collective_timeout or said.collective_timeout,
        stopped=message.stopped or said.stopped,
        checkpoint_step=message.checkpoint_step if message.stopped else said.checkpoint_step,
        checkpoint_time=message.checkpoint_time if message.stopped else said.checkpoint_time,
        figures=message.figures if message.figures is not None else said.figures,
    )
    _write(directory, path.name, merged.encode() or "{}")


def _by_rank(directory: Path, prefix: str, suffix: str = "") -> dict[int, str]:
    out = {}
    for path in directory.glob(f"{prefix}*{suffix}"):
        rank = path.name[len(prefix): len(path.name) - len(suffix)]
        if rank.isdigit():
            out[int(rank)] = path.read_text()
    return dict(sorted(out.items()))


def reported_codes(directory: Path) -> dict[int, int]:
    """Each reporting worker's exit code, by global rank."""
    return {rank: int(text) for rank, text in _by_rank(directory, CODE_PREFIX).items()
            if text.strip().lstrip("-").isdigit()}


def reported_messages(directory: Path) -> dict[int, TerminationMessage]:
    return {rank: TerminationMessage.parse(text)
            for rank, text in _by_rank(directory, MESSAGE_PREFIX, ".json").items()}


# A cause any worker reports is the node's, in this order: its peers on the node were stopped because of it.
NODE_CAUSES = (EXIT_CONFIG_ERROR, EXIT_OOM, EXIT_PREFLIGHT, EXIT_COLLECTIVE_TIMEOUT)


def node_exit_code(torchrun_code: int, worker_codes: list[int], nproc: int | None) -> int:
    """The exit code of a node from torchrun's and its workers' reported codes."""
    if torchrun_code == 0:
        return 0
    for cause in NODE_CAUSES:
        if cause in worker_codes:
            return cause
    if (worker_codes and all(c == EXIT_PREEMPTED for c in worker_codes)
            and (nproc is None or len(worker_codes) == nproc)):
        return EXIT_PREEMPTED
    # a worker's own non-zero code (a script's sys.exit(3)) before torchrun's, which is 1 for any failure
    if failed := [c for c in worker_codes if c not in (0, EXIT_PREEMPTED)]:
        return failed[0]
    return torchrun_code if torchrun_code > 0 else 128 - torchrun_code  # -N: killed by signal N


def compose(messages: dict[int, TerminationMessage], collective_timeout: str | None = None,
            failures: list[NodeFailure] | None = None) -> TerminationMessage:
    """The node's termination message from its workers' (by rank): the first stated cause, every preflight
    failure once, the first collective timeout, and rank 0's last figures and checkpoint."""
    preflight = dict.fromkeys(failures or [])
    cause = None
    for said in messages.values():
        preflight.update(dict.fromkeys(said.preflight))
        cause = cause or (said if said.reason else None)
        collective_timeout = collective_timeout or said.collective_timeout
    rank0 = messages.get(0, TerminationMessage())
    return TerminationMessage(
        reason=cause.reason if cause else None, message=cause.message if cause else None,
        preflight=tuple(preflight), collective_timeout=collective_timeout,
        stopped=rank0.stopped, checkpoint_step=rank0.checkpoint_step, checkpoint_time=rank0.checkpoint_time,
        figures=rank0.figures)
