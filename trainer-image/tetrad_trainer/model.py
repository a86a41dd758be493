"""A Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names follow Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...), so the
tensor-parallel plan and the checkpoints can address them by name. `layers` is a ModuleDict keyed
by the global layer index: a pipeline stage deletes the blocks it does not own and keeps the
names of the rest.

The model is built on the meta device, parallelized there, then materialized with
`init_weights`: each rank draws only the values it holds, every value a function of (seed,
parameter name, its global index) (`initial_slice`). Hence the same seed gives the same model,
bit for bit, for every layout, and no rank ever holds a whole parameter it does not own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tetrad.api.resolved import ModelConfig


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

    def init_buffers(self, device: torch.device | None = None) -> None:
        """Recompute the RoPE tables (to_empty leaves buffers uninitialized), on device when given."""
        rope = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, self.positions)
        self.register_buffer("rope", rope.to(device or self.rope.device), persistent=False)


def canonical_name(fqn: str) -> str:
    """The parameter's name in the plain model, without wrapper prefixes of compile or checkpointing."""
    return ".".join(p for p in fqn.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module"))


TILE = (256, 1024)  # rows x columns of one independently drawn piece of a parameter


def _tile_generator(seed: int, name: str, tile: tuple[int, int]) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{tile[0]}/{tile[1]}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _draw(name: str, cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """How the parameter called name is drawn: fills a tensor in place from a generator."""
    leaf = name.split(".")[-2] if "." in name else name
    if name.endswith("norm.weight"):
        return lambda t, g: t.fill_(1.0)
    if name == "tok_embeddings.weight":
        return lambda t, g: nn.init.normal_(t, std=1.0, generator=g)
    if name == "output.weight":
        std, cut = cfg.dim**-0.5, 3.0
    elif leaf in ("wo", "w2", "w3"):
        # Scale the residual branches down with depth, as in Llama and torchtitan.
        std, cut = 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1)), 2.0
    else:
        std, cut = 0.02, 2.0
    return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-cut * std, b=cut * std, generator=g)


def initial_slice(name: str, shape: Sequence[int], offset: Sequence[int], size: Sequence[int], cfg: ModelConfig,
                  seed: int) -> torch.Tensor:
    """The box [offset, offset+size) of the initial value of the parameter called name (full shape
    `shape`), on the CPU in fp32, computed without the rest of the parameter.

    The parameter is cut into TILE-sized tiles, each drawn from its own generator seeded by
    (seed, name, tile index): a value depends only on (seed, name, its global index), whatever box
    it is computed in. Only the tiles the box touches are drawn, one at a time.
    """
    if len(shape) not in (1, 2):
        raise ValueError(f"{name}: initial_slice takes 1-D or 2-D parameters, got shape {tuple(shape)}")
    out = torch.empty(tuple(size), dtype=torch.float32)
    if out.numel() == 0:
        return out
    draw = _draw(name, cfg)
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    (r0, c0), (nr, nc) = ((0, offset[0]), (1, size[0])) if len(shape) == 1 else (offset, size)
    box = out.view(nr, nc)
    tr, tc = TILE
    for i in range(r0 // tr, (r0 + nr - 1) // tr + 1):
        for j in range(c0 // tc, (c0 + nc - 1) // tc + 1):
            top, left = i * tr, j * tc
            tile = draw(torch.empty(min(tr, rows - top), min(tc, cols - left)), _tile_generator(seed, name, (i, j)))
            # the part of the tile inside the box, in tile and in box coordinates
            a, b = max(r0, top), min(r0 + nr, top + tile.shape[0])
            c, d = max(c0, left), min(c0 + nc, left + tile.shape[1])
            box[a - r0:b - r0, c - c0:d - c0] = tile[a - top:b - top, c - left:d - left]
    return out


def initial_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full, layout-independent initial value of the parameter called name (on the CPU, fp32)."""
    return initial_slice(name, shape, [0] * len(shape), shape, cfg, seed)


def local_box(param: torch.Tensor) -> tuple[list[int], list[int]]:
    """(global offset, local size) of this rank's piece of param (a plain tensor or a DTensor)."""
    if not isinstance(param, DTensor):
        return [0] * param.dim(), list(param.shape)
    size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return list(offset), list(size)


@torch.no_grad()
def init_weights(model: Transformer, device: torch.device, seed: int, params_device: torch.device | None = None) -> None:
    """Materialize a meta-device (possibly parallelized) model on device with its initial weights.

    params_device: where the parameters live instead (the host, under FSDP's CPU offload); buffers stay on device.
    """
    model.to_empty(device=params_device or device)
    for fqn, param in model.named_parameters():
        offset, size = local_box(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(initial_slice(canonical_name(fqn), param.shape, offset, size, model.cfg, seed))
    model.init_buffers(device)
