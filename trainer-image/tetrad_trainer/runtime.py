"""The runtime library: what a training script of your own calls to get what Tetrad's trainer has
(level 2 of docs/bring-your-own.md). One pip line in the image (`pip install "tetrad[runtime]"`); the
script runs under the job's launcher as any script does.

    import tetrad_trainer.runtime as tetrad

    run = tetrad.init()             # the process group, SIGTERM kept for later, this rank's metrics endpoint
    mesh = run.mesh                 # a DeviceMesh with Tetrad's dims: pp, dp_replicate, dp_shard, cp, tp
    step = load_checkpoint(run.checkpoint_dir)  # your own checkpoints, where spec.checkpoint mounts them
    while step < steps:
        step += 1
        loss = train_step()
        run.report(step, loss=loss, tokens=tokens_per_step,
                   flops_per_token=6 * params)  # STEP, TOKENS/S, MFU, LOSS
        action = run.poll()         # collective: every rank gets the same answer
        if action.save:             # a checkpoint-now request, or SIGTERM (action.seconds_left of grace)
            save_checkpoint(run.checkpoint_dir, step)
            run.saved(step)
        if action.stop:
            run.exit_preempted()    # exit 75: the operator restarts the gang without spending maxRestarts
    run.close()

`report` beats the heartbeat the operator's stall detection reads (a job that never reports is never
judged stalled) and feeds the contract's gauges, which the operator reads into the job's status; rank 0
also prints each report as a JSON line, as the trainer does. A CUDA out-of-memory error that reaches
the launcher exits 77 with its message, whether or not the script uses this library.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tetrad.api.contract import (
    CONTRACT_VERSION,
    EXIT_CONFIG_ERROR,
    EXIT_PREEMPTED,
    REASON_CONTRACT,
)
from tetrad.api.resolved import MESH_DIMS, ResolvedConfig
from tetrad.api.termination import TerminationMessage
from tetrad.node import exits, gang
from tetrad.node.environment import NodeEnv, WorkerEnv
from tetrad_trainer import faults
from tetrad_trainer.checkpoint_request import CheckpointRequests
from tetrad_trainer.metrics import (
    RankMetrics,
    StepRecord,
    peak_memory_bytes,
    peak_tflops,
)
from tetrad_trainer.own_time import OwnTime
from tetrad_trainer.preemption import Preemption, leave_final_state
from tetrad_trainer.time_spent import TimeSpent

# The contract versions (tetrad.api.contract.CONTRACT_VERSION) this library speaks.
SPOKEN_CONTRACTS = range(1, CONTRACT_VERSION + 1)


class ContractMismatch(Exception):
    """The operator that rendered this pod speaks a contract this library does not."""


@dataclass(frozen=True)
class Action:
    """What `Run.poll` agreed on, the same on every rank."""

    save: bool  # save a checkpoint now: a checkpoint-now request, or SIGTERM reached the gang
    stop: bool  # SIGTERM reached the gang: save (when seconds_left allows), then exit_preempted()
    seconds_left: float | None  # of the grace period after SIGTERM; None: no deadline known


def check_contract(env: NodeEnv) -> None:
    """Refuse a pod rendered for a contract this library does not speak (not under Tetrad: no check)."""
    if env.contract is not None and env.contract not in SPOKEN_CONTRACTS:
        raise ContractMismatch(
            f"this pod was rendered for Tetrad's contract {env.contract}, the image's "
            f"tetrad_trainer.runtime speaks {SPOKEN_CONTRACTS.start}..{SPOKEN_CONTRACTS.stop - 1}: install "
            f"the tetrad version of the operator in the image (spec.image)")


def _device(env: WorkerEnv) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _config(env: WorkerEnv) -> ResolvedConfig | None:
    return ResolvedConfig.load(env.config) if env.config is not None and env.config.is_file() else None


class Run:
    """This rank's part of the job: see the module's docstring."""

    def __init__(self, env: WorkerEnv, device: torch.device, preemption: Preemption):
        self.env, self.device, self.preemption = env, device, preemption
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = env.local_rank
        self.checkpoint_dir = env.node.checkpoint_dir
        self.restart = env.restart
        cfg = _config(env)
        self.mfu_peak = peak_tflops(device, cfg.metrics.peak_tflops if cfg else None,
                                    cfg.gpu_type if cfg else None)
        self._said_peak = False
        port = env.metrics_port
        self.metrics = RankMetrics(port=port + self.local_rank if port is not None else None, rank=self.rank,
                                   labels={"job": cfg.job_name if cfg else "", "rank": str(self.rank)},
                                   jsonl=env.jsonl, round=env.node.round, round_cause=env.node.round_cause)
        if (figures := gang.read_figures(env)) is not None:
            self.metrics.preflight(figures)
        self.requests = CheckpointRequests(self.rank, env.checkpoint_request_file)
        # Stragglers: each rank's CPU time between polls, gathered at rank 0 every log interval.
        self.own_time = OwnTime(device, env.node.node_name, stage=_pipeline_stage(env, self.rank))
        self.fault = faults.configured(env)  # tests only
        self._gather_every = cfg.metrics.log_interval if cfg else 1
        self._polls = 0
        self._step_time = math.nan
        self._slowest: tuple[int, float] = (-1, 0.0)
        self._mesh: DeviceMesh | None = None
        self._last: tuple[int, float] | None = None  # (step, time) of the last report
        # start-up, training and checkpoint stalls: a save is the time from the last report or poll to saved()
        self.time_spent = TimeSpent()
        self._idle_since = time.perf_counter()
        self._saved: tuple[int, float] | None = None

    @property
    def mesh(self) -> DeviceMesh:
        """The job's mesh: every dim of TETRAD_MESH, outermost first, named as Tetrad's trainer names them
        (a dim of degree 1 too); the world as one dp_shard dim outside Tetrad."""
        if self._mesh is None:
            dims = self.env.node.mesh or (("dp_shard", self.world_size),)
            names, shape = tuple(d for d, _ in dims), tuple(n for _, n in dims)
            assert set(names) <= set(MESH_DIMS), names
            self._mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._mesh

    def report(self, step: int, *, loss: float | None = None, tokens: int | None = None,
               flops_per_token: float | None = None, grad_norm: float | None = None,
               lr: float | None = None) -> None:
        """Step `step` completed: the heartbeat and this rank's figures. `tokens`: the tokens the whole
        job trained in one step (global batch x sequence); `loss`: the global loss, as rank 0 shows it."""
        now = time.perf_counter()
        self.metrics.step_completed()
        self.time_spent.step_completed()
        steps = step - self._last[0] if self._last is not None and step > self._last[0] else 1
        step_time = (now - self._last[1]) / steps if self._last is not None else math.nan
        self._last = (step, now)
        self._step_time = step_time
        per_second = tokens / step_time if tokens and step_time > 0 else math.nan
        tflops = (flops_per_token or math.nan) * per_second / self.world_size / 1e12
        peak, reserved = peak_memory_bytes(self.device)
        self.metrics.log(StepRecord(
            step=step, loss=_number(loss), grad_norm=_number(grad_norm), lr=_number(lr),
            step_time_s=step_time, tokens_per_second=per_second,
            tokens_per_second_per_device=per_second / self.world_size, tflops=tflops,
            mfu=self.mfu_peak.mfu(tflops), peak_memory_bytes=peak, peak_memory_reserved_bytes=reserved,
            **self.time_spent.record(), slowest_rank=self._slowest[0], slowest_rank_lag=self._slowest[1]))
        if self.mfu_peak.said is not None and not self._said_peak:
            print(f"[tetrad] warning: {self.mfu_peak.said}", file=sys.stderr, flush=True)
            self._said_peak = True
        self._idle_since = time.perf_counter()

    def poll(self) -> Action:
        """Whether to save and whether to stop, agreed by every rank (one small all-reduce; every log
        interval also a gather of the ranks' own time at rank 0). Collective."""
        faults.slow_down(self.fault, self.rank)
        self.own_time.lap()
        self._polls += 1
        if self._polls % self._gather_every == 0:
            slowest = self.own_time.report(self._gather_every, self._step_time, self.metrics)
            self._slowest = slowest or self._slowest  # the next report names it
        token = self.requests.poll()
        stop = self.preemption.requested(checkpoint_asked=token is not None)
        if token is not None and self._last is not None:
            self.metrics.checkpoint_requested(token, self._last[0])
        self.own_time.start_lap()
        self._idle_since = time.perf_counter()
        return Action(save=stop or self.preemption.checkpoint_asked, stop=stop,
                      seconds_left=self.preemption.remaining_s)

    def saved(self, step: int) -> None:
        """The script committed its checkpoint of `step` (call it on every rank once the save is complete).
        The time since the last report or poll counts as the save's stall in the job's goodput."""
        self.time_spent.stalled(time.perf_counter() - self._idle_since)
        self._idle_since = time.perf_counter()
        self._saved = (step, time.time())
        self.metrics.checkpoint_committed(*self._saved)

    def exit_preempted(self) -> NoReturn:
        """Stop after SIGTERM: leave the last figures and checkpoint for the job's status, exit 75."""
        step, at = self._saved if self._saved is not None else (None, None)
        leave_final_state(self.rank, self.metrics.final_figures(self.time_spent), stopped=(step, at))
        self.metrics.close()
        sys.exit(EXIT_PREEMPTED)

    def close(self) -> None:
        """Training is over: leave the last figures for the job's status."""
        leave_final_state(self.rank, self.metrics.final_figures(self.time_spent))
        self.metrics.close()


def _pipeline_stage(env: WorkerEnv, rank: int) -> int:
    """This rank's pipeline stage: pp is the mesh's outermost dim (TETRAD_MESH); 0 without one."""
    degrees = dict(env.node.mesh)
    pp, world = degrees.get("pp", 1), env.world_size
    return rank // (world // pp) if pp > 1 and world % pp == 0 else 0


def _number(value: float | torch.Tensor | None) -> float:
    if value is None:
        return math.nan
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def init() -> Run:
    """Join the job: the process group (unless the script made it), SIGTERM recorded for `poll`, this
    rank's metrics endpoint. Exits 78 naming the cause when the pod speaks another contract."""
    env = WorkerEnv.read()
    preemption = Preemption(env=env)  # first: a SIGTERM during start-up is kept, not fatal
    try:
        check_contract(env.node)
    except ContractMismatch as e:
        print(f"[tetrad] {e}", file=sys.stderr, flush=True)
        exits.leave(TerminationMessage(reason=REASON_CONTRACT, message=str(e)))
        sys.exit(EXIT_CONFIG_ERROR)
    device = _device(env)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    preemption.connect()
    return Run(env, device, preemption)
