"""Exact causal attention over a sequence sharded across the context-parallel group.

The sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r: under a causal mask
an early chunk attends to few keys and a late one to many, so pairing them balances the work.
Inputs, labels and RoPE positions are all sharded this way (`shard_sequence`).

Each rank all-gathers K and V (kv heads only, before grouped-query expansion), puts the chunks back
in sequence order and attends with its own queries. The all-gather's backward is a reduce-scatter,
so gradients are exact. Plain SDPA with a boolean mask runs on CPU (gloo) and CUDA (NCCL) alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) that rank holds."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's load-balanced part of x along dim (length seq/cp)."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=dim)


def sequence_order(cp: int) -> torch.Tensor:
    """For chunk k of the sequence, its index in the all-gathered (rank, slot) order."""
    return torch.tensor([2 * k if k < cp else 2 * (2 * cp - 1 - k) + 1 for k in range(2 * cp)])


class _AllGather(torch.autograd.Function):
    """Stack every rank's x along a new dim 0; the backward sums the gradients and scatters them back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, seq/cp, head_dim) load-balanced shards → the whole sequence, in order."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    gathered = _AllGather.apply(x, group)  # (cp, b, h, s, d); each rank's 2 chunks along s
    chunks = gathered.view(cp, b, h, 2, s // 2, d).movedim(3, 1).reshape(2 * cp, b, h, s // 2, d)
    ordered = chunks.index_select(0, sequence_order(cp).to(x.device))
    return ordered.movedim(0, 2).reshape(b, h, cp * s, d)


class ContextParallelAttention(nn.Module):
    """Drop-in for models.CausalAttention when the sequence is sharded across group."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all, v_all = all_gather_sequence(k, self.group), all_gather_sequence(v, self.group)
        c = q.shape[2] // 2
        outs = []
        for slot, chunk in enumerate(chunk_ids(self.cp, self.rank)):
            # Queries of chunk sit at positions chunk*c .. chunk*c+c-1 and see keys up to their own.
            end = (chunk + 1) * c
            q_pos = torch.arange(chunk * c, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]
            q_chunk = q[:, :, slot * c:(slot + 1) * c]
            outs.append(F.scaled_dot_product_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end],
                                                       attn_mask=mask, enable_gqa=True))
        return torch.cat(outs, dim=2)
