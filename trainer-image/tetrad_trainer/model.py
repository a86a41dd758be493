"""A Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...), so the
tensor-parallel plan and the checkpoints can address them by name. `layers` is a ModuleDict keyed
by the global layer index: a pipeline stage deletes the blocks it does not own and keeps the
names of the rest.

The model is built on the meta device, parallelized there, then materialized with
`init_weights`, which draws every parameter from (seed, parameter name) on its full shape and
keeps only the local shard. Hence the same seed gives the same model for every layout.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tetrad.api.resolved import ModelConfig


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair, stacked: (len(positions), head_dim/2, 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by the angles of rope."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[None, : x.shape[1], None, :, 0], rope[None, : x.shape[1], None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """softmax(QK^T/sqrt(d) + causal mask) V on (batch, heads, seq, head_dim); kv heads may be fewer.

    Context parallelism replaces this module with `cp.ContextParallelAttention`.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


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
        """Positions of the local sequence: 0..seq_len-1, or this rank's chunks under context parallelism."""
        self.positions = positions.cpu()
        self.register_buffer("rope", rope_tables(self.cfg.head_dim, self.cfg.rope_theta, self.positions), persistent=False)

    def init_buffers(self) -> None:
        """Recompute the RoPE tables in place (to_empty leaves buffers uninitialized)."""
        with torch.no_grad():
            self.rope.copy_(rope_tables(self.cfg.head_dim, self.cfg.rope_theta, self.positions))


def canonical_name(fqn: str) -> str:
    """The parameter's name in the plain model, without wrapper prefixes of compile or checkpointing."""
    return ".".join(p for p in fqn.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module"))


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def initial_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full, layout-independent initial value of the parameter called name (on the CPU, fp32)."""
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    t = torch.empty(shape, dtype=torch.float32)
    leaf = name.split(".")[-2] if "." in name else name
    if name.endswith("norm.weight"):
        return t.fill_(1.0)
    if name == "tok_embeddings.weight":
        return nn.init.normal_(t, std=1.0, generator=g)
    if name == "output.weight":
        std = cfg.dim**-0.5
        return nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
    if leaf in ("wo", "w2", "w3"):
        # Scale the residual branches down with depth, as in Llama and torchtitan.
        layer = int(name.split(".")[1])
        std = 0.02 / math.sqrt(2 * (layer + 1))
    else:
        std = 0.02
    return nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std, generator=g)


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of full, laid out like param (a plain tensor or a DTensor)."""
    if not isinstance(param, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


@torch.no_grad()
def init_weights(model: Transformer, device: torch.device, seed: int) -> None:
    """Materialize a meta-device (possibly parallelized) model on device with its initial weights."""
    model.to_empty(device=device)
    for fqn, param in model.named_parameters():
        full = initial_value(canonical_name(fqn), param.shape, model.cfg, seed)
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(local_shard(full, param))
    model.init_buffers()
