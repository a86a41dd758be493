"""Throughput, MFU and memory: a Prometheus endpoint on every rank, JSON lines from rank 0.

The metric names are the contract's (tetrad.api.contract); the operator scrapes rank 0 for the
ones in contract.SCRAPED. docs/trainer.md lists every metric.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from tetrad.api import contract as c
from tetrad.api.accelerators import find_accelerator
from tetrad.api.contract import (
    LABEL_REQUEST_TOKEN,
    METRIC_CHECKPOINT_STEP,
    METRIC_CHECKPOINT_TIME,
    METRIC_INFO,
    METRIC_LAST_STEP_TIME,
    METRIC_PREFLIGHT_BUS_BANDWIDTH,
    METRIC_PREFLIGHT_SECONDS,
    METRIC_REQUEST_STEP,
    METRIC_REQUEST_TIME,
    METRIC_RESUMED_FROM,
    PREFLIGHT_GAUGES,
    TRAINER_GAUGES,
)
from tetrad.api.stragglers import Straggler
from tetrad.node.gang import NodeFigures
from tetrad_trainer.time_spent import TimeSpent


def gpu_peak_tflops(name: str) -> float | None:
    """The datasheet peak for a GPU name as CUDA or the job reports it, e.g. 'NVIDIA H100 80GB HBM3'."""
    found = find_accelerator(name)
    return found[1].peak_tflops if found else None


def measure_cpu_tflops(seconds: float = 0.2, n: int = 512) -> float:
    """Achieved fp32 matmul TFLOPS of this process on the CPU, with its current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / elapsed / 1e12


def peak_tflops(device: torch.device, configured: float | None, gpu_type: str | None) -> MfuPeak:
    """Peak TFLOPS of one device for MFU, and where the figure comes from."""
    if configured:
        return MfuPeak(configured, "metrics.peakTflops")
    if device.type == "cuda":
        name = gpu_type or torch.cuda.get_device_name(device)
        if (peak := gpu_peak_tflops(name)) is not None:
            return MfuPeak(peak, f"datasheet bf16 peak of {name}")
        return MfuPeak(measure_gpu_tflops(device), f"measured bf16 matmul on {name} (not in the peak table)")
    return MfuPeak(measure_cpu_tflops(), "measured fp32 matmul on the CPU")


@dataclass
class MfuPeak:
    """The peak MFU is measured against, and where it comes from. MFU never exceeds 1: a step that achieves
    more than a peak this process measured (a CPU measured while its neighbours were busy importing) raises
    the peak to what was achieved; one above a given peak (metrics.peakTflops, a datasheet) is reported as 1.
    Either is said once (`said`)."""

    tflops: float
    source: str
    said: str | None = None

    def mfu(self, achieved_tflops: float) -> float:
        if not math.isfinite(achieved_tflops) or achieved_tflops <= self.tflops:
            return achieved_tflops / self.tflops
        if self.said is None:
            measured = self.source.startswith("measured")
            self.said = (f"a step achieved {achieved_tflops:.3g} TFLOPS, above the MFU peak of "
                         f"{self.tflops:.3g} ({self.source})"
                         + ("; the peak is raised to what steps achieve" if measured else
                            "; MFU is reported as at most 100%") +
                         ": set spec.metrics.peakTflops to this device's peak")
        if self.source.startswith("measured"):
            self.tflops = achieved_tflops
        return 1.0


def measure_gpu_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ a
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def peak_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(peak allocated, peak reserved) device memory; on the CPU both are the peak RSS since the last reset
    (VmHWM, which tetrad.node.gang resets after the preflight gate's buffer), else since the start."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    try:
        status = Path("/proc/self/status").read_text()
        rss = int(status.split("VmHWM:", 1)[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):  # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return rss, rss


@dataclass
class StepRecord:
    """One logged step; the JSON line rank 0 writes has exactly these keys."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_second: float
    tokens_per_second_per_device: float
    tflops: float  # achieved model TFLOPS per device
    mfu: float
    peak_memory_bytes: int
    peak_memory_reserved_bytes: int
    startup_s: float = 0.0  # process start to the end of this run's first step
    train_s: float = 0.0  # the end of the first step to this record, checkpoint stalls excluded
    checkpoint_stall_s: float = 0.0  # blocked on checkpoint saves since the end of the first step
    slowest_rank: int = -1  # rank 0: the rank with the largest own time (tetrad.api.stragglers); -1: none
    slowest_rank_lag: float = 0.0  # its lag


ROUND_CAUSE_MAX = 200
# StepRecord field -> the gauge that carries it.
GAUGE_OF_FIELD = {
    "step": c.METRIC_STEP,
    "loss": c.METRIC_LOSS,
    "grad_norm": c.METRIC_GRAD_NORM,
    "lr": c.METRIC_LEARNING_RATE,
    "step_time_s": c.METRIC_STEP_TIME,
    "tokens_per_second": c.METRIC_TOKENS_PER_SECOND,
    "tokens_per_second_per_device": c.METRIC_TOKENS_PER_SECOND_PER_DEVICE,
    "tflops": c.METRIC_TFLOPS,
    "mfu": c.METRIC_MFU,
    "peak_memory_bytes": c.METRIC_PEAK_MEMORY,
    "peak_memory_reserved_bytes": c.METRIC_PEAK_MEMORY_RESERVED,
    "startup_s": c.METRIC_STARTUP,
    "train_s": c.METRIC_TRAIN_SECONDS,
    "checkpoint_stall_s": c.METRIC_CHECKPOINT_STALL,
    "slowest_rank": c.METRIC_SLOWEST_RANK,
    "slowest_rank_lag": c.METRIC_SLOWEST_RANK_LAG,
}


class RankMetrics:
    """Prometheus gauges of one rank, plus rank 0's JSON lines."""

    def __init__(self, *, port: int | None, rank: int, labels: dict[str, str], jsonl: Path | None,
                 round: int = 0, round_cause: str | None = None):
        self.rank = rank
        self.registry = CollectorRegistry()
        # The round of restarts in place, with the failure that began it (cut: a termination message's
        # figures must stay short).
        Gauge(c.METRIC_ROUND, c.ROUND_HELP, [c.LABEL_ROUND_CAUSE], registry=self.registry).labels(
            (round_cause or "")[:ROUND_CAUSE_MAX]).set(round)
        self.gauges = {field: Gauge(name, TRAINER_GAUGES[name], registry=self.registry)
                       for field, name in GAUGE_OF_FIELD.items()}
        self.heartbeat = Gauge(METRIC_LAST_STEP_TIME, TRAINER_GAUGES[METRIC_LAST_STEP_TIME],
                               registry=self.registry)
        # NaN until set: the operator leaves a NaN out, so status.checkpoint keeps the last incarnation's
        # figures
        self.checkpoint_step, self.checkpoint_time, self.resumed_from = (
            Gauge(name, TRAINER_GAUGES[name], registry=self.registry)
            for name in (METRIC_CHECKPOINT_STEP, METRIC_CHECKPOINT_TIME, METRIC_RESUMED_FROM))
        for gauge in (self.checkpoint_step, self.checkpoint_time, self.resumed_from):
            gauge.set(math.nan)
        # checkpoint-now: exported, labelled with the token, once the checkpoint that served it committed
        self.request_step, self.request_time = (
            Gauge(name, TRAINER_GAUGES[name], [LABEL_REQUEST_TOKEN], registry=self.registry)
            for name in (METRIC_REQUEST_STEP, METRIC_REQUEST_TIME))
        self.request: tuple[str, int] | None = None  # (token, step) whose commit is awaited
        self.committed: tuple[int, float] | None = None  # (step, Unix time) of the last commit
        info = Gauge(METRIC_INFO, "Constant 1, labelled with the job and this rank's place.", list(labels),
                     registry=self.registry)
        (info.labels(**labels) if labels else info).set(1)
        self._stragglers: dict[str, Gauge] | None = None
        self._server = None
        self.port = self._serve(port) if port is not None else None
        self.jsonl: IO[str] | None = jsonl.open("a", buffering=1) if jsonl is not None and rank == 0 else None

    def _serve(self, port: int) -> int | None:
        try:
            self._server, _ = start_http_server(port, registry=self.registry)
            return port
        except OSError as e:  # metrics are for watching; a busy port must not stop training
            print(f"[tetrad rank {self.rank}] metrics endpoint not started on port {port}: {e}",
                  file=sys.stderr, flush=True)
            return None

    def step_completed(self) -> None:
        """The heartbeat, on every step (logged or not): the operator restarts a gang whose rank 0 stops
        beating."""
        self.heartbeat.set(time.time())

    def checkpoint_committed(self, step: int, at: float) -> None:
        """A checkpoint of `step` was committed at Unix time `at` (the Checkpointer's on_commit)."""
        self.checkpoint_step.set(step)
        self.checkpoint_time.set(at)
        self.committed = (step, at)
        self._export_request()

    def checkpoint_requested(self, token: str, step: int) -> None:
        """The checkpoint-now request `token` is served by the save of `step` (exported once committed);
        call it before that save starts."""
        self.request = (token, step)
        self._export_request()

    def _export_request(self) -> None:
        request, committed = self.request, self.committed
        if request is None or committed is None or committed[0] < request[1]:
            return
        self.request = None
        for gauge, value in ((self.request_step, committed[0]), (self.request_time, committed[1])):
            gauge.clear()
            gauge.labels(request[0]).set(value)

    def preflight(self, nodes: Sequence[NodeFigures]) -> None:
        """The preflight gate's figures of `nodes`, labelled node and node_rank."""
        gauges = {name: Gauge(name, PREFLIGHT_GAUGES[name], ["node", "node_rank"], registry=self.registry)
                  for name in PREFLIGHT_GAUGES}
        for n in nodes:
            labels = {"node": n.node, "node_rank": str(n.node_rank)}
            gauges[METRIC_PREFLIGHT_BUS_BANDWIDTH].labels(**labels).set(n.bus_bandwidth_bytes_per_second)
            gauges[METRIC_PREFLIGHT_SECONDS].labels(**labels).set(n.seconds)

    def stragglers(self, median_s: float, slowest: Sequence[Straggler]) -> None:
        """Rank 0: the slowest ranks (tetrad.api.stragglers.slowest), replacing the last ones."""
        if self._stragglers is None:
            self._stragglers = {name: Gauge(name, c.STRAGGLER_GAUGES[name],
                                            ["rank", "node"] if name != c.METRIC_RANK_OWN_MEDIAN else [],
                                            registry=self.registry)
                                for name in c.STRAGGLER_GAUGES}
        lag, own = self._stragglers[c.METRIC_RANK_LAG], self._stragglers[c.METRIC_RANK_OWN]
        lag.clear()
        own.clear()
        for s in slowest:
            lag.labels(str(s.rank), s.node).set(s.lag)
            own.labels(str(s.rank), s.node).set(s.own_s)
        self._stragglers[c.METRIC_RANK_OWN_MEDIAN].set(median_s)

    def final_figures(self, time_spent: TimeSpent) -> str:
        """The gauges the operator scrapes into the job's status, with the time account as of now, as
        exposition text without help lines (short enough for a termination message)."""
        for key, value in time_spent.record().items():
            self.gauges[key].set(value)
        text = generate_latest(self.registry.restricted_registry(
            [*c.SCRAPED, *c.SCRAPED_CHECKPOINT, *c.SCRAPED_TRAINER_TIME])).decode()
        return "".join(line + "\n" for line in text.splitlines() if not line.startswith("# HELP"))

    def resumed(self, step: int) -> None:
        """This process resumed from the checkpoint of `step`; 0: it started fresh."""
        self.resumed_from.set(step)

    def log(self, record: StepRecord) -> None:
        for key, value in asdict(record).items():
            self.gauges[key].set(value)
        if self.rank == 0:  # a figure not known (NaN: a script that reports no loss, say) is null
            line = json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v
                               for k, v in asdict(record).items()})
            print(line, flush=True)
            if self.jsonl is not None:
                self.jsonl.write(line + "\n")

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.jsonl is not None:
            self.jsonl.close()
