"""A small training job for exercising the checkpoint package alone: a few-layer MLP language model
under FSDP2 and tensor parallelism, AdamW, a learning rate that is a function of the step (as the
trainer's) and a data loader with per-rank state.

`train(rank, world, spec)` runs in a gang (tests/checkpoint/gang.py): it resumes when a
checkpoint exists, trains to spec["steps"], saves every spec["interval"] steps and returns its
losses, the full parameters (rank 0) and the samples it consumed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tetrad_trainer.checkpoint import Checkpointer, store
from tetrad_trainer.data import BatchLoader
from tetrad_trainer.preemption import Preemption
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tetrad.api import parse
from tetrad.api.contract import EXIT_PREEMPTED
from tetrad.api.resolved import ResolvedConfig
from tetrad.resolve import resolve

DIMS = {"dim": 32, "layers": 3, "heads": 4, "kvHeads": 2, "vocab": 64, "ffnDim": 64, "seqLen": 8}


def config(layout: dict[str, int], path: str | Path, *, steps: int = 10, interval: int = 5,
           keep_last: int = 3, async_save: bool = False, global_batch: int = 8,
           dims: dict[str, int] | None = None, name: str = "toy",
           allow_foreign: bool = False) -> ResolvedConfig:
    world = 1
    for d in layout.values():
        world *= d
    doc = {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nodes": 1, "nprocPerNode": world,
            "parallelism": {"pp": 1, "dpShard": 1, "tp": 1, "cp": 1, **layout},
            "model": {"preset": None, **(dims or DIMS)},
            "training": {"steps": steps, "globalBatch": global_batch, "precision": "fp32", "lr": 3e-2,
                         "warmupSteps": 2},
            "checkpoint": {"enabled": True, "path": str(path), "interval": interval, "keepLast": keep_last,
                           "async": async_save, "allowForeign": allow_foreign},
        },
    }
    job, problems = parse(doc)
    assert job is not None, problems
    return resolve(job)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(x)))


class ToyLM(nn.Module):
    """Named like the real model (tok_embeddings, layers.N, output) so stages can be cut the same way."""

    def __init__(self, cfg: ResolvedConfig, keep: set[int] | None = None, first: bool = True,
                 last: bool = True):
        super().__init__()
        m = cfg.model
        self.tok_embeddings = nn.Embedding(m.vocab, m.dim) if first else None
        self.layers = nn.ModuleDict({str(i): Block(m.dim, m.ffn_dim) for i in range(m.layers)
                                     if keep is None or i in keep})
        self.output = nn.Linear(m.dim, m.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h)
        return self.output(h) if self.output is not None else h


def build_model(cfg: ResolvedConfig, seed: int = 0) -> tuple[nn.Module, Any]:
    """The toy model initialised from the seed (identically for every layout), then parallelised."""
    torch.manual_seed(seed)
    model = ToyLM(cfg)
    lay = cfg.layout
    mesh = init_device_mesh("cpu", (lay.dp_shard, lay.tp), mesh_dim_names=("dp_shard", "tp"))
    if lay.tp > 1:
        parallelize_module(model, mesh["tp"], {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
            **{f"layers.{i}.w1": ColwiseParallel() for i in model.layers},
            **{f"layers.{i}.w2": RowwiseParallel() for i in model.layers},
        })
    if lay.dp_shard > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return model, mesh


def tokens(index: int, n: int, vocab: int) -> np.ndarray:
    """n tokens of global sample `index`: a deterministic, learnable progression."""
    return (index * 7 + np.arange(n) * (1 + index % 5)) % vocab


class RecordingSource:
    """A token source for the trainer's BatchLoader that remembers which samples were read."""

    def __init__(self, cfg: ResolvedConfig):
        self.n, self.vocab = cfg.model.seq_len + 1, cfg.model.vocab
        self.seen: list[int] = []

    def sample(self, index: int) -> np.ndarray:
        self.seen.append(index)
        return tokens(index, self.n, self.vocab)


class ToyLoader:
    """Global batch s is samples [s*B, (s+1)*B); DP rank d takes the slice d of it.

    Its state is per DP rank (the next sample it will read), unlike the trainer's loader, to
    exercise `load_resharded_state`.
    """

    def __init__(self, cfg: ResolvedConfig, dp_rank: int):
        self.cfg, self.dp_rank = cfg, dp_rank
        self.local = cfg.training.global_batch // cfg.layout.dp
        self.next_sample = dp_rank * self.local
        self.consumed: list[int] = []

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.cfg.model
        idx = list(range(self.next_sample, self.next_sample + self.local))
        self.consumed += idx
        self.next_sample += self.cfg.training.global_batch
        rows = torch.from_numpy(np.stack([tokens(i, m.seq_len + 1, m.vocab) for i in idx]))
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"next_sample": self.next_sample, "local": self.local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_sample = state["next_sample"]

    def load_resharded_state(self, states: list[dict[str, Any]]) -> None:
        # Old DP rank d was at global_index + d * old_local; the global index is the same for all.
        globals_ = {s["next_sample"] - d * s["local"] for d, s in enumerate(states)}
        assert len(globals_) == 1, f"old DP ranks disagree on the global sample index: {globals_}"
        self.next_sample = globals_.pop() + self.dp_rank * self.local


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def lr_at(step: int, base: float) -> float:
    """The toy's schedule: warm-up then decay, a function of the step alone (nothing to checkpoint)."""
    return base * min(1.0, (step + 1) / 3) * 0.9 ** step


def die_at(phase: str, step: int) -> Callable[[str, int], None]:
    """A checkpoint.store.phase_hook that SIGKILLs this process when the save of `step` reaches `phase`."""
    def hook(name: str, at: int) -> None:
        if (name, at) == (phase, step):
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def _progress(spec: dict[str, Any], rank: int, event: str) -> None:
    if spec.get("progress"):
        with open(Path(spec["progress"]) / f"rank-{rank}", "a") as f:
            f.write(event + "\n")


def inside_save(events: Path) -> bool:
    """Whether the rank died between a save's start and its commit (asynchronous writes included)."""
    opened = committed = 0
    for line in events.read_text().splitlines():
        name, _, step = line.partition(" ")
        if name == "save":
            opened = int(step)
        elif name == "committed":
            committed = int(step)
    return opened > committed


@contextlib.contextmanager
def disk_full(limit: int | None) -> Iterator[None]:
    """While inside, this process's writes past `limit` bytes fail (EFBIG), as on a full disk."""
    if limit is None:
        yield
        return
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)


def train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    # The toy's output module returns a view, and gathering 2D-sharded parameters takes two
    # all-gathers: both are harmless here, and both warnings would flood the test output.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg = config(spec["layout"], spec["path"], steps=spec.get("steps", 10), interval=spec.get("interval", 5),
                 keep_last=spec.get("keep_last", 3), async_save=spec.get("async", False),
                 dims=spec.get("dims"))
    model, mesh = build_model(cfg)
    dp_rank = mesh["dp_shard"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, weight_decay=0.1)
    if spec.get("loader") == "trainer":  # the trainer's own loader: its state is the global sample index
        source = RecordingSource(cfg)
        loader: Any = BatchLoader(source, cfg.training.global_batch, dp_rank=dp_rank, dp_size=cfg.layout.dp)
        consumed = source.seen
    else:
        loader = ToyLoader(cfg, dp_rank)
        consumed = loader.consumed
    log: list[str] = []
    ckpt = Checkpointer(cfg, model_parts=[model], optimizers=[opt], data_loader=loader, dp_rank=dp_rank,
                        logger=log.append)
    preemption = Preemption() if spec.get("preemptible") else None
    if preemption is not None:
        preemption.connect()

    die = spec.get("die")  # {"rank": r, "phase": "dcp-written", "step": 5}: SIGKILL ourselves there
    if die and die["rank"] == rank and die.get("phase"):
        store.phase_hook = die_at(die["phase"], die["step"])
    elif spec.get("progress"):
        store.phase_hook = lambda phase, at: _progress(spec, rank, f"{phase} {at}")

    resumed = ckpt.resume()
    step = resumed.step if resumed else 0
    losses: dict[int, float] = {}
    while step < cfg.training.steps:
        step += 1
        _progress(spec, rank, f"step {step}")
        x, y = loader.next_batch()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, cfg.training.lr)
        if spec.get("pause_at") == step:  # a window inside training for a kill from outside
            _progress(spec, rank, f"paused {step}")
            time.sleep(spec.get("pause_s", 1.0))
        opt.step()
        opt.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses[step] = reduced.item() / world
        if die and die["rank"] == rank and die.get("after_step") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if ckpt.due(step):
            _progress(spec, rank, f"save {step}")
            limit = spec.get("disk_limit")
            with disk_full(limit["bytes"] if limit and (limit["rank"], limit["step"]) == (rank, step)
                           else None):
                ckpt.save(step)
            _progress(spec, rank, f"saved {step}")
        if preemption is not None and preemption.requested():
            ckpt.save(step, blocking=True)
            ckpt.close()
            raise SystemExit(EXIT_PREEMPTED)
    ckpt.close()
    params = full_params(model)
    return {"losses": losses, "params": params if rank == 0 else None, "consumed": consumed,
            "dp_rank": dp_rank, "tp_rank": mesh["tp"].get_local_rank(),
            "resumed": None if resumed is None else {"step": resumed.step,
                                                     "saved_layout": resumed.saved_layout,
                                                     "refused": resumed.refused},
            "log": log, "lr": [g["lr"] for g in opt.param_groups], "stats": ckpt.last_stats}
