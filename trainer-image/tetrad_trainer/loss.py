"""The training loss: next-token cross-entropy summed over valid tokens, over the global count.

Invariants:
- A label equal to IGNORE_INDEX (padding) adds nothing to the loss or its gradient.
- Every layout computes the same loss: the sum of the per-token losses of the whole global batch
  divided by its number of valid tokens, whatever the microbatches, pipeline stages and
  data-parallel ranks it is spread over. Each rank multiplies its sum by `scale` = (ranks that
  average gradients, dp x cp) / (global valid tokens): the gradient all-reduce's mean then gives the
  global mean. `scale` is set once per step, from one all-reduce of the valid-token count.
- The chunked loss equals the plain one: it applies the output projection and the loss to
  `chunks` slices of the sequence under activation checkpointing, so the batch x seq x vocab
  logits, their fp32 copy and their gradient exist one slice at a time, never whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # label of a position the loss skips (padding), as in torch's cross_entropy

# (logits, labels) -> summed loss of the valid labels
TokenSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss over the valid labels; under loss parallelism logits is vocab-sharded."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss  # the sum over the vocab shards


def chunked_cross_entropy_sum(hidden: torch.Tensor, labels: torch.Tensor, output: nn.Module, chunks: int,
                              tp: int = 1, token_sum: TokenSum = cross_entropy_sum) -> torch.Tensor:
    """token_sum(output(hidden), labels), computed over `chunks` slices of the sequence.

    Each slice's logits are recomputed in the backward (checkpointing), so at most one slice of
    logits is alive at a time. Under tensor parallelism hidden is this rank's sequence shard
    (sequence parallelism): the output layer all-gathers a slice from every TP rank, so the slice's
    labels are the same positions of every rank's shard, concatenated in rank order.
    """
    local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    seq = local.shape[1]
    per_rank_labels = labels.unflatten(1, (tp, seq))  # (batch, tp, seq/tp): rank r's positions in row r
    total = torch.zeros((), device=local.device)
    bounds = torch.arange(chunks + 1) * seq // chunks
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        if start == end:
            continue
        y = per_rank_labels[:, :, start:end].flatten(1, 2)
        part = checkpoint(_project_and_sum, local[:, start:end], y, output, token_sum, use_reentrant=False)
        total = total + part
    return total


def _project_and_sum(hidden: torch.Tensor, labels: torch.Tensor, output: nn.Module,
                     token_sum: TokenSum) -> torch.Tensor:
    return token_sum(output(hidden), labels)


class TokenLoss:
    """The pipeline schedule's loss_fn and the non-pipelined loss: scale * summed token loss.

    With `chunks` > 1 the model's last stage returns the final norm's output and the projection
    to the vocab happens here, slice by slice (`chunked_cross_entropy_sum`). token_sum is the model
    definition's summed token loss (default: cross-entropy).
    """

    def __init__(self, chunks: int = 1, output: nn.Module | None = None, tp: int = 1, compiled: bool = False,
                 token_sum: TokenSum = cross_entropy_sum):
        self.chunks, self.output, self.tp = chunks, output, tp
        self.scale: torch.Tensor | float = 1.0
        # Compiled, the fp32 cast, log-softmax and gather fuse into reductions over the logits as they
        # are: no fp32 copy of them, forward or backward.
        self.token_sum = torch.compile(token_sum) if compiled else token_sum

    def __call__(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.chunks > 1:
            assert self.output is not None, "the chunked loss needs the output projection"
            loss = chunked_cross_entropy_sum(out, labels, self.output, self.chunks, self.tp, self.token_sum)
        else:
            loss = self.token_sum(out, labels)
        return loss * self.scale

    def set_scale(self, labels: torch.Tensor, dp_cp_group: torch.distributed.ProcessGroup | None,
                  dp_cp: int) -> torch.Tensor:
        """scale = dp_cp / (valid labels over the dp x cp group); labels are this rank's (cp shard of
        its) batch. Collective over the group. Returns the global count of valid tokens."""
        count = (labels != IGNORE_INDEX).sum()
        if dp_cp_group is not None and dp_cp > 1:
            torch.distributed.all_reduce(count, group=dp_cp_group)
        self.scale = dp_cp / count.clamp_min(1).to(torch.float32)
        return count
