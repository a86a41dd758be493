"""The preflight gate's gang check: before the entry point runs, the whole gang all-reduces once within
a bound, and each node's bus bandwidth is measured.

Every worker (tetrad.node.worker) runs it in a process group of its own, on the torchrun store under a
prefix of its own: the entry point (Tetrad's trainer or a script) then creates its process groups as if
nothing had happened. The all-reduce of allReduceMiB is timed on every rank; bus bandwidth = 2(n-1)/n x
bytes / time (nccl-tests' busbw), and a node's figure is the slowest of its ranks'. Rank 0 prints every
node's as one JSON line ({"preflight": ...}) and leaves them in the exit directory (FIGURES_FILE), where
the trainer or the runtime library exports them as gauges, which the operator reads into status.preflight.
A gang that does not complete it in time fails the gate: PreflightFailed, exit EXIT_PREFLIGHT (69).

torch is imported inside the functions: the launcher's supervisor runs without it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from tetrad.api.slow_nodes import slow_nodes
from tetrad.api.termination import NodeFailure
from tetrad.node.environment import PreflightSettings, WorkerEnv

WARMUP, ITERATIONS = 1, 3
STORE_PREFIX = "tetrad/preflight"
FIGURES_FILE = "preflight-rank-{rank}.json"  # in the exit directory: the figures this rank exports


class PreflightFailed(Exception):
    """A node failed the gate; the worker exits EXIT_PREFLIGHT."""

    def __init__(self, failures: list[NodeFailure]):
        self.failures = failures
        super().__init__("; ".join(f.reason for f in failures))


@dataclass(frozen=True)
class NodeFigures:
    node: str
    node_rank: int
    bus_bandwidth_bytes_per_second: float
    seconds: float


@dataclass(frozen=True)
class GangReport:
    world_size: int
    bytes: int
    nodes: list[NodeFigures]  # what this rank exports: rank 0 every node's, the others their own node's
    slow_nodes: list[str]

    def json_line(self) -> str:
        bandwidth = [n.bus_bandwidth_bytes_per_second for n in self.nodes]
        return json.dumps({"preflight": {
            "passed": True, "world_size": self.world_size, "bytes": self.bytes,
            "bus_bandwidth_bytes_per_second": statistics.median(bandwidth) if bandwidth else None,
            "nodes": [asdict(n) for n in self.nodes], "slow_nodes": self.slow_nodes}})


def bus_bandwidth(nbytes: int, world: int, seconds: float) -> float:
    """nccl-tests' all-reduce bus bandwidth: the algorithm bandwidth times 2(n-1)/n."""
    return 2 * (world - 1) / world * nbytes / seconds if seconds > 0 else 0.0


def timed_all_reduce(tensor: Any, group: Any, timeout: timedelta) -> float:
    """Mean seconds of one all-reduce after a warm-up; raises when one exceeds `timeout`."""
    import torch

    def once() -> None:
        group.allreduce([tensor]).wait(timeout)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    for _ in range(WARMUP):
        once()
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        once()
    return (time.perf_counter() - start) / ITERATIONS


def _process_group(store: Any, rank: int, world: int, cuda: bool, timeout: timedelta) -> Any:
    """A process group of the preflight's own, outside torch.distributed's world (none exists yet)."""
    import torch.distributed as dist

    if cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def forget_peak_memory(cuda: bool, local_rank: int) -> None:
    """The gate's buffer is not the job's memory: reset the peak the trainer reports (the CUDA allocator's,
    or the process's peak RSS, VmHWM, through /proc/self/clear_refs)."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats(local_rank)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def gang_check(settings: PreflightSettings, worker: WorkerEnv) -> GangReport:
    """The gang's all-reduce on every worker (collective over the whole gang). Raises PreflightFailed
    when it does not complete within the bound."""
    import torch
    import torch.distributed as dist

    env = worker.node
    rank, world, local_rank, local_world = (worker.rank, worker.world_size, worker.local_rank,
                                            worker.local_world_size)
    timeout = timedelta(seconds=settings.timeout_seconds)
    cuda = env.gpus > 0 and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    nbytes = settings.all_reduce_mib * 2**20
    start = time.perf_counter()
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))  # type: ignore[attr-defined]
    store = dist.PrefixStore(f"{STORE_PREFIX}/{env.restart}", store)  # type: ignore[attr-defined]
    seconds = 0.0
    if world > 1:
        group = _process_group(dist.PrefixStore("group", store), rank, world, cuda, timeout)  # type: ignore[attr-defined]
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=f"cuda:{local_rank}" if cuda else "cpu")
        try:
            seconds = timed_all_reduce(tensor, group, timeout)
        except Exception as e:  # noqa: BLE001 - gloo and nccl raise assorted types on a timeout
            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PreflightFailed([NodeFailure(None, None, (
                f"the all-reduce of {settings.all_reduce_mib} MiB across the gang's {world} processes did"
                f" not complete within spec.preflight.timeoutSeconds={settings.timeout_seconds:g}:"
                f" {said}"))]) from e
        finally:
            del tensor
            if hasattr(group, "shutdown"):
                group.shutdown()
            forget_peak_memory(cuda, local_rank)
    mine = NodeFigures(env.node_name, env.node_rank, bus_bandwidth(nbytes, world, seconds),
                       time.perf_counter() - start)
    store.set(f"rank/{rank}", json.dumps(asdict(mine)))
    node_first = rank - local_rank  # torchrun numbers a node's ranks consecutively
    ranks = range(world) if rank == 0 else range(node_first, node_first + local_world)
    keys = [f"rank/{r}" for r in ranks]
    store.wait(keys, timeout)
    nodes = _slowest_per_node([NodeFigures(**json.loads(store.get(k))) for k in keys])
    slow = slow_nodes({n.node: n.bus_bandwidth_bytes_per_second for n in nodes}, settings.slow_node_fraction)
    report = GangReport(world, nbytes,
                        nodes if rank == 0 else [n for n in nodes if n.node_rank == env.node_rank], slow)
    if rank == 0:
        print(report.json_line(), flush=True)
    return report


def _slowest_per_node(figures: list[NodeFigures]) -> list[NodeFigures]:
    by_node: dict[int, NodeFigures] = {}
    for f in figures:
        seen = by_node.get(f.node_rank)
        if seen is None or f.bus_bandwidth_bytes_per_second < seen.bus_bandwidth_bytes_per_second:
            by_node[f.node_rank] = NodeFigures(f.node, f.node_rank, f.bus_bandwidth_bytes_per_second,
                                               max(f.seconds, seen.seconds if seen else 0.0))
    return [by_node[r] for r in sorted(by_node)]


def leave_figures(report: GangReport, worker: WorkerEnv) -> None:
    """The figures this rank exports, for the entry point's metrics (nothing without an exit directory)."""
    if worker.exit_dir is None:
        return
    path = worker.exit_dir / FIGURES_FILE.format(rank=worker.rank)
    tmp = path.with_name("." + path.name)
    tmp.write_text(json.dumps([asdict(n) for n in report.nodes]))
    tmp.replace(path)


def read_figures(worker: WorkerEnv) -> list[NodeFigures] | None:
    """What `leave_figures` left for this rank; None when the gate did not run."""
    exit_dir = worker.exit_dir
    path = exit_dir / FIGURES_FILE.format(rank=worker.rank) if exit_dir is not None else None
    if path is None or not path.exists():
        return None
    return [NodeFigures(**n) for n in json.loads(path.read_text())]
