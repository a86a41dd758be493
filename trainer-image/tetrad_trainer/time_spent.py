"""This process's account of its time, for the job's goodput (status.goodput): its start-up (process
start to the end of its first step), its training after that, and the part of it the training loop spent
blocked on checkpoint saves. Rank 0's figures reach status.trainerTime through the step records."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_IMPORTED_AT = time.time()


def seconds_since_process_start() -> float:
    """Wall time since this process started (Linux /proc; elsewhere since this module was imported)."""
    try:
        started = (int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
                   / os.sysconf("SC_CLK_TCK"))
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED_AT


class TimeSpent:
    def __init__(self) -> None:
        self.startup_s: float | None = None  # process start to the end of the first step
        self.checkpoint_stall_s = 0.0  # blocked on saves since the end of the first step
        self._first_step_end: float | None = None  # time.perf_counter()

    def step_completed(self) -> bool:
        """Call it as each step ends; True on the first."""
        if self.startup_s is not None:
            return False
        self.startup_s = seconds_since_process_start()
        self._first_step_end = time.perf_counter()
        return True

    @contextmanager
    def checkpoint_stall(self) -> Iterator[None]:
        """Around a save the training loop waits for (an asynchronous save's blocking part)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stalled(time.perf_counter() - start)

    def stalled(self, seconds: float) -> None:
        """The loop waited `seconds` for a save (before the first step's end it is start-up)."""
        if self._first_step_end is not None:
            self.checkpoint_stall_s += seconds

    def train_s(self) -> float:
        """From the end of the first step to now, checkpoint stalls excluded; 0 before the first step."""
        if self._first_step_end is None:
            return 0.0
        return max(time.perf_counter() - self._first_step_end - self.checkpoint_stall_s, 0.0)

    def record(self) -> dict[str, float]:
        """The StepRecord fields of this account."""
        return {"startup_s": self.startup_s or 0.0, "train_s": self.train_s(),
                "checkpoint_stall_s": self.checkpoint_stall_s}
