"""The training loop. Run one process per device under torchrun:

    torchrun -m tetrad_trainer.train --config /etc/tetrad/config.json [--steps N] [--jsonl PATH] [--init-from HF_DIR]

Rank 0 writes one JSON line per logged step to stdout (and to --jsonl / $TETRAD_JSONL); every
rank serves Prometheus metrics on $TETRAD_METRICS_PORT + LOCAL_RANK. With checkpointing on, the
run resumes from the latest good checkpoint and saves every checkpoint.interval steps and at the
end. Exit codes: 78 (EXIT_CONFIG_ERROR) for a config the trainer cannot run, which the operator
never retries; 75 (EXIT_PREEMPTED) after SIGTERM at any moment: during start-up (nothing new to
save), or after the step in progress, with a new checkpoint, or without one when the last save's
duration says it cannot finish in the grace period left (the next run resumes from the last
committed checkpoint). The log says which. 79 (EXIT_COLLECTIVE_TIMEOUT) when a collective waited
runPolicy.collectiveTimeoutSeconds for a peer: the rank logs the collective and the peers that did
not answer first (tetrad_trainer.collective). A run that resumes nothing starts from the weights of
the Hugging Face directory of spec.model.hfDir (or training.initFrom, or --init-from) instead of
the seed's (tetrad_trainer.export); every rank checks its config.json against the model before any
collective, and rank 0 keeps its config and tokenizer files beside the checkpoints for the export.
"""  # noqa: E501

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tetrad.api.contract import (
    ENV_CONFIG,
    ENV_JSONL,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    REASON_CONFIG,
    REASON_OUT_OF_MEMORY,
)
from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import Precision
from tetrad.api.termination import TerminationMessage
from tetrad.node import collective, exits, gang
from tetrad.node.environment import WorkerEnv
from tetrad.node.host import slow_bf16_warning
from tetrad.node.process import die_with_parent
from tetrad_trainer import faults
from tetrad_trainer.checkpoint import Checkpointer, CheckpointError, CheckpointMismatch, NoGoodCheckpoint
from tetrad_trainer.checkpoint.store import writable_problem
from tetrad_trainer.checkpoint_request import CheckpointRequests
from tetrad_trainer.config import ConfigError, load_config
from tetrad_trainer.cp import shard_sequence
from tetrad_trainer.data import BatchLoader, TokenSource, build_source
from tetrad_trainer.export import ConversionError, check_hf_dir, init_from_hf, keep_source
from tetrad_trainer.mesh import build_mesh, init_distributed
from tetrad_trainer.metrics import (
    RankMetrics,
    StepRecord,
    peak_memory_bytes,
    peak_tflops,
)
from tetrad_trainer.models.loader import checked_definition, definition_of
from tetrad_trainer.oom import DeviceOutOfMemory, inject_oom_for_tests, out_of_memory_message
from tetrad_trainer.optim import build_optimizer, clip_and_step, lr_at, set_lr
from tetrad_trainer.own_time import OwnTime
from tetrad_trainer.parallelize import full_parameters, parallelize
from tetrad_trainer.preemption import Preemption, leave_final_state
from tetrad_trainer.time_spent import TimeSpent

# A save is attempted after SIGTERM only if the last one, scaled by this, fits in the time left.
SAVE_TIME_MARGIN = 1.25
SAVE_TIME_SLACK_S = 1.0


def log(msg: str) -> None:
    print(f"[tetrad rank {WorkerEnv.read().rank}] {msg}", file=sys.stderr, flush=True)


class Preempted(Exception):
    """SIGTERM reached a rank: every rank stopped at the same point; the message says what was saved."""


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    def __init__(self, cfg: ResolvedConfig, device: torch.device, jsonl: Path | None,
                 preemption: Preemption | None = None, source: TokenSource | None = None,
                 env: WorkerEnv | None = None):
        self.cfg, self.device = cfg, device
        self.env = env = env or WorkerEnv.read()
        self.preemption = preemption or Preemption(env=env)
        self.preemption.connect()
        self.mesh = build_mesh(cfg.layout, device)
        self.model = parallelize(cfg, self.mesh, device)
        definition = definition_of(cfg.model)
        self.flops_per_token = definition.flops_per_token(cfg.model)  # for MFU
        self.optimizer = build_optimizer(self.model.parameters(), cfg.training)
        dp_rank = self.mesh.dp.get_local_rank()
        self.loader = BatchLoader(source if source is not None else build_source(cfg),
                                  cfg.training.global_batch, dp_rank=dp_rank, dp_size=cfg.layout.dp)
        self.checkpointer = Checkpointer(
            cfg, model_parts=self.model.parts, optimizers=[self.optimizer],
            data_loader=self.loader, dp_rank=dp_rank, logger=log,
            on_commit=lambda step, at: self.metrics.checkpoint_committed(step, at), restart=env.restart)
        self.cp_rank = self.mesh.local_rank("cp")
        self.own_time = OwnTime(device, env.node.node_name, stage=self.mesh.local_rank("pp"))
        self.pp_group = self.mesh["pp"].get_group() if cfg.layout.pp > 1 else None
        self.step = 0
        self.fault = faults.configured(env)  # tests only
        self.time_spent = TimeSpent()  # start-up, training and checkpoint stalls, for the job's goodput
        self.last_log, self.steps_since_log = time.perf_counter(), 0

        rank = dist.get_rank()
        base_port = env.metrics_port if env.metrics_port is not None else cfg.metrics.port
        labels = {"job": cfg.job_name, "rank": str(rank), "mesh": cfg.layout.label()}
        self.metrics = RankMetrics(port=base_port + env.local_rank, rank=rank, jsonl=jsonl, labels=labels,
                                   round=env.node.round, round_cause=env.node.round_cause)
        self.checkpoint_requests = CheckpointRequests(rank, env.checkpoint_request_file)
        self.mfu_peak = peak_tflops(device, cfg.metrics.peak_tflops, cfg.gpu_type)
        self.said_peak = False
        if rank == 0:
            m = cfg.model
            log(f"job {cfg.job_name}: mesh {cfg.layout.label()} on {dist.get_world_size()} {device.type}"
                f" processes, model {m.name} ({definition.num_params(m) / 1e6:.1f}M params),"
                f" {cfg.training.steps} steps;"
                f" MFU peak {self.mfu_peak.tflops:.3g} TFLOPS ({self.mfu_peak.source})")
            if (device.type == "cpu" and cfg.training.precision == Precision.BF16
                    and (slow := slow_bf16_warning())):
                log(f"warning: {slow}")

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.model.loss_parallel:
                stack.enter_context(loss_parallel())
            if self.model.autocast:
                stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
            yield

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation over micro batches; returns this rank's scaled loss sum
        (tetrad_trainer.loss)."""
        (model,) = self.model.parts
        n = inputs.shape[0] // self.cfg.training.micro_batch
        total = torch.zeros((), device=self.device)
        for x, y in zip(inputs.chunk(n), labels.chunk(n), strict=True):
            loss = self.model.loss(model(x), y)
            loss.backward()
            total += plain(loss.detach())
        return total

    def pipeline_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One pipeline schedule; returns the scaled loss sum on the last stage, 0 elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.model.has_first_stage else ()
        kwargs = {"target": labels, "losses": losses} if self.model.has_last_stage else {}
        self.model.schedule.step(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([plain(x.detach()) for x in losses]).sum()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        with self.own_time.data():
            inputs, labels = self.loader.next_batch()
        with self.own_time.compute():
            faults.slow_down(self.fault, dist.get_rank())
            return self.compute_step(inputs, labels)

    def compute_step(self, inputs: torch.Tensor,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        cp = self.cfg.layout.cp
        inputs = shard_sequence(inputs, 1, cp, self.cp_rank).to(self.device)
        labels = shard_sequence(labels, 1, cp, self.cp_rank).to(self.device)

        lr = lr_at(self.step, self.cfg.training)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad()
        self.model.loss.set_scale(labels, self.mesh.dp_cp.get_group(), self.mesh.dp_cp.size())
        with self.step_context():
            if self.model.schedule is not None:
                loss = self.pipeline_forward_backward(inputs, labels)
            else:
                loss = self.forward_backward(inputs, labels)
        self.model.reduce_tied_grads()  # tied parameters split over pipeline stages
        grad_norm = clip_and_step(self.optimizer, self.cfg.training.grad_clip, self.pp_group,
                                  self.model.uncounted())
        self.model.after_optimizer_step()
        return loss, grad_norm, lr

    def global_loss(self, loss: torch.Tensor) -> float:
        """Mean over the global batch's valid tokens: each last-stage rank holds its loss sum times
        dp x cp / (global valid tokens); sum across pp and dp x cp, divide by dp x cp."""
        loss = loss.detach().float().reshape(1).clone()
        if self.pp_group is not None:
            dist.all_reduce(loss, group=self.pp_group)
        dist.all_reduce(loss, group=self.mesh.dp_cp.get_group())
        return loss.item() / self.mesh.dp_cp.size()

    def train(self) -> None:
        self.stop_if_signalled_at_start_up()
        hf_dir = self.cfg.model.hf_dir
        if resumed := self.checkpointer.resume():
            self.step = resumed.step
        elif hf_dir is not None:  # a resumed run keeps its checkpoint's weights
            init_from_hf(self.model.parts, hf_dir, self.cfg.model)
            log_rank0(f"initial weights from the Hugging Face model {hf_dir}")
        if hf_dir is not None and self.cfg.checkpoint.enabled and dist.get_rank() == 0:
            # For the export, wherever it runs; after resume, which refuses a directory of another job's.
            keep_source(hf_dir, self.cfg.checkpoint.path)
        self.metrics.resumed(self.step)
        self.stop_if_signalled_at_start_up()
        self.last_log, self.steps_since_log = time.perf_counter(), 0
        while self.step < self.cfg.training.steps:
            self.run_step()

    def stop_if_signalled_at_start_up(self) -> None:
        """Before the first step there is nothing new to save: stop at once."""
        if self.preemption.requested():
            raise Preempted(f"stopped during start-up on SIGTERM, before the first step: "
                            f"nothing new to save; {self.resume_note()}")

    def committed_step(self) -> int | None:
        """The step the next run resumes from; None: it starts from step 0."""
        ckpt = self.checkpointer
        if not ckpt.settings.enabled:
            return None
        return ckpt.last_committed_step if ckpt.last_committed_step is not None else ckpt.dir.latest()[0]

    def resume_note(self) -> str:
        step = self.committed_step()
        if step is None:
            return "no checkpoint: the next run starts from step 0"
        return f"the next run resumes from step {step} (the last committed checkpoint)"

    def stop_on_preemption(self) -> None:
        """After SIGTERM: finish the save in flight, save this step if it fits in the time left, stop."""
        ckpt, step = self.checkpointer, self.step
        where = f"stopped after step {step} on SIGTERM"
        if not ckpt.settings.enabled:
            raise Preempted(f"{where}; checkpointing is off: nothing saved")
        in_flight = ckpt.last_saved_step if ckpt.saving else None
        waited = time.monotonic()
        try:
            ckpt.wait()
            if in_flight is not None:
                log_rank0(f"the asynchronous save of step {in_flight} in progress at SIGTERM committed")
        except CheckpointError as e:  # the same error on every rank; its partial files are removed
            log_rank0(f"the asynchronous save of step {in_flight} in progress at SIGTERM failed and was "
                      f"abandoned: {e}")
        if ckpt.last_committed_step == step:
            raise Preempted(f"{where}; checkpoint step {step} committed")
        left = (None if self.preemption.remaining_s is None
                else self.preemption.remaining_s - (time.monotonic() - waited))
        last = ckpt.last_stats.total_s if ckpt.last_stats is not None else None
        fits = left is None or last is None or last * SAVE_TIME_MARGIN + SAVE_TIME_SLACK_S <= left
        if not self.preemption.everyone(fits):
            raise Preempted(f"{where} without saving: the last save took {last or 0:.1f} s and "
                            f"{max(left or 0, 0):.1f} s of the grace period are left, too little to save; "
                            f"{self.resume_note()}")
        ckpt.save(step, blocking=True)
        raise Preempted(f"{where}; checkpoint step {step} committed")

    def run_step(self) -> None:
        """One optimizer step, then whatever is due: stopping on SIGTERM, a checkpoint, a log line."""
        self.step += 1
        try:
            faults.inject(self.fault, dist.get_rank(), self.step)
            inject_oom_for_tests(self.env.test_oom_at_step, self.step)
            loss, grad_norm, lr = self.train_step()
        except torch.OutOfMemoryError as e:
            raise DeviceOutOfMemory(out_of_memory_message(self.cfg, self.device, self.step, e)) from e
        self.metrics.step_completed()
        self.steps_since_log += 1
        if self.time_spent.step_completed():
            log_rank0(f"first step after {self.time_spent.startup_s:.1f} s "
                      f"(process start to the end of step {self.step})")
        last = self.step == self.cfg.training.steps
        if self.checkpointer.due(self.step) or last:
            with self.time_spent.checkpoint_stall():
                self.checkpointer.save(self.step)
        token = self.checkpoint_requests.poll()
        stopping = self.preemption.requested(checkpoint_asked=token is not None)
        if self.step % self.cfg.metrics.log_interval == 0 or last or stopping:
            # Logged before a stop too: the next incarnation resumes after this step, so its record
            # (the loss, the figures rank 0 leaves in its termination message) is made now or never.
            self.log_step(loss, grad_norm, lr)
        if stopping:
            self.stop_on_preemption()
        if self.preemption.checkpoint_asked:
            self.checkpoint_now(token)

    def checkpoint_now(self, token: str | None) -> None:
        """A checkpoint-now request reached some rank (rank 0 holds its token): every rank saves this step."""
        if not self.checkpointer.settings.enabled:
            log_rank0(f"checkpoint-now {token!r} at step {self.step}: checkpointing is off "
                      "(spec.checkpoint.enabled), nothing saved")
            return
        if token is not None:
            self.metrics.checkpoint_requested(token, self.step)
            log_rank0(f"checkpoint-now {token!r}: saving step {self.step}")
        with self.time_spent.checkpoint_stall():
            self.checkpointer.save(self.step)  # nothing new when this step's save is under way already

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """Metrics over the steps since the last log: Prometheus on every rank, a JSON line from rank 0."""
        global_loss = self.global_loss(loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time = (time.perf_counter() - self.last_log) / self.steps_since_log
        tokens_per_second = self.cfg.training.global_batch * self.cfg.model.seq_len / step_time
        world = dist.get_world_size()
        tflops = self.flops_per_token * tokens_per_second / world / 1e12
        peak, reserved = peak_memory_bytes(self.device)
        slowest = self.own_time.report(self.steps_since_log, step_time, self.metrics)
        slowest_rank, slowest_lag = slowest or (-1, 0.0)
        self.metrics.log(StepRecord(
            step=self.step, loss=global_loss, grad_norm=grad_norm.item(), lr=lr, step_time_s=step_time,
            tokens_per_second=tokens_per_second, tokens_per_second_per_device=tokens_per_second / world,
            tflops=tflops, mfu=self.mfu_peak.mfu(tflops),
            peak_memory_bytes=peak, peak_memory_reserved_bytes=reserved, **self.time_spent.record(),
            slowest_rank=slowest_rank, slowest_rank_lag=slowest_lag,
        ))
        self.last_log, self.steps_since_log = time.perf_counter(), 0
        if self.mfu_peak.said is not None and not self.said_peak:
            log_rank0(f"warning: {self.mfu_peak.said}")
            self.said_peak = True

    def save_full_parameters(self, path: Path) -> None:
        """Write every parameter, gathered whole, to path (rank 0); for tests and debugging."""
        params = full_parameters(self.model, self.mesh)
        if params is not None:
            torch.save(params, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = WorkerEnv.read()
    p = argparse.ArgumentParser(prog="python -m tetrad_trainer.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=env.config,
                   help=f"resolved config JSON (default ${ENV_CONFIG})")
    p.add_argument("--steps", type=int, default=None,
                   help="train this many steps instead of training.steps (the LR schedule follows)")
    p.add_argument("--jsonl", type=Path, default=env.jsonl,
                   help=f"also append rank 0's JSON lines here (default ${ENV_JSONL})")
    p.add_argument("--save-full-parameters", type=Path, default=None, metavar="PATH",
                   help="after training, save the gathered parameters to PATH (torch.save of a dict)")
    p.add_argument("--init-from", type=Path, default=None, metavar="HF_DIR",
                   help="initial weights from a Hugging Face directory (config.json, *.safetensors) "
                        "of this model, e.g. one written by python -m tetrad_trainer.export; ignored when "
                        "a checkpoint is resumed "
                        "(default: model.hfDir of the config, from spec.model.hfDir or training.initFrom)")
    return p.parse_args(argv)


def log_rank0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log(msg)


def run(args: argparse.Namespace) -> int:
    env = WorkerEnv.read()
    preemption = Preemption(env=env)  # first: a SIGTERM during start-up is kept, not fatal
    try:
        if not args.config:
            raise ConfigError(f"no config: pass --config or set ${ENV_CONFIG}")
        cfg = load_config(args.config, steps=args.steps)
        checked_definition(cfg)  # the model's import path and parts, before any collective
        if args.init_from is not None:
            cfg.model = cfg.model.model_copy(update={"hf_dir": str(args.init_from)})
        hf_field = hf_dir_field(cfg, args.init_from)
        checked_hf_dir(cfg, hf_field)
        if cfg.checkpoint.enabled and (problem := writable_problem(cfg.checkpoint.path)):
            raise ConfigError(problem)
        # Every rank reads and checks the data files (a JSONL file's every line) before joining the group.
        source = build_source(cfg, note=log if env.rank == 0 else lambda _: None)
        device = init_distributed(cfg.collective_timeout_seconds, env.local_rank)
    except ConfigError as e:
        return config_error(e)
    try:
        trainer = Trainer(cfg, device, jsonl=args.jsonl, preemption=preemption, source=source, env=env)
        if (figures := gang.read_figures(env)) is not None:
            # the gate's, run by the launcher
            trainer.metrics.preflight(figures)
        try:
            trainer.train()
            if args.save_full_parameters is not None:
                trainer.save_full_parameters(args.save_full_parameters)
        finally:
            with trainer.time_spent.checkpoint_stall():  # the last save committed (or failed) before
                trainer.checkpointer.close()  # the figures are left
            trainer.metrics.close()
        leave_final_state(env.rank, trainer.metrics.final_figures(trainer.time_spent))
    except (ConfigError, CheckpointMismatch, NoGoodCheckpoint) as e:
        return config_error(e)
    except ConversionError as e:  # the Hugging Face directory's weights (init_from_hf)
        return config_error(ConfigError(f"{hf_field}={cfg.model.hf_dir}: {e}"))
    except CheckpointError as e:  # retryable: the restart resumes from the last good checkpoint
        log(f"checkpoint error: {e}")
        return 1
    except Preempted as e:
        log(str(e))
        step, committed = trainer.committed_step(), trainer.metrics.committed
        leave_final_state(env.rank, trainer.metrics.final_figures(trainer.time_spent),
                          stopped=(step, committed[1] if committed is not None and committed[0] == step
                                   else None))
        return EXIT_PREEMPTED
    except DeviceOutOfMemory as e:  # permanent by default: the same layout would run out again
        log(str(e))
        exits.leave(TerminationMessage(reason=REASON_OUT_OF_MEMORY, message=str(e)))
        return EXIT_OOM
    except Exception as e:  # a peer hung or died in a collective (gloo; NCCL's watchdog aborts instead)
        if not collective.is_timeout(e):
            raise
        collective.log_report(collective.report(e, dist.get_rank(), cfg.collective_timeout_seconds))
        return EXIT_COLLECTIVE_TIMEOUT
    finally:
        dist.destroy_process_group()
    return 0


def hf_dir_field(cfg: ResolvedConfig, init_from: Path | None) -> str:
    """What named the Hugging Face directory the model starts from: --init-from, else the spec's field
    (initFrom when it is set: hfDir, when set too, is the same path)."""
    if init_from is not None:
        return "--init-from"
    return "spec.training.initFrom" if cfg.training.init_from is not None else "spec.model.hfDir"


def checked_hf_dir(cfg: ResolvedConfig, field: str) -> None:
    """The Hugging Face directory the model starts from, checked on every rank before any collective: a
    config.json Tetrad does not implement, or that contradicts the resolved model, is a config error."""
    if cfg.model is None or cfg.model.hf_dir is None:
        return
    try:
        check_hf_dir(cfg.model.hf_dir, cfg.model)
    except ConversionError as e:
        raise ConfigError(f"{field}={cfg.model.hf_dir}: {e}") from None


def config_error(e: Exception) -> int:
    """A config the trainer cannot run: said on the log and to the operator, never retried."""
    log(f"config error: {e}")
    exits.leave(TerminationMessage(reason=REASON_CONFIG, message=str(e)))
    return EXIT_CONFIG_ERROR


def write_whole_lines() -> None:
    """A node's workers share its stdout and stderr, which PYTHONUNBUFFERED makes write-through:
    print's text and its newline are two writes, and two ranks printing at once interleave them
    (`{...}{...}` then two newlines: a JSON line no reader parses). Line buffering makes each line
    one write."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone: nobody waits for this worker any more
    write_whole_lines()
    code = run(parse_args(argv))
    exits.report_exit(code)  # for the node's supervisor (tetrad.node.supervisor)
    return code


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown: by now everything is saved, reported and closed, and
    the final garbage collection of torch's objects takes seconds (tens on a busy node), which would
    count against the stall timeout and a preemption's grace period."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
