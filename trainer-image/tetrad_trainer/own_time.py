"""Each rank's own time per step (tetrad.api.stragglers), gathered at rank 0 once per log interval.

A rank's own time is its wait for the next batch (wall time) and its compute. On a CPU the compute is the
main thread's CPU time: waiting for peers inside gloo's collectives adds none, so the rank that holds the
gang back shows. On a GPU the device time of the rank's own kernels needs a kernel trace (its compute
stream also waits for the collectives the slowest rank holds up, so event timings are the same on every
rank); there only the data wait is compared for now.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tetrad.api import stragglers
from tetrad.api.stragglers import RankTime
from tetrad_trainer.metrics import RankMetrics


class OwnTime:
    """This rank's own time since the last `gather`. Create it on every rank (its process group is made
    here, a collective); `gather` is a collective too, called by every rank at the same step."""

    def __init__(self, device: torch.device, node: str, stage: int = 0):
        self.cpu = device.type == "cpu"
        self.node, self.stage = node, stage
        self.seconds = 0.0
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # Our own gloo group: a CPU gather that never interleaves with the training collectives.
        self._pg = dist.new_group(backend="gloo") if self.distributed else None
        self._places: list[tuple[str, int]] | None = None  # (node, stage) of every rank, gathered once
        self._lap: float | None = None  # thread_time() where the running lap started

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if not self.cpu:
            yield
            return
        start = time.thread_time()
        try:
            yield
        finally:
            self.seconds += time.thread_time() - start

    def lap(self) -> None:
        """For a script whose steps are not seen from inside (tetrad_trainer.runtime): count, on a CPU, the
        main thread's CPU time since `start_lap`."""
        if self.cpu and self._lap is not None:
            self.seconds += time.thread_time() - self._lap
        self._lap = None

    def start_lap(self) -> None:
        self._lap = time.thread_time()

    def gather(self, steps: int) -> list[RankTime] | None:
        """Every rank's own time per step over the last `steps` steps, on rank 0 (None elsewhere)."""
        own, self.seconds = self.seconds / max(steps, 1), 0.0
        if self._pg is None:
            return [RankTime(0, self.node, own, self.stage)]
        rank, world = dist.get_rank(), dist.get_world_size()
        if self._places is None:
            places: list[tuple[str, int] | None] = [None] * world
            dist.all_gather_object(places, (self.node, self.stage), group=self._pg)
            self._places = [p for p in places if p is not None]
        mine = torch.tensor([own], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, every, dst=0, group=self._pg)
        if every is None:
            return None
        return [RankTime(r, node, every[r].item(), stage) for r, (node, stage) in enumerate(self._places)]

    def report(self, steps: int, step_s: float, metrics: RankMetrics) -> tuple[int, float] | None:
        """`gather`, then rank 0 exports the slowest ranks to `metrics`: (the slowest rank, its lag) on rank
        0, None elsewhere or while the step time is not known. Collective."""
        times = self.gather(steps)
        if times is None or not math.isfinite(step_s):
            return None
        median, slowest = stragglers.slowest(times, step_s)
        metrics.stragglers(median, slowest)
        return (slowest[0].rank, slowest[0].lag) if slowest else (-1, 0.0)
