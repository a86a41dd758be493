"""The built-in decoder: pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU, with the options
of the families built on it (tetrad.api.families): Llama 2/3/3.1/3.2 and SmolLM, Mistral, Qwen2/2.5,
Qwen3. The block reads options from the ModelConfig, never a family's name: head_dim, q/k/v biases
(qkv_bias), a per-head RMSNorm of queries and keys before RoPE (qk_norm), Llama 3.1's RoPE scaling
(rope_scaling) and an output projection tied to the embedding (tie_embeddings).

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...), which
the checkpoints and the Hugging Face conversion (tetrad_trainer.export) rely on. `definition_for`
gives the `ModelDefinition` of a job without `spec.model.module`: `definition`, with the q/k norms
in its tensor-parallel plan and the tie in its `tied` when the options have them.
"""

from __future__ import annotations

import dataclasses
import functools
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
from tetrad.api.spec import RopeScaling
from tetrad_trainer.models.interface import (
    CausalAttention,
    Draw,
    ModelDefinition,
    TensorParallelPlan,
    constant,
    normal,
    trunc_normal,
)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The angle per position of each channel pair, in float64: theta^(-2i/head_dim), with Llama 3.1's
    scaling when given: wavelengths above original/lowFreqFactor divided by factor, below
    original/highFreqFactor kept, the band between interpolated linearly in original/wavelength."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    ratio = scaling.original_max_positions / wavelength
    smooth = ((ratio - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return inv_freq / scaling.factor * (1 - smooth) + inv_freq * smooth


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor,
                scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotation of every (position, channel), as two factors: (len(positions), head_dim, 2).

    [..., 0] is cos of the channel's pair's angle, [..., 1] is -sin for the pair's first channel and
    +sin for its second, so that rotating the pair (a, b) is (a, b) * cos + (b, a) * (-sin, sin).
    Angles are computed in float64, then rounded once.
    """
    inv_freq = rope_frequencies(head_dim, theta, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2)
    return torch.stack((cos, sin), dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by the angles of rope, in fp32, cast back.

    Eager, one complex product each way (the pairs as complex numbers times e^(i angle)): three passes
    over x forward and backward, the fewest eager kernels. Compiled, the same rotation in real numbers
    (inductor generates no code for complex tensors and would fall back to eager kernels), which it
    fuses into one kernel.
    """
    rope = rope[: x.shape[1]]
    if torch.compiler.is_compiling():
        return rope_real(x, rope)
    # (cos, sin) of each pair's angle; FSDP's mixed precision hands blocks the table in bf16
    turn = torch.view_as_complex(rope[None, :, None, 1::2].float())
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


def rope_real(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """apply_rope in real numbers: (a, b) * cos + (b, a) * (-sin, sin), one multiply-add."""
    cos, sin = rope[None, : x.shape[1], None, :, 0], rope[None, : x.shape[1], None, :, 1]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        # Qwen3: each query and key head normalized over head_dim before RoPE
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core: nn.Module = CausalAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/tp query and kv heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
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
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # False: the last stage returns the final norm's output (the chunked loss projects)
        self.project_output = True
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
        rope = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, self.positions, self.cfg.rope_scaling)
        self.register_buffer("rope", rope.to(positions.device), persistent=False)

    def init_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the RoPE tables (to_empty leaves buffers uninitialized), on device when given."""
        self.set_positions(self.positions.to(device or self.rope.device))


def initial_values(name: str, cfg: ModelConfig) -> Draw:
    """Norms 1, biases 0; embedding N(0, 1); wq wk wv w1 truncated N(0, 0.02); wo w2 w3 truncated
    N(0, 0.02/sqrt(2(layer+1))) (residual branches shrink with depth, as in Llama and torchtitan);
    output truncated N(0, dim^-1/2) at 3 std, and so the embedding when the two are tied (the
    logits keep their scale)."""
    leaf = name.split(".")[-2] if "." in name else name
    if name.endswith("norm.weight"):
        return constant(1.0)
    if name.endswith(".bias"):
        return constant(0.0)
    if name == "output.weight" or (name == "tok_embeddings.weight" and cfg.tie_embeddings):
        return trunc_normal(cfg.dim**-0.5, cut=3.0)
    if name == "tok_embeddings.weight":
        return normal(1.0)
    if leaf in ("wo", "w2", "w3"):
        return trunc_normal(0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1)))
    return trunc_normal(0.02)


# Megatron-style TP: column-wise in, row-wise out; sequence parallel norms; vocab-sharded logits.
_GATHER_SEQUENCE = PrepareModuleInput(input_layouts=(Shard(1), None),
                                      desired_input_layouts=(Replicate(), None))
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

# Qwen3's per-head q/k norms act on head_dim of a (batch, seq, heads/tp, head_dim) tensor: their weights
# replicated (gradients summed over the tp ranks), their input sharded on the heads dim.
QK_NORMS = {"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
TIED = (("tok_embeddings.weight", "output.weight"),)

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


@functools.cache
def _variant(qk_norm: bool, tied: bool) -> ModelDefinition:
    plan = TensorParallelPlan(top=TENSOR_PARALLEL.top, block={**TENSOR_PARALLEL.block, **QK_NORMS})
    return dataclasses.replace(definition, tensor_parallel=plan if qk_norm else TENSOR_PARALLEL,
                               tied=TIED if tied else ())


def definition_for(cfg: ModelConfig) -> ModelDefinition:
    """The definition of the built-in decoder with cfg's options (`definition` itself without q/k norms
    and tie)."""
    return (definition if not (cfg.qk_norm or cfg.tie_embeddings)
            else _variant(cfg.qk_norm, cfg.tie_embeddings))
