"""The model interface: what Tetrad's trainer needs to know about a model to train it in any layout.

A model plugs into the trainer as one `ModelDefinition`: how to build it from the resolved dims, the
names of its parts (blocks, what the first and last pipeline stages hold, the output projection,
the attention core), its tensor-parallel plan, its per-parameter initialization rule and its tied
parameters. The trainer does the rest (pipeline split, TP, CP, activation checkpointing, compile,
FSDP/DDP, layout-independent initialization, checkpoints, metrics) the same way for every model.

The built-in Llama (`tetrad_trainer.models.llama`) is one definition; a job names another with
`spec.model.module: "pkg.mod:name"` (docs/bring-your-own.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from tetrad.api.resolved import ModelConfig
from tetrad_trainer.loss import cross_entropy_sum

Draw = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
"""Fills a tensor in place with initial values drawn from a generator, and returns it."""


def normal(std: float) -> Draw:
    """N(0, std²)."""
    return lambda t, g: nn.init.normal_(t, std=std, generator=g)


def trunc_normal(std: float, cut: float = 2.0) -> Draw:
    """N(0, std²) truncated at ±cut·std."""
    return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-cut * std, b=cut * std, generator=g)


def constant(value: float) -> Draw:
    """Every value the same (norm weights 1, biases 0)."""
    return lambda t, g: t.fill_(value)


class Decoder(Protocol):
    """What `ModelDefinition.build` returns: an nn.Module with these members.

    Its top-level modules are the first stage's (e.g. the embeddings), a ModuleDict of blocks keyed
    by the global layer index ("0", "1", ...), and the last stage's (final norm, output projection).
    A pipeline stage is a copy of the model whose modules of other stages are None and whose other
    blocks are deleted, so `forward` skips a None module and runs the blocks that are left.
    """

    cfg: ModelConfig  # the dims it was built from
    # False: the last stage returns the hidden states before the output projection (the chunked loss
    # projects)
    project_output: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) on the first stage, hidden states (batch, seq, dim) on the others; returns
        the logits on the last stage (or its hidden states without `project_output`), hidden states
        elsewhere."""
        ...

    def set_positions(self, positions: torch.Tensor) -> None:
        """The positions of the local sequence: 0..seq_len-1, or this rank's load-balanced chunks under
        context parallelism. The trainer calls it after materializing the model, with positions on the
        model's device: recompute every non-persistent buffer here (RoPE tables, position ids)."""
        ...


class CausalAttention(nn.Module):
    """softmax(QK^T/sqrt(d) + causal mask) V on (batch, heads, seq, head_dim); kv heads may be fewer.

    Give a model's attention its core as a module of this type and name it in
    `ModelDefinition.attention`: context parallelism replaces it with `cp.ContextParallelAttention`.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@dataclass(frozen=True)
class TensorParallelPlan:
    """torch's `parallelize_module` plans: `top` for modules of the whole model (those a pipeline stage
    dropped are skipped), `block` for paths inside every block.

    The trainer expects Megatron-style TP with sequence parallelism: the residual stream between
    blocks (and pipeline stages) sequence-sharded (Shard(1)) as local tensors, and the output
    projection's logits left as vocab-sharded DTensors (ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False)): the loss runs under `loss_parallel()`. Tied parameters must come out
    sharded alike (an embedding RowwiseParallel and an output projection ColwiseParallel both shard
    the vocab dim).
    """

    top: Mapping[str, ParallelStyle]
    block: Mapping[str, ParallelStyle]


@dataclass(frozen=True)
class ModelDefinition:
    """A model Tetrad's trainer can train: build it, name its parts, say how to parallelize and draw it.

    build: the whole model from the resolved dims (a `Decoder`); the trainer calls it under
        `torch.device("meta")`, so it must create its parameters on the current device.
    init: the rule for one parameter: `init(name, cfg)` returns how its values are drawn (`normal`,
        `trunc_normal`, `constant` or any `Draw`). The trainer draws each TILE of every parameter
        from a generator seeded by (seed, name, tile index), so the initial model is the same for
        every layout. Names are the full model's (e.g. "layers.3.attn.q.weight").
    first_stage, last_stage: the top-level modules only the first / last pipeline stage holds
        (embeddings; final norm and output projection). They count as one layer each in the split.
    output: the output projection among last_stage; `training.lossChunks` > 1 calls it from the loss.
    blocks: the ModuleDict of blocks, keyed by global layer index: the unit of FSDP, activation
        checkpointing, compile and the pipeline split.
    attention: the path, inside a block, of its `CausalAttention` core; None: no context parallelism.
    tensor_parallel: the TP plan; None: no tensor parallelism.
    tied: pairs of parameter names that are one tensor (e.g. ("wte.weight", "lm_head.weight")), of
        first_stage and last_stage modules, the first stage's end first: `build` ties them, the trainer
        keeps them tied (drawn, sharded, checkpointed and counted as the first name); across pipeline
        stages each of the two stages holds a copy, whose gradients are summed after the backward.
    loss_sum: the summed token loss of (logits, labels), labels -100 skipped (`loss.cross_entropy_sum`).
    params, flops: the parameter count and the training FLOPs per token (MFU) of cfg; None: counted
        on the model (see `num_params` and `flops_per_token`).
    """

    build: Callable[[ModelConfig], nn.Module]
    init: Callable[[str, ModelConfig], Draw]
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    output: str
    blocks: str = "layers"
    attention: str | None = None
    tensor_parallel: TensorParallelPlan | None = None
    tied: tuple[tuple[str, str], ...] = ()
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    params: Callable[[ModelConfig], int] | None = None
    flops: Callable[[ModelConfig], float] | None = None

    def source_name(self, name: str) -> str:
        """The name a tied parameter is drawn (and counted) as: the first of its pair."""
        return next((a for a, b in self.tied if b == name), name)

    def tie(self, model: nn.Module) -> None:
        """Make each tied pair one parameter again where model holds both (TP and materialization
        replace parameters module by module)."""
        for a, b in self.tied:
            if _holds(model, a) and _holds(model, b):
                owner, attr = _split(model, b)
                setattr(owner, attr, model.get_parameter(a))

    def num_params(self, cfg: ModelConfig) -> int:
        """`params(cfg)`, or the parameters of the model built on the meta device, tied ones once."""
        if self.params is not None:
            return self.params(cfg)
        return sum(p.numel() for p in self.meta_model(cfg).parameters())

    def flops_per_token(self, cfg: ModelConfig) -> float:
        """`flops(cfg)`, or 6N + 12·L·H·Q·T as the planner counts Llama: N the parameters used in matmuls
        (all but embedding tables that are not tied to an output), L layers, H heads, Q = dim/heads, T
        seq_len."""
        if self.flops is not None:
            return self.flops(cfg)
        model = self.meta_model(cfg)
        lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        multiplied = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding)
                      for p in m.parameters(recurse=False)}
        n = sum(p.numel() for p in model.parameters() if id(p) not in lookup or id(p) in multiplied)
        return 6.0 * n + cfg.attention_flops_per_token()

    def meta_model(self, cfg: ModelConfig) -> nn.Module:
        with torch.device("meta"):
            return self.build(cfg)


def _split(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def _holds(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True
