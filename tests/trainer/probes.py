"""Entry points run on every rank by the harness (`run_ranks("tests.trainer.probes:NAME", argv, ...)`).

Each returns 0 when its check holds on this rank and prints what differed otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tetrad_trainer.config import load_config
from tetrad_trainer.cp import ContextParallelAttention, shard_sequence
from tetrad_trainer.mesh import Mesh, build_mesh, init_distributed
from tetrad_trainer.parallelize import ParallelModel, full_parameters, parallelize
from torch.distributed.tensor import DTensor


def _parallel_model(argv: list[str]) -> tuple[str, Mesh, ParallelModel, torch.device]:
    """From --config and --out: join the process group and build this rank's parallel model; (out, mesh,
    model, device)."""
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    device = init_distributed()
    mesh = build_mesh(cfg.layout, device)
    return args.out, mesh, parallelize(cfg, mesh, device), device


def initial_parameters(argv: list[str]) -> int:
    """Build and materialize the parallel model, then save its parameters gathered whole (rank 0)."""
    out, mesh, model, _ = _parallel_model(argv)
    params = full_parameters(model, mesh)
    if params is not None:
        torch.save(params, out)
    dist.destroy_process_group()
    return 0


def fsdp_units(argv: list[str]) -> int:
    """Run one forward of the parallel model (FSDP over dpShard alone) and write, on rank 0, for each
    block whether its parameters are still gathered (plain tensors, not shards) and its unit's
    offload policy, and the RoPE buffer's device."""
    out, _, model, device = _parallel_model(argv)
    (part,) = model.parts
    part(torch.zeros(1, part.cfg.seq_len, dtype=torch.long, device=device))
    blocks = list(part.layers.values())
    report = {
        "gathered_after_forward": [not isinstance(b.attention.wq.weight, DTensor) for b in blocks],
        "offload": [type(b._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for b in blocks],
        "rope_device": part.rope.device.type,
    }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


def cp_attention(argv: list[str]) -> int:
    """ContextParallelAttention on load-balanced shards equals causal attention on the whole sequence."""
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, seq, d = 2, 4, 2, 8 * cp, 16
    q = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (ref * w).sum().backward()

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t.detach(), 2, cp, rank)

    ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
    out = ContextParallelAttention(dist.group.WORLD)(ql, kl, vl)
    (out * local(w)).sum().backward()
    checks = {"out": (out, local(ref)), "dq": (ql.grad, local(q.grad)), "dk": (kl.grad, local(k.grad)),
              "dv": (vl.grad, local(v.grad))}
    bad = {name: (a - b).abs().max().item() for name, (a, b) in checks.items()
           if not torch.allclose(a, b, atol=1e-10)}
    print(f"rank {rank} of cp={cp}: mismatches {bad}" if bad else f"rank {rank} of cp={cp}: exact",
          flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


class PaddedSource:
    """Wraps the job's source: sample i keeps its first 1..seq_len labels (drawn from i) and pads the rest."""

    def __init__(self, inner, seq_len: int, seed: int):
        self.inner, self.seq_len, self.seed = inner, seq_len, seed

    def sample(self, index: int):
        import numpy as np
        from tetrad_trainer.loss import IGNORE_INDEX

        tokens = self.inner.sample(index).copy()
        valid = int(np.random.default_rng((self.seed, index, 1)).integers(1, self.seq_len + 1))
        tokens[valid + 1:] = IGNORE_INDEX
        return tokens


def padded_training(argv: list[str]) -> int:
    """`tetrad_trainer.train.main` on the job's data padded by PaddedSource (test only: patches this rank's
    trainer)."""
    from tetrad_trainer import train

    real = train.build_source
    train.build_source = lambda cfg, **kw: PaddedSource(real(cfg, **kw), cfg.model.seq_len, cfg.training.seed)
    return train.main(argv)
