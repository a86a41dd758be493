"""A round's first failed worker, as the supervisor sees it while torchrun still runs.

When one worker fails, torchrun SIGTERMs the others and waits up to 30 s for them before it SIGKILLs
them and exits. A worker blocked in a collective with a live peer that waits in turn, as pipeline and
tensor-parallel peers of the failed rank do, only ends at that SIGKILL, and no rank can save a checkpoint
without the failed one. So during restarts in place the supervisor watches torchrun's children (the
workers; in a round a spare forked, torchrun is the spare's child and its children are the workers'
relays): the first that ended without a word (a signal) or
with a code other than 0 and 75 (finished, preempted and saved) is the round's failure, and the
supervisor stops the round at once instead of waiting for torchrun.

A collective timeout (exit 79) is the exception: the node's other workers in the same collective time out
moments later, and each reports the collective and the peers that did not answer. The round stops once
they all ended, or COLLECTIVE_TIMEOUT_GRACE_S after the first, so that no report is cut off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tetrad.api.contract import EXIT_COLLECTIVE_TIMEOUT, EXIT_PREEMPTED
from tetrad.node import exits

COLLECTIVE_TIMEOUT_GRACE_S = 5.0  # after a worker's collective timeout, for its peers' own reports


def children(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """The live children of process `pid` (none when the kernel does not list them)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in (proc / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError):
                found.update(int(c) for c in (task / "children").read_text().split())
    return found


def rank_of(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The global rank torchrun gave process `pid` (RANK in its environment), if any."""
    with contextlib.suppress(OSError, ValueError):
        for entry in (proc / str(pid) / "environ").read_bytes().split(b"\0"):
            if entry.startswith(b"RANK="):
                return int(entry[5:])
    return None


class FirstFailure:
    """Torchrun's workers of one round, looked at again and again (`check`)."""

    def __init__(self, exit_dir: Path, proc: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.exit_dir, self.proc, self.clock = exit_dir, proc, clock
        self.ranks: dict[int, int] = {}  # worker pid -> rank
        self.timed_out: tuple[str, float] | None = None  # the first collective timeout, and when seen

    def check(self, torchruns: Iterable[int]) -> str | None:
        """What the first worker that ended failed said (rank and how), or None while none has. The workers
        are the children of `torchruns` that torchrun gave a RANK."""
        running = {pid for torchrun in torchruns for pid in children(torchrun, self.proc)}
        for pid in running - self.ranks.keys():
            if (rank := rank_of(pid, self.proc)) is not None:
                self.ranks[pid] = rank
        ended = [pid for pid in self.ranks if pid not in running]
        codes = exits.reported_codes(self.exit_dir) if ended else {}
        started = exits.started_ranks(self.exit_dir) if ended else set()
        for pid in ended:
            rank = self.ranks.pop(pid)
            code = codes.get(rank)
            if code is None and rank in started:
                return f"rank {rank}'s worker ended without a word"
            if code == EXIT_COLLECTIVE_TIMEOUT:
                self.timed_out = self.timed_out or (f"rank {rank}'s worker exited {code}", self.clock())
            elif code is not None and code not in (0, EXIT_PREEMPTED):
                return f"rank {rank}'s worker exited {code}"
        if self.timed_out is not None and (
                not self.ranks or self.clock() - self.timed_out[1] >= COLLECTIVE_TIMEOUT_GRACE_S):
            return self.timed_out[0]
        return None
