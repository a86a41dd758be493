"""A GPT-2-style decoder in Tetrad's trainer, written only against the public model interface.

Pre-norm blocks of LayerNorm (with bias), causal self-attention (q, k, v and the projection with
biases) and a GELU MLP; learned absolute position embeddings; the output projection tied to the token
embedding. A job trains it with this directory on the workers' PYTHONPATH:

    model: {module: "gpt2_model:definition", dim: 768, layers: 12, heads: 12, vocab: 50304, seqLen: 1024}

ffnDim is the MLP's hidden size (4 x dim by default), normEps the LayerNorm's eps; kvHeads equals
heads and ropeTheta is unused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tetrad_trainer.models import CausalAttention, ModelDefinition, TensorParallelPlan, constant, normal
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.core = CausalAttention()  # context parallelism swaps it for attention over the gathered K/V
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (batch, heads, seq, head_dim); -1 heads: under tensor parallelism a rank holds heads/tp of them
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        return self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """The whole model, or a pipeline stage of it: the trainer sets the modules of other stages to None."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg.dim, cfg.heads, cfg.ffn_dim, cfg.norm_eps)
                                     for i in range(cfg.layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.project_output = True
        self.set_positions(torch.arange(cfg.seq_len, device="cpu"))

    def set_positions(self, positions: torch.Tensor) -> None:
        # Under context parallelism these are the rank's load-balanced chunks: wpe looks up exactly those.
        self.register_buffer("positions", positions[None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.wte is None else self.wte(x) + self.wpe(self.positions[:, : x.shape[1]])
        for block in self.layers.values():
            h = block(h)
        h = h if self.ln_f is None else self.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None and self.project_output else h


def initial_values(name: str, cfg):
    """GPT-2's: N(0, 0.02), the residual projections scaled by 1/sqrt(2 layers), wpe N(0, 0.01);
    LayerNorms 1, biases 0."""
    if name.endswith(".bias"):
        return constant(0.0)
    if name.split(".")[-2].startswith("ln_"):
        return constant(1.0)
    if name == "wpe.weight":
        return normal(0.01)
    if name.endswith("proj.weight"):
        return normal(0.02 / math.sqrt(2 * cfg.layers))
    return normal(0.02)


_GATHER_SEQUENCE = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

definition = ModelDefinition(
    build=GPT2,
    init=initial_values,
    first_stage=("wte", "wpe"),
    last_stage=("ln_f", "lm_head"),
    output="lm_head",
    attention="attn.core",
    tied=(("wte.weight", "lm_head.weight"),),
    tensor_parallel=TensorParallelPlan(
        top={
            # Both embeddings shard their rows (vocab, positions) and reduce-scatter to sequence shards.
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
        block={
            "ln_1": SequenceParallel(),
            "attn": _GATHER_SEQUENCE,
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp": _GATHER_SEQUENCE,
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        },
    ),
)
