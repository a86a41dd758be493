"""Solve `auto` degrees the way experienced people choose them.

1. TP stays inside a node (tp divides nprocPerNode, heads and kvHeads).
2. PP only when the model does not fit without it.
3. CP when activations (long sequences) do not fit without it, or when it is clearly faster.
4. The rest goes to dpShard (dpReplicate stays 1 unless dpShard is fixed).

Among layouts that pass every check and fit the GPU's memory, the solver keeps those with the
fewest pipeline stages. On GPUs it predicts each one's step time (tetrad.plan.timing) and keeps
those within CLEARLY_FASTER of the fastest: TP or CP must pay for their exposed communication.
Of those it takes the least context parallelism, then the least tensor parallelism; from
LONG_SEQUENCE tokens on, context parallelism is preferred to tensor parallelism: it splits the
activations as well while moving only K/V.
When none fits it says so and names the layout that comes closest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tetrad.api.accelerators import ACCELERATORS, ASSUMED, Accelerator, find_accelerator
from tetrad.api.problems import Problem, errors
from tetrad.api.resolved import Layout, ModelConfig
from tetrad.api.rules import check_layout, divisors, microbatches, stages_per_rank
from tetrad.api.spec import (
    ActivationCheckpointing,
    Float8Recipe,
    Offload,
    ParallelTrainingJobSpec,
    PPSchedule,
)
from tetrad.plan.estimate import Estimate, GiB, Workload, estimate
from tetrad.plan.timing import StepTime, step_time

# Leave room for the CUDA context, NCCL buffers and allocator fragmentation.
USABLE_MEMORY_FRACTION = 0.9
LONG_SEQUENCE = 32768
CLEARLY_FASTER = 0.10  # margin for what the model leaves out: smaller TP GEMMs, kernel launch overheads
DEGREES = (("dp_replicate", "dpReplicate"), ("dp_shard", "dpShard"), ("tp", "tp"), ("cp", "cp"), ("pp", "pp"))
NEAREST = 3  # values named per field when no layout satisfies the job
BATCH_FIELDS = ("spec.training.globalBatch", "spec.training.microBatch")


@dataclass
class Solution:
    layout: Layout | None
    estimate: Estimate | None
    reason: str = ""
    candidates: int = 0
    time: StepTime | None = None


def workload(spec: ParallelTrainingJobSpec, layout: Layout) -> Workload:
    t = spec.training
    return Workload(
        global_batch=t.global_batch,
        micro_batch=t.micro_batch,
        precision=t.precision,
        ac=t.activation_checkpointing,
        pp_schedule=spec.parallelism.pp_schedule,
        pp_microbatches=microbatches(spec, layout),
        pp_stages_per_rank=stages_per_rank(spec),
        loss_chunks=t.loss_chunks,
        compile=t.compile,
        reshard_after_forward=t.fsdp.reshard_after_forward,
        offload=t.fsdp.offload == Offload.CPU,
        float8=t.float8.recipe,
        float8_output=t.float8.output,
    )


def usable_bytes(spec: ParallelTrainingJobSpec) -> float | None:
    """Memory budget per device, or None on CPU where the planner does not bound memory."""
    if spec.resources.gpu == 0:
        return None
    return spec.resources.gpu_memory_gib * GiB * USABLE_MEMORY_FRACTION


def accelerator(spec: ParallelTrainingJobSpec) -> tuple[str, Accelerator] | None:
    """The GPU the job asks for, from the table; None for CPU jobs."""
    if spec.resources.gpu == 0:
        return None
    found = find_accelerator(spec.resources.gpu_type) if spec.resources.gpu_type else None
    return found or (f"{ASSUMED} (assumed)", ACCELERATORS[ASSUMED])


def predict_time(spec: ParallelTrainingJobSpec, cfg: ModelConfig, est: Estimate) -> StepTime | None:
    acc = accelerator(spec)
    if acc is None:
        return None
    tokens = spec.training.global_batch * cfg.seq_len / est.layout.world_size
    return step_time(est, workload(spec, est.layout), spec.nproc_per_node, *acc, tokens_per_device=tokens)


def _candidates(spec: ParallelTrainingJobSpec, cfg: ModelConfig) -> list[Layout]:
    p = spec.parallelism
    world = spec.nodes * spec.nproc_per_node

    def options(value: int | str, auto: list[int]) -> list[int]:
        return auto if value == "auto" else [int(value)]

    tp_auto = [d for d in divisors(spec.nproc_per_node) if cfg.heads % d == 0 and cfg.kv_heads % d == 0]
    if spec.training.float8.recipe != Float8Recipe.NONE:
        tp_auto = [1]  # rules.check_float8_layout
    out = []
    for pp, cp, tp in itertools.product(options(p.pp, divisors(world)), options(p.cp, divisors(world)),
                                        options(p.tp, tp_auto)):
        rest, rem = divmod(world, pp * cp * tp)
        if rem:
            continue
        if p.dp_shard == "auto":
            dpr_options = options(p.dp_replicate, [1])
            for dpr in dpr_options:
                if rest % dpr == 0:
                    out.append(Layout(pp=pp, cp=cp, tp=tp, dp_replicate=dpr, dp_shard=rest // dpr))
        else:
            dps = int(p.dp_shard)
            dpr_options = options(p.dp_replicate, [rest // dps] if rest % dps == 0 else [])
            out.extend(Layout(pp=pp, cp=cp, tp=tp, dp_replicate=dpr, dp_shard=dps) for dpr in dpr_options)
    return out


def solve(spec: ParallelTrainingJobSpec, cfg: ModelConfig) -> Solution:
    p = spec.parallelism
    explicit = all(v != "auto" for v in (p.dp_replicate, p.dp_shard, p.tp, p.cp, p.pp))
    if explicit:
        layout = Layout(pp=int(p.pp), dp_replicate=int(p.dp_replicate), dp_shard=int(p.dp_shard),
                        cp=int(p.cp), tp=int(p.tp))
        est = estimate(cfg, layout, workload(spec, layout))
        return Solution(layout, est, candidates=1, time=predict_time(spec, cfg, est))

    budget = usable_bytes(spec)
    valid = [(layout, estimate(cfg, layout, workload(spec, layout))) for layout in valid_layouts(spec, cfg)]
    if not valid:
        nearest = nearest_values(spec, cfg)
        return Solution(None, None, (
            f"no layout of {spec.nodes}x{spec.nproc_per_node} processes satisfies the fixed degrees and the"
            f" model (heads={cfg.heads}, kvHeads={cfg.kv_heads}, layers={cfg.layers}, seqLen={cfg.seq_len},"
            f" globalBatch={spec.training.global_batch}); "
            + (f"any one of these would give one: {'; '.join(nearest)}" if nearest else
               "fix more degrees explicitly or change the batch")))
    fitting = [(lay, est) for lay, est in valid if budget is None or est.peak_bytes <= budget]
    if fitting:
        long = cfg.seq_len >= LONG_SEQUENCE

        def preference(lay: Layout) -> tuple[int, ...]:
            split = (lay.tp, lay.cp) if long else (lay.cp, lay.tp)
            return (lay.pp, *split, lay.dp_replicate)

        fewest_stages = min(lay.pp for lay, _ in fitting)
        timed = [(lay, est, predict_time(spec, cfg, est)) for lay, est in fitting if lay.pp == fewest_stages]
        times = [t.total_s for _, _, t in timed if t is not None]  # all or none: GPU jobs only
        if times:
            timed = [x for x in timed
                     if x[2] is not None and x[2].total_s <= min(times) * (1 + CLEARLY_FASTER)]
        layout, est, time = min(timed, key=lambda x: preference(x[0]))
        return Solution(layout, est, candidates=len(valid), time=time)
    layout, est = min(valid, key=lambda le: le[1].peak_bytes)
    assert budget is not None
    return Solution(None, est, (
        f"no layout fits {spec.resources.gpu_memory_gib:g} GiB per GPU ({budget / GiB:.1f} GiB usable);"
        f" the closest is {layout.label()} at {est.peak_bytes / GiB:.1f} GiB per GPU;"
        f" {no_fit_advice(spec, est, budget)}"),
        candidates=len(valid))


def valid_layouts(spec: ParallelTrainingJobSpec, cfg: ModelConfig) -> list[Layout]:
    """The candidate layouts that pass every rule (memory aside)."""
    out = []
    for layout in _candidates(spec, cfg):
        problems: list[Problem] = []
        check_layout(spec, cfg, layout, problems)
        if not errors(problems):
            out.append(layout)
    return out


def nearest_values(spec: ParallelTrainingJobSpec, cfg: ModelConfig) -> list[str]:
    """When no layout satisfies the job: the nearest values that would, changing one fixed degree (the
    others as given), or globalBatch, or one degree with globalBatch; e.g. `tp=2 or 4`, `globalBatch=6 or
    12`."""
    out = []
    if batch := _batch_fix(spec, cfg, _candidates(spec, cfg)):
        out.append(f"globalBatch={batch}")
    p = spec.parallelism
    for name, alias in DEGREES:
        given = getattr(p, name)
        if given == "auto":
            continue
        relaxed = spec.model_copy(update={"parallelism": p.model_copy(update={name: "auto"})})
        others = [lay for lay in _candidates(relaxed, cfg) if getattr(lay, name) != given]
        alone = sorted({getattr(lay, name) for lay in others if not _layout_errors(relaxed, cfg, lay)},
                       key=lambda v: (abs(v - given), v))[:NEAREST]
        if alone:
            out.append(f"{alias}={' or '.join(map(str, sorted(alone)))}")
            continue
        for value in sorted({getattr(lay, name) for lay in others}, key=lambda v: (abs(v - given), v)):
            if batch := _batch_fix(relaxed, cfg, [lay for lay in others if getattr(lay, name) == value]):
                out.append(f"{alias}={value} with globalBatch={batch}")
                break
    return out


def _layout_errors(spec: ParallelTrainingJobSpec, cfg: ModelConfig, layout: Layout) -> list[Problem]:
    problems: list[Problem] = []
    check_layout(spec, cfg, layout, problems)
    return errors(problems)


def _batch_fix(spec: ParallelTrainingJobSpec, cfg: ModelConfig, layouts: list[Layout]) -> str | None:
    """The globalBatch values nearest the given one, below and above, that let in a layout only the batch
    keeps out."""
    gb, below, above = spec.training.global_batch, 0, 0
    for layout in layouts:
        found = _layout_errors(spec, cfg, layout)
        if not found or any(q.field not in BATCH_FIELDS for q in found):
            continue
        unit = layout.dp * (microbatches(spec, layout) if layout.pp > 1 else spec.training.micro_batch)
        below = max(below, gb // unit * unit)
        above = min(above or 2**62, -(-gb // unit) * unit)
    values = [b for b in dict.fromkeys((below, above)) if b]
    return " or ".join(map(str, values)) or None


def no_fit_advice(spec: ParallelTrainingJobSpec, est: Estimate, budget: float) -> str:
    """What would bring the closest layout's `est` under `budget`: the knobs that cut what puts it over."""
    t = spec.training
    state = est.params_bytes + est.grads_bytes + est.optimizer_bytes + est.buffers_bytes
    if state > budget:
        knobs = ["add nodes to shard the model over more GPUs"]
        if t.fsdp.offload != Offload.CPU:
            knobs.append("set training.fsdp.offload: cpu (with dpShard*cp > 1)")
        knobs.append("use GPUs with more memory (resources.gpuMemoryGiB)")
        return (f"its parameters, gradients and optimizer state alone take {state / GiB:.1f} GiB, so"
                f" activation checkpointing or a smaller batch cannot make it fit: {', '.join(knobs[:-1])}"
                f" or {knobs[-1]}")
    knobs = []
    if t.activation_checkpointing != ActivationCheckpointing.FULL:
        knobs.append(f"set activationCheckpointing: full (now {t.activation_checkpointing.value})")
    if est.layout.pp > 1 and spec.parallelism.pp_schedule == PPSchedule.GPIPE:
        knobs.append("use ppSchedule 1F1B (GPipe holds every microbatch's activations)")
    elif est.layout.pp > 1:
        knobs.append(f"raise ppMicrobatches (now {microbatches(spec, est.layout)}) for smaller microbatches")
    elif t.micro_batch > 1:
        knobs.append(f"lower microBatch (now {t.micro_batch})")
    if t.loss_chunks == 1:
        knobs.append("set lossChunks above 1 (the loss's logits a slice at a time)")
    knobs.append("add nodes")
    return (f"the activations ({est.activations_bytes / GiB:.1f} GiB) put it over: "
            f"{', '.join(knobs[:-1])} or {knobs[-1]}" if len(knobs) > 1 else knobs[0])
