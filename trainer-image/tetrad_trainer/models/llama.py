"""The built-in model: a Llama-3-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...), which
the checkpoints and the Hugging Face export (tetrad_trainer.export) rely on. `definition` is the
`ModelDefinition` a job without `spec.model.module` trains.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from tetrad.api.resolved import ModelConfig
from tetrad_trainer.models.interface import (
    CausalAttention,
    Draw,
    ModelDefinition,
    TensorParallelPlan,
    constant,
    normal,
    trunc_normal,
)


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """The rotation of every (position, channel), as two factors: (len(positions), head_dim, 2).

    [..., 0] is cos of the channel's pair's angle, [..., 1] is -sin for the pair's first channel and
    +sin for its second, so that rotating the pair (a, b) is (a, b) * cos + (b, a) * (-sin, sin).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2)
    return torch.stack((cos, sin), dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by the angles of rope, in fp32.

    Three elementwise passes (x * cos, the pair swap, one multiply-add) and the cast back: in eager
    mode about half the memory traffic of rotating even and odd halves one product at a time.
    """
    cos, sin = rope[None, : x.shape[1], None, :, 0], rope[None, : x.shape[1], None, :, 1]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        self.core: nn.Module = CausalAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/tp query and kv heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (missing parts are None / deleted blocks)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.project_output = True  # False: the last stage returns the final norm's output (the chunked loss projects)
        self.set_positions(torch.arange(cfg.seq_len, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) for the first stage, hidden states otherwise."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and self.project_output else h

    def set_positions(self, positions: torch.Tensor) -> None:
        """Positions of the local sequence: 0..seq_len-1, or this rank's chunks under context parallelism;
        the RoPE tables are computed on the CPU and kept on the positions' device."""
        self.positions = positions.cpu()
        rope = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, self.positions)
        self.register_buffer("rope", rope.to(positions.device), persistent=False)

    def init_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the RoPE tables (to_empty leaves buffers uninitialized), on device when given."""
        self.set_positions(self.positions.to(device or self.rope.device))


def initial_values(name: str, cfg: ModelConfig) -> Draw:
    """Norms 1; embedding N(0, 1); wq wk wv w1 truncated N(0, 0.02); wo w2 w3 truncated
    N(0, 0.02/sqrt(2(layer+1))) (residual branches shrink with depth, as in Llama and torchtitan);
    output truncated N(0, dim^-1/2) at 3 std."""
    leaf = name.split(".")[-2] if "." in name else name
    if name.endswith("norm.weight"):
        return constant(1.0)
    if name == "tok_embeddings.weight":
        return normal(1.0)
    if name == "output.weight":
        return trunc_normal(cfg.dim**-0.5, cut=3.0)
    if leaf in ("wo", "w2", "w3"):
        return trunc_normal(0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1)))
    return trunc_normal(0.02)


# Megatron-style TP: column-wise in, row-wise out; sequence parallel norms; vocab-sharded logits.
_GATHER_SEQUENCE = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
TENSOR_PARALLEL = TensorParallelPlan(
    top={
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    },
    block={
        "attention_norm": SequenceParallel(),
        "attention": _GATHER_SEQUENCE,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    },
)

definition = ModelDefinition(
    build=Transformer,
    init=initial_values,
    first_stage=("tok_embeddings",),
    last_stage=("norm", "output"),
    output="output",
    attention="attention.core",
    tensor_parallel=TENSOR_PARALLEL,
    # The planner's closed forms (tetrad.api.resolved.ModelConfig), which counting the model gives too.
    params=lambda cfg: cfg.num_params(),
    flops=lambda cfg: cfg.flops_per_token(),
)
