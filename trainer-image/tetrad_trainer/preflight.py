"""The preflight gate: before training, every node checks what the job needs, then the whole gang
all-reduces once within a bound, measuring each node's bus bandwidth.

- `node_checks` runs in the node's supervisor (tetrad_trainer.preemption) before torchrun starts:
  the devices (a CUDA job needs nprocPerNode visible GPUs), the CPUs resources.cpu requests (in a
  pod: this process's CPU affinity, what a static CPU manager or `taskset` leaves it), and pod 0's
  rendezvous name (PET_MASTER_ADDR) resolving within timeoutSeconds. A node that fails exits
  EXIT_PREFLIGHT (69) without starting torchrun.
- `gang_check` runs in every worker once the process group is up, before the model is built: an
  all-reduce of allReduceMiB across the whole gang, bounded by timeoutSeconds, timed on every
  rank; bus bandwidth = 2(n-1)/n x bytes / time (nccl-tests' busbw). Each node's figure is the
  slowest of its ranks'. Rank 0 prints them as one JSON line ({"preflight": ...}), and every rank
  exports them as gauges (rank 0 every node's), which the operator reads into status.preflight.

A failure is written as the node's termination message (tetrad.api.preflight), which the operator
reads from the pod's status to name the node in status.failedNodes and keep the next gang off it.
Workers leave theirs in the supervisor's exit directory; the supervisor writes the message.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tetrad.api.contract import (
    ENV_CONFIG,
    ENV_EXIT_DIR,
    ENV_NODE_NAME,
    ENV_TERMINATION_LOG,
    EXIT_PREFLIGHT,
    TERMINATION_LOG,
)
from tetrad.api.preflight import NodeFailure, parse_termination_message, slow_nodes, termination_message
from tetrad.api.resolved import ResolvedConfig
from tetrad_trainer.config import ConfigError, load_config
from tetrad_trainer.rendezvous import resolves

WARMUP, ITERATIONS = 1, 3


class PreflightFailed(Exception):
    """A node failed the gate; the trainer exits EXIT_PREFLIGHT."""

    def __init__(self, failures: list[NodeFailure]):
        self.failures = failures
        super().__init__("; ".join(describe(f) for f in failures))


def describe(f: NodeFailure) -> str:
    where = "the gang" if f.node is None else f"node {f.node} (node rank {f.node_rank})"
    return f"preflight failed on {where}: {f.reason}"


def node_name() -> str:
    """The Kubernetes node (the downward API's spec.nodeName), else this host's name."""
    return os.environ.get(ENV_NODE_NAME) or socket.gethostname()


def node_rank() -> int:
    value = os.environ.get("GROUP_RANK") or os.environ.get("PET_NODE_RANK") or "0"
    return int(value) if value.isdigit() else 0


# ---------------------------------------------------------------------------------- the node's own checks


def available_cpus() -> int:
    """CPUs this process may run on (its affinity; no cgroup quota is read)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def node_problems(cfg: ResolvedConfig) -> list[str]:
    """What this node lacks for the job: devices, CPUs, pod 0's name."""
    problems = []
    if cfg.use_gpu and (have := torch.cuda.device_count()) < cfg.nproc_per_node:
        problems.append(f"devices: {have} CUDA devices visible, the job runs nprocPerNode={cfg.nproc_per_node} "
                        f"processes, one per GPU")
    in_pod = bool(os.environ.get(ENV_NODE_NAME))  # `tetrad run`'s nodes share one machine: no CPU request to check
    if in_pod and cfg.cpus is not None and (have := available_cpus()) < math.ceil(cfg.cpus):
        problems.append(f"cpu: resources.cpu requests {cfg.cpus:g} CPUs, this node's processes may run on {have} "
                        f"(their CPU affinity)")
    master = os.environ.get("PET_MASTER_ADDR")
    if master and (error := resolves(master, cfg.preflight.timeout_seconds)) is not None:
        problems.append(f"rendezvous: pod 0's name {master} did not resolve within "
                        f"{cfg.preflight.timeout_seconds} s ({error})")
    return problems


def node_checks(cfg: ResolvedConfig) -> list[NodeFailure]:
    """The supervisor's checks before torchrun; the failures, each naming this node."""
    if not cfg.preflight.enabled:
        return []
    return [NodeFailure(node_name(), node_rank(), problem) for problem in node_problems(cfg)]


# ---------------------------------------------------------------------------------- the gang's all-reduce


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
    nodes: list[NodeFigures]  # every node's (as gathered on every rank), by node rank
    slow_nodes: list[str]

    def exported(self) -> list[NodeFigures]:
        """The figures this rank exports: rank 0 every node's, the others their own node's."""
        return self.nodes if dist.get_rank() == 0 else [n for n in self.nodes if n.node_rank == node_rank()]

    def json_line(self) -> str:
        bandwidth = [n.bus_bandwidth_bytes_per_second for n in self.nodes]
        return json.dumps({"preflight": {
            "passed": True, "world_size": self.world_size, "bytes": self.bytes,
            "bus_bandwidth_bytes_per_second": statistics.median(bandwidth) if bandwidth else None,
            "nodes": [asdict(n) for n in self.nodes], "slow_nodes": self.slow_nodes}})


def bus_bandwidth(nbytes: int, world: int, seconds: float) -> float:
    """nccl-tests' all-reduce bus bandwidth: the algorithm bandwidth times 2(n-1)/n."""
    return 2 * (world - 1) / world * nbytes / seconds if seconds > 0 else 0.0


def timed_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, timeout: timedelta) -> float:
    """Mean seconds of one all-reduce after a warm-up; raises when one exceeds `timeout`."""
    def once() -> None:
        dist.all_reduce(tensor, group=group, async_op=True).wait(timeout)  # type: ignore[union-attr]
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    for _ in range(WARMUP):
        once()
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        once()
    return (time.perf_counter() - start) / ITERATIONS


def gang_check(cfg: ResolvedConfig, device: torch.device) -> GangReport | None:
    """The gang's all-reduce on every rank (collective); None when the gate is off.
    Raises PreflightFailed when it does not complete within the bound."""
    if not cfg.preflight.enabled:
        return None
    world = dist.get_world_size()
    timeout = timedelta(seconds=cfg.preflight.timeout_seconds)
    gather = dist.new_group(backend="gloo", timeout=timeout)  # CPU-side: the figures, and who failed
    nbytes = cfg.preflight.all_reduce_mi_b * 2**20
    seconds, error = 0.0, None
    start = time.perf_counter()
    if world > 1:
        group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        try:
            seconds = timed_all_reduce(tensor, group, timeout)
        except Exception as e:  # noqa: BLE001 - gloo and nccl raise assorted types on a timeout
            error = f"the all-reduce of {cfg.preflight.all_reduce_mi_b} MiB across the gang's {world} processes did " \
                    f"not complete within spec.preflight.timeoutSeconds={cfg.preflight.timeout_seconds}: " \
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        finally:
            dist.destroy_process_group(group)
    if error is not None:
        raise PreflightFailed([NodeFailure(None, None, error)])
    mine = (node_rank(), node_name(), bus_bandwidth(nbytes, world, seconds), time.perf_counter() - start)
    everyone: list[tuple[int, str, float, float] | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=gather)
    dist.destroy_process_group(gather)
    by_node: dict[int, NodeFigures] = {}
    for entry in everyone:
        assert entry is not None
        rank, name, bw, s = entry
        seen = by_node.get(rank)
        if seen is None or bw < seen.bus_bandwidth_bytes_per_second:
            by_node[rank] = NodeFigures(name, rank, bw, max(s, seen.seconds if seen else 0.0))
    nodes = [by_node[r] for r in sorted(by_node)]
    slow = slow_nodes({n.node: n.bus_bandwidth_bytes_per_second for n in nodes}, cfg.preflight.slow_node_fraction)
    report = GangReport(world, nbytes, nodes, slow)
    if dist.get_rank() == 0:
        print(report.json_line(), flush=True)
    return report


# ---------------------------------------------------------------------------------- the termination message


def report_failures(failures: list[NodeFailure]) -> None:
    """A worker's failures, for its supervisor to write as the node's termination message."""
    directory = os.environ.get(ENV_EXIT_DIR)
    if directory:
        rank = os.environ.get("RANK", str(os.getpid()))
        path = Path(directory) / f"preflight-rank-{rank}.json"
        tmp = path.with_name("." + path.name)
        tmp.write_text(termination_message(failures))
        tmp.replace(path)


def reported_failures(exit_dir: str | Path) -> list[NodeFailure]:
    """What the node's workers reported, each failure once."""
    seen: dict[NodeFailure, None] = {}
    for path in sorted(Path(exit_dir).glob("preflight-rank-*.json")):
        seen.update(dict.fromkeys(parse_termination_message(path.read_text())))
    return list(seen)


def write_termination_message(failures: list[NodeFailure]) -> None:
    """The node's termination message, where Kubernetes reads it ($TETRAD_TERMINATION_LOG, else
    /dev/termination-log when the kubelet provides it); elsewhere nothing is written."""
    path = Path(os.environ.get(ENV_TERMINATION_LOG) or TERMINATION_LOG)
    if not failures or not (os.environ.get(ENV_TERMINATION_LOG) or path.exists()):
        return
    try:
        path.write_text(termination_message(failures))
    except OSError as e:
        print(f"[tetrad] could not write the termination message to {path}: {e}", file=sys.stderr, flush=True)


def before_torchrun() -> int | None:
    """The supervisor's node checks: EXIT_PREFLIGHT after naming the failures (stderr and the
    termination message), None to go on. A config that cannot be read is left to the trainer (78)."""
    path = os.environ.get(ENV_CONFIG)
    try:
        cfg = load_config(path) if path else None
    except ConfigError:
        cfg = None
    failures = node_checks(cfg) if cfg is not None else []
    if not failures:
        return None
    for f in failures:
        print(f"[tetrad] {describe(f)}", file=sys.stderr, flush=True)
    write_termination_message(failures)
    return EXIT_PREFLIGHT
