"""From a meta-device model to this rank's parallelized, materialized model parts.

A straight line, in this order:
    pipeline split → apply_float8 → apply_tp → apply_cp → apply_ac → apply_compile
        → apply_fsdp | apply_ddp | apply_replicate → init_weights
Each step is a plain function of a model part, so a reader can follow what each rank holds. The
model's definition (tetrad_trainer.models.ModelDefinition) names the parts each step works on; a
step given no definition takes the one the model's cfg names.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate as ddp
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from tetrad.api.resolved import Layout, ResolvedConfig
from tetrad.api.rules import FLOAT8_FIELD, MULTI_STAGE, compiles_loss
from tetrad.api.spec import ActivationCheckpointing, Float8, Float8Recipe, Offload, PPSchedule, Precision
from tetrad_trainer import cp as context_parallel
from tetrad_trainer.config import ConfigError
from tetrad_trainer.loss import TokenLoss
from tetrad_trainer.mesh import Mesh
from tetrad_trainer.models.init import canonical_name, init_weights
from tetrad_trainer.models.interface import ModelDefinition
from tetrad_trainer.models.loader import definition_of

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

# torch.distributed.pipelining's classes by name: the package imports torch._dynamo, about two seconds of
# every process's start-up on a CPU, so only a pipelined job imports it (pipeline_schedule).
SCHEDULES = {
    PPSchedule.GPIPE: "ScheduleGPipe",
    PPSchedule.ONE_F_ONE_B: "Schedule1F1B",
    PPSchedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    PPSchedule.ZERO_BUBBLE: "ScheduleZBVZeroBubble",
}


@dataclass
class TiedCopies:
    """A tied pair whose ends sit on different pipeline stages (Megatron-style): each of the two stages
    holds a copy, drawn alike; after every backward the copies' gradients are summed, so they stay equal."""

    copies: list[nn.Parameter]  # this rank's copies: one, or both when it holds both stages
    group: dist.ProcessGroup | None  # the two pipeline ranks holding them; None when this rank holds both
    # this rank's copy of the pair's second parameter: left out of the gradient norm
    second: nn.Parameter | None

    @torch.no_grad()
    def reduce_grads(self) -> None:
        for p in self.copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif isinstance(p, DTensor) and p.grad.placements != p.placements:
                # e.g. TP left it whole (Replicate)
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [_local(p.grad) for p in self.copies]
        if self.group is not None:
            dist.all_reduce(grads[0], group=self.group)
        else:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # the model, or this rank's pipeline stages
    schedule: _PipelineSchedule | None  # None without pipeline parallelism
    has_first_stage: bool
    has_last_stage: bool
    loss_parallel: bool  # logits are vocab-sharded DTensors: compute the loss under loss_parallel()
    autocast: bool  # bf16 without FSDP's mixed precision: run forward under autocast
    loss: TokenLoss  # the last stage's loss (the pipeline schedule's loss_fn); its scale is set every step
    tied: list[TiedCopies] = field(default_factory=list)  # tied pairs split over pipeline stages
    # tensorwise float8 under FSDP all-gathers float8 weights: their scales are computed after each step
    float8_scales: bool = False

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of the tied copies; collective over the pipeline ranks holding them."""
        for t in self.tied:
            t.reduce_grads()

    def after_optimizer_step(self) -> None:
        """The float8 weights' scales for the next all-gathers, in one all-reduce for all parameters."""
        if self.float8_scales:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            for part in self.parts:
                precompute_float8_dynamic_scale_for_fsdp(part)

    def uncounted(self) -> list[nn.Parameter]:
        """Tied copies the gradient norm must skip: their gradient is counted on the other end."""
        return [t.second for t in self.tied if t.second is not None]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _definition(model: nn.Module, definition: ModelDefinition | None) -> ModelDefinition:
    return definition or definition_of(model.cfg)  # type: ignore[arg-type]


def _present(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The modules of names this model (or pipeline stage) holds."""
    return [m for name in names if (m := getattr(model, name, None)) is not None]


def _blocks(model: nn.Module, definition: ModelDefinition) -> nn.ModuleDict:
    return getattr(model, definition.blocks)  # type: ignore[no-any-return]


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


def pipeline_split(model: nn.Module, stage: int, n_stages: int,
                   definition: ModelDefinition | None = None) -> nn.Module:
    """A copy of model holding only what stage computes."""
    definition = _definition(model, definition)
    part = copy.deepcopy(model)
    blocks = _blocks(part, definition)
    keep = {str(i) for i in stage_layers(len(blocks), n_stages)[stage]}
    for name in [n for n in blocks if n not in keep]:
        del blocks[name]
    dropped = ((() if stage == 0 else definition.first_stage)
               + (() if stage == n_stages - 1 else definition.last_stage))
    for name in dropped:
        setattr(part, name, None)
    return part


def _pair_groups(mesh: Mesh, a: int, b: int) -> dist.ProcessGroup | None:
    """This rank's group of pipeline ranks a and b (at its coordinates on the other dims); None when it is
    in neither. Collective: every rank creates every group."""
    ranks = mesh.world.mesh[[a, b]].reshape(2, -1).T.tolist()
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group


def tied_across_stages(cfg: ResolvedConfig, definition: ModelDefinition, parts: list[nn.Module],
                       ids: list[int], mesh: Mesh) -> list[TiedCopies]:
    """The tied pairs a pipeline splits (an embedding on the first stage, the output on the last): this
    rank's copies of each, and the group that sums their gradients. Collective."""
    n_stages = cfg.layout.pp * cfg.pp_stages_per_rank

    def stage_of(name: str) -> int:
        return 0 if name.split(".")[0] in definition.first_stage else n_stages - 1

    def rank_of(stage: int) -> int:
        return next(r for r in range(cfg.layout.pp) if stage in stage_ids(cfg.pp_schedule, cfg.layout.pp, r,
                                                                           cfg.pp_stages_per_rank))

    tied, groups = [], {}
    for a, b in definition.tied:
        sa, sb = stage_of(a), stage_of(b)
        if sa == sb:
            continue
        ranks = (rank_of(sa), rank_of(sb))
        if ranks[0] != ranks[1] and ranks not in groups:
            groups[ranks] = _pair_groups(mesh, *ranks)
        held = {name: part.get_parameter(name) for part, s in zip(parts, ids, strict=True)
                for name, at in ((a, sa), (b, sb)) if s == at}
        if held:
            tied.append(TiedCopies(copies=list(held.values()), group=groups.get(ranks), second=held.get(b)))
    return tied


# --- float8 ------------------------------------------------------------------------------------------

# torch._scaled_mm multiplies float8 matrices whose dims are multiples of 16.
FLOAT8_DIM_MULTIPLE = 16


def float8_modules(model: nn.Module, float8: Float8, definition: ModelDefinition | None = None) -> list[str]:
    """The linear layers float8 converts: every nn.Linear of the blocks, and the output projection when
    float8.output says so, whose dims are multiples of FLOAT8_DIM_MULTIPLE."""
    definition = _definition(model, definition)
    blocks = f"{definition.blocks}."

    def chosen(fqn: str) -> bool:
        return fqn.startswith(blocks) or (float8.output and fqn == definition.output)

    return [fqn for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and chosen(fqn)
            and m.in_features % FLOAT8_DIM_MULTIPLE == 0 and m.out_features % FLOAT8_DIM_MULTIPLE == 0]


def check_float8_device(device: torch.device) -> None:
    """float8 matmuls need torchao and an NVIDIA GPU of compute capability 8.9 or newer."""
    field = FLOAT8_FIELD
    if device.type != "cuda":
        raise ConfigError(f"{field}: float8 needs a CUDA GPU, this process runs on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(f"{field}: float8 needs a GPU of compute capability 8.9 or newer (H100, H200, L4, "
                          f"L40S, B200); {torch.cuda.get_device_name(device)} is "
                          f"{capability[0]}.{capability[1]}: set float8.recipe: none")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{field}: float8 needs torchao, which this image lacks (pip install torchao, or "
                          "use Tetrad's trainer image)") from e


def apply_float8(model: nn.Module, float8: Float8, fsdp: bool, definition: ModelDefinition | None = None,
                 emulate: bool = False) -> bool:
    """Swap float8_modules for torchao's Float8Linear (dynamic scaling by float8.recipe; on the meta device,
    before everything else). Under FSDP the tensorwise recipe all-gathers the weights in float8. True when
    the weights' scales must be precomputed after each optimizer step (ParallelModel.after_optimizer_step).
    emulate: the matmuls in high precision on any device (tests)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(float8.recipe.value)
    all_gather = fsdp and float8.recipe == Float8Recipe.TENSORWISE
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    if float8.recipe != Float8Recipe.TENSORWISE:
        import torch._inductor.config

        # the rowwise casts round like eager only with this (pytorch/pytorch#150859)
        torch._inductor.config.emulate_precision_casts = True  # type: ignore[attr-defined]
    chosen = set(float8_modules(model, float8, definition))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    return all_gather


# --- tensor, context and data parallelism -----------------------------------------------------------

def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, definition: ModelDefinition | None = None) -> None:
    """The definition's TP plan: its top-level modules this part holds, then every block. Tied pairs are
    tied again: each module was given its own sharded parameter."""
    definition = _definition(model, definition)
    plan = definition.tensor_parallel
    assert plan is not None, "loader.checked_definition refuses tp > 1 without a plan"
    top = {path: style for path, style in plan.top.items()
           if getattr(model, path.split(".")[0], None) is not None}
    parallelize_module(model, tp_mesh, dict(top))
    for a, b in definition.tied:
        ends = _placements(model, a), _placements(model, b)
        if None not in ends and ends[0] != ends[1]:
            raise ConfigError(f"spec.model.module={model.cfg.module}: the tied parameters {a} and {b}"  # type: ignore[union-attr]
                              f" are sharded differently by tensor_parallel ({ends[0]} vs {ends[1]});"
                              " shard both on the same dim"
                              " (e.g. RowwiseParallel embedding, ColwiseParallel output)")
    definition.tie(model)
    for block in _blocks(model, definition).values():
        parallelize_module(block, tp_mesh, dict(plan.block))


def _placements(model: nn.Module, name: str) -> tuple[object, ...] | None:
    try:
        p = model.get_parameter(name)
    except AttributeError:  # not on this pipeline stage
        return None
    return tuple(p.placements) if isinstance(p, DTensor) else ()


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, definition: ModelDefinition | None = None) -> None:
    """Shard the sequence: every block's attention core attends over the gathered K/V. The model gets this
    rank's load-balanced positions when it is materialized (init_weights)."""
    definition = _definition(model, definition)
    assert definition.attention is not None, (
        "loader.checked_definition refuses cp > 1 without an attention core")
    parent, _, attr = definition.attention.rpartition(".")
    for block in _blocks(model, definition).values():
        setattr(block.get_submodule(parent), attr,
                context_parallel.ContextParallelAttention(cp_mesh.get_group()))


def apply_ac(model: nn.Module, mode: ActivationCheckpointing,
             definition: ModelDefinition | None = None) -> None:
    """Recompute blocks in backward: every block (full) or every other block (selective)."""
    blocks = _blocks(model, _definition(model, definition))
    for name, block in blocks.items():
        if mode == ActivationCheckpointing.FULL or int(name) % 2 == 0:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, definition: ModelDefinition | None = None) -> None:
    """torch.compile each block: blocks are identical, so one compilation serves all."""
    blocks = _blocks(model, _definition(model, definition))
    for name, block in blocks.items():
        blocks[name] = torch.compile(block)


def _mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    if precision == Precision.BF16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _one_or_list(modules: list[nn.Module]) -> nn.Module | list[nn.Module]:
    return modules[0] if len(modules) == 1 else modules


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision, reshard_after_forward: bool,
               offload: OffloadPolicy, definition: ModelDefinition | None = None) -> None:
    """FSDP2 units: the first stage's modules (the embedding), each block, the last stage's (the final
    norm with the output projection), then the root (left with no parameters of its own). A 2D
    dp_mesh gives HSDP.

    The embedding and the output projection are the two largest parameters: each in its own unit
    is gathered only around its own use, not for the whole forward and backward as the root is.
    The backward starts at the output, so that unit stays gathered from its forward to its backward.
    Tied across the two (one parameter), they form one unit, gathered from the embedding's forward
    to its backward. reshard_after_forward=False keeps every unit gathered that way (ZeRO-2 behaviour).
    """
    definition = _definition(model, definition)
    mp = _mixed_precision(precision)
    first, last = _present(model, definition.first_stage), _present(model, definition.last_stage)
    if first and last and any(a.split(".")[0] in definition.first_stage
                              and b.split(".")[0] in definition.last_stage
                              for a, b in definition.tied):
        first, last = [], first + last
    if first:
        fully_shard(_one_or_list(first), mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward, offload_policy=offload)
    for block in _blocks(model, definition).values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    if last:
        fully_shard(_one_or_list(last), mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False,
                    offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                offload_policy=offload)


def offload_policy(offload: Offload, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload: sharded parameters, gradients and AdamW state in host memory, pinned for
    asynchronous copies on CUDA. On a CPU device the same code path runs with nothing to move."""
    if offload == Offload.CPU:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Pure data parallelism: DDP's reducer, bucketed all-reduces overlapped with the backward."""
    ddp(model, device_mesh=dp_mesh, bucket_cap_mb=100)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision,
                    definition: ModelDefinition | None = None) -> None:
    """Replication next to TP or PP: FSDP2's replicate keeps parameters as DTensors, per block and root."""
    mp = _mixed_precision(precision)
    for block in _blocks(model, _definition(model, definition)).values():
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
    assert cfg.model is not None, "a script job has no model"
    definition = definition_of(cfg.model)
    model = definition.meta_model(cfg.model)

    if layout.pp > 1:
        n_stages = layout.pp * cfg.pp_stages_per_rank
        ids = stage_ids(cfg.pp_schedule, layout.pp, mesh.local_rank("pp"), cfg.pp_stages_per_rank)
        parts = [pipeline_split(model, s, n_stages, definition) for s in ids]
    else:
        n_stages, ids, parts = 1, [0], [model]

    data_parallel = data_parallel_style(layout)
    offload = offload_policy(training.fsdp.offload, device) if data_parallel == "fsdp" else OffloadPolicy()
    # Under CPU offload FSDP takes its parameters materialized on the host.
    params_device = torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else None
    # This rank's positions of the sequence: its load-balanced chunks under CP.
    positions = context_parallel.shard_sequence(torch.arange(cfg.model.seq_len), 0, layout.cp,
                                                mesh.local_rank("cp"))
    float8_scales = False
    if training.float8.recipe != Float8Recipe.NONE:
        check_float8_device(device)
    for part in parts:
        if training.float8.recipe != Float8Recipe.NONE:
            float8_scales = apply_float8(part, training.float8, data_parallel == "fsdp", definition)
        if layout.tp > 1:
            apply_tp(part, mesh["tp"], definition)
        if layout.cp > 1:
            apply_cp(part, mesh["cp"], definition)
        if training.activation_checkpointing != ActivationCheckpointing.NONE:
            apply_ac(part, training.activation_checkpointing, definition)
        if training.compile:
            apply_compile(part, definition)
        if data_parallel == "fsdp":
            # With a pipeline each stage runs several microbatches: keep its parameters gathered.
            dp_mesh = mesh.hsdp if layout.dp_replicate > 1 else mesh.dp_shard_cp
            reshard = layout.pp == 1 and training.fsdp.reshard_after_forward
            apply_fsdp(part, dp_mesh, training.precision, reshard_after_forward=reshard, offload=offload,
                       definition=definition)
        elif data_parallel == "ddp":
            apply_ddp(part, mesh["dp_replicate"])
        elif data_parallel == "replicate":
            apply_replicate(part, mesh["dp_replicate"], training.precision, definition)
        init_weights(part, device, training.seed, params_device, positions, definition)

    # The last stage's output projection moves into the loss when it is chunked (tetrad_trainer.loss).
    last = next((part for part in parts if getattr(part, definition.output) is not None), None)
    if training.loss_chunks > 1 and last is not None:
        last.project_output = False
        loss = TokenLoss(training.loss_chunks, getattr(last, definition.output), layout.tp,
                         token_sum=definition.loss_sum)
    else:
        loss = TokenLoss(compiled=compiles_loss(training.compile, layout.tp, training.loss_chunks),
                         token_sum=definition.loss_sum)
    return ParallelModel(
        parts=parts,
        schedule=pipeline_schedule(cfg, parts, ids, n_stages, mesh, device, loss) if layout.pp > 1 else None,
        has_first_stage=0 in ids,
        has_last_stage=n_stages - 1 in ids,
        loss_parallel=layout.tp > 1,
        # FSDP2 and its replicate cast parameters to bf16 themselves; DDP and no data parallelism need
        # autocast.
        autocast=training.precision == Precision.BF16 and data_parallel in (None, "ddp"),
        loss=loss,
        tied=tied_across_stages(cfg, definition, parts, ids, mesh) if layout.pp > 1 else [],
        float8_scales=float8_scales,
    )


def pipeline_schedule(cfg: ResolvedConfig, parts: list[nn.Module], ids: list[int], n_stages: int, mesh: Mesh,
                      device: torch.device, loss: TokenLoss) -> _PipelineSchedule:
    """The schedule that runs this rank's stages `parts` (stage numbers `ids`) with the other pipeline
    ranks."""
    from torch.distributed import pipelining

    group = mesh["pp"].get_group()
    stages = [pipelining.PipelineStage(part, s, n_stages, device, group=group)
              for part, s in zip(parts, ids, strict=True)]
    schedule_class = getattr(pipelining, SCHEDULES[cfg.pp_schedule])
    return schedule_class(stages if cfg.pp_schedule in MULTI_STAGE else stages[0],
                          n_microbatches=cfg.pp_microbatches, loss_fn=loss, scale_grads=False)


def full_parameters(model: ParallelModel, mesh: Mesh) -> dict[str, torch.Tensor] | None:
    """Every parameter, whole and on the CPU, keyed by its name in the plain model (a tied parameter under
    each of its names); on rank 0 only.

    Collective: every rank must call it.
    """
    local = {}
    for part in model.parts:
        for fqn, p in part.named_parameters(remove_duplicate=False):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            local[canonical_name(fqn)] = full.detach().float().cpu()
    # One rank per pipeline stage holds the stage: the one at coordinate 0 of every other dim.
    if any(mesh.local_rank(d) for d in ("dp_replicate", "dp_shard", "cp", "tp")):
        return None
    pp_group = mesh["pp"].get_group()
    gathered: list[dict[str, torch.Tensor]] | None = ([{} for _ in range(mesh["pp"].size())]
                                                      if dist.get_rank() == 0 else None)
    dist.gather_object(local, gathered, group=pp_group, group_dst=0)
    if gathered is None:
        return None
    return {k: v for part in gathered for k, v in part.items()}
