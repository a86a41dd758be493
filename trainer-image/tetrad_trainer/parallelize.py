"""From a meta-device model to this rank's parallelized, materialized model parts.

A straight line, in this order:
    pipeline split → apply_tp → apply_cp → apply_ac → apply_compile → apply_fsdp | apply_ddp | apply_replicate → init_weights
Each step is a plain function of a model part, so a reader can follow what each rank holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate as ddp
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tetrad.api.resolved import Layout, ResolvedConfig
from tetrad.api.rules import MULTI_STAGE, compiles_loss
from tetrad.api.spec import ActivationCheckpointing, Offload, PPSchedule, Precision
from tetrad_trainer import cp as context_parallel
from tetrad_trainer.loss import TokenLoss
from tetrad_trainer.mesh import Mesh
from tetrad_trainer.model import Transformer, canonical_name, init_weights

SCHEDULES = {
    PPSchedule.GPIPE: ScheduleGPipe,
    PPSchedule.ONE_F_ONE_B: Schedule1F1B,
    PPSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PPSchedule.ZERO_BUBBLE: ScheduleZBVZeroBubble,
}


@dataclass
class ParallelModel:
    parts: list[Transformer]  # the model, or this rank's pipeline stages
    schedule: _PipelineSchedule | None  # None without pipeline parallelism
    has_first_stage: bool
    has_last_stage: bool
    loss_parallel: bool  # logits are vocab-sharded DTensors: compute the loss under loss_parallel()
    autocast: bool  # bf16 without FSDP's mixed precision: run forward under autocast
    loss: TokenLoss  # the last stage's loss (the pipeline schedule's loss_fn); its scale is set every step

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


# --- pipeline parallelism -------------------------------------------------------------------------

def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The blocks of each stage: an even split that counts the embedding and the output as one layer each."""
    units = n_layers + 2  # unit 0 is the embedding, 1..n_layers the blocks, n_layers+1 the output
    base, extra = divmod(units, n_stages)
    stages, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        stages.append([u - 1 for u in range(start, end) if 1 <= u <= n_layers])
        start = end
    return stages


def stage_ids(schedule: PPSchedule, pp: int, pp_rank: int, per_rank: int) -> list[int]:
    """Stages held by pp_rank: looped (rank, rank+pp, ...) or V-shaped (rank, 2pp-1-rank) for zero bubble."""
    if schedule == PPSchedule.ZERO_BUBBLE:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def pipeline_split(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """A copy of model holding only what stage computes."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in stage_layers(model.cfg.layers, n_stages)[stage]}
    for name in [n for n in part.layers if n not in keep]:
        del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


# --- tensor, context and data parallelism -----------------------------------------------------------

def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP: column-wise in, row-wise out; sequence parallel norms; vocab-sharded logits."""
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, {name: style for name, style in top.items() if getattr(model, name) is not None})
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": gather_sequence,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_cp(model: Transformer, cp_mesh: DeviceMesh) -> None:
    """Shard the sequence: load-balanced RoPE positions and attention over the gathered K/V."""
    group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
    model.set_positions(context_parallel.shard_sequence(model.positions, 0, cp_mesh.size(), rank))
    for block in model.layers.values():
        block.attention.core = context_parallel.ContextParallelAttention(group)


def apply_ac(model: Transformer, mode: ActivationCheckpointing) -> None:
    """Recompute blocks in backward: every block (full) or every other block (selective)."""
    for name, block in model.layers.items():
        if mode == ActivationCheckpointing.FULL or int(name) % 2 == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer) -> None:
    """torch.compile each block: blocks are identical, so one compilation serves all."""
    for name, block in model.layers.items():
        model.layers[name] = torch.compile(block)


def _mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    if precision == Precision.BF16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, precision: Precision, reshard_after_forward: bool,
               offload: OffloadPolicy) -> None:
    """FSDP2 units: the embedding, each block, the final norm with the output projection, then the
    root (left with no parameters of its own). A 2D dp_mesh gives HSDP.

    The embedding and the output projection are the two largest parameters: each in its own unit
    is gathered only around its own use, not for the whole forward and backward as the root is.
    The backward starts at the output, so that unit stays gathered from its forward to its backward.
    reshard_after_forward=False keeps every unit gathered that way (ZeRO-2 behaviour).
    """
    mp = _mixed_precision(precision)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    if model.output is not None:
        fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False,
                    offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)


def offload_policy(offload: Offload, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload: sharded parameters, gradients and AdamW state in host memory, pinned for
    asynchronous copies on CUDA. On a CPU device the same code path runs with nothing to move."""
    if offload == Offload.CPU:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    """Pure data parallelism: DDP's reducer, bucketed all-reduces overlapped with the backward."""
    ddp(model, device_mesh=dp_mesh, bucket_cap_mb=100)


def apply_replicate(model: Transformer, dp_mesh: DeviceMesh, precision: Precision) -> None:
    """Replication next to TP or PP: FSDP2's replicate keeps parameters as DTensors, per block and root."""
    mp = _mixed_precision(precision)
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh, mp_policy=mp)
    replicate(model, mesh=dp_mesh, mp_policy=mp)


# --- the straight line -------------------------------------------------------------------------------

def data_parallel_style(layout: Layout) -> str | None:
    """fsdp when parameters are sharded (dp_shard or cp; HSDP with dp_replicate), ddp for pure data
    parallelism, replicate for dp_replicate next to TP or PP, None without data parallelism."""
    if layout.dp_shard * layout.cp > 1:
        return "fsdp"
    if layout.dp_replicate == layout.world_size > 1:
        return "ddp"
    return "replicate" if layout.dp_replicate > 1 else None


def parallelize(cfg: ResolvedConfig, mesh: Mesh, device: torch.device) -> ParallelModel:
    layout, training = cfg.layout, cfg.training
    with torch.device("meta"):
        model = Transformer(cfg.model)

    if layout.pp > 1:
        n_stages = layout.pp * cfg.pp_stages_per_rank
        ids = stage_ids(cfg.pp_schedule, layout.pp, mesh.local_rank("pp"), cfg.pp_stages_per_rank)
        parts = [pipeline_split(model, s, n_stages) for s in ids]
    else:
        n_stages, ids, parts = 1, [0], [model]

    data_parallel = data_parallel_style(layout)
    offload = offload_policy(training.fsdp.offload, device) if data_parallel == "fsdp" else OffloadPolicy()
    # Under CPU offload FSDP takes its parameters materialized on the host.
    params_device = torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else None
    for part in parts:
        if layout.tp > 1:
            apply_tp(part, mesh["tp"])
        if layout.cp > 1:
            apply_cp(part, mesh["cp"])
        if training.activation_checkpointing != ActivationCheckpointing.NONE:
            apply_ac(part, training.activation_checkpointing)
        if training.compile:
            apply_compile(part)
        if data_parallel == "fsdp":
            # With a pipeline each stage runs several microbatches: keep its parameters gathered.
            dp_mesh = mesh.hsdp if layout.dp_replicate > 1 else mesh.dp_shard_cp
            reshard = layout.pp == 1 and training.fsdp.reshard_after_forward
            apply_fsdp(part, dp_mesh, training.precision, reshard_after_forward=reshard, offload=offload)
        elif data_parallel == "ddp":
            apply_ddp(part, mesh["dp_replicate"])
        elif data_parallel == "replicate":
            apply_replicate(part, mesh["dp_replicate"], training.precision)
        init_weights(part, device, training.seed, params_device)

    # The last stage's output projection moves into the loss when it is chunked (tetrad_trainer.loss).
    last = next((part for part in parts if part.output is not None), None)
    if training.loss_chunks > 1 and last is not None:
        last.project_output = False
        loss = TokenLoss(training.loss_chunks, last.output, layout.tp)
    else:
        loss = TokenLoss(compiled=compiles_loss(training.compile, layout.tp, training.loss_chunks))
    schedule = None
    if layout.pp > 1:
        group = mesh["pp"].get_group()
        stages = [PipelineStage(part, s, n_stages, device, group=group) for part, s in zip(parts, ids, strict=True)]
        cls = SCHEDULES[cfg.pp_schedule]
        schedule = cls(stages if cfg.pp_schedule in MULTI_STAGE else stages[0],
                       n_microbatches=cfg.pp_microbatches, loss_fn=loss, scale_grads=False)

    return ParallelModel(
        parts=parts,
        schedule=schedule,
        has_first_stage=0 in ids,
        has_last_stage=n_stages - 1 in ids,
        loss_parallel=layout.tp > 1,
        # FSDP2 and its replicate cast parameters to bf16 themselves; DDP and no data parallelism need autocast.
        autocast=training.precision == Precision.BF16 and data_parallel in (None, "ddp"),
        loss=loss,
    )


def full_parameters(model: ParallelModel, mesh: Mesh) -> dict[str, torch.Tensor] | None:
    """Every parameter, whole and on the CPU, keyed by its name in the plain model; on rank 0 only.

    Collective: every rank must call it.
    """
    local = {}
    for part in model.parts:
        for fqn, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            local[canonical_name(fqn)] = full.detach().float().cpu()
    # One rank per pipeline stage holds the stage: the one at coordinate 0 of every other dim.
    if any(mesh.local_rank(d) for d in ("dp_replicate", "dp_shard", "cp", "tp")):
        return None
    pp_group = mesh["pp"].get_group()
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(mesh["pp"].size())] if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, group=pp_group, group_dst=0)
    if gathered is None:
        return None
    return {k: v for part in gathered for k, v in part.items()}
