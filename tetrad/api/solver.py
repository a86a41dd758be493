"""Solve `auto` degrees the way experienced people choose them.

1. TP stays inside a node (tp divides nprocPerNode, heads and kvHeads).
2. PP only when the model does not fit without it.
3. CP only when activations (long sequences) do not fit without it.
4. The rest goes to dpShard (dpReplicate stays 1 unless dpShard is fixed).

Among layouts that pass every check and fit the GPU's memory, the solver takes the one with the
fewest pipeline stages, then the least context parallelism, then the least tensor parallelism.
From LONG_SEQUENCE tokens on, context parallelism is preferred to tensor parallelism: it splits the
activations as well while moving only K/V.
When none fits it says so and names the layout that comes closest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tetrad.api.resolved import Layout, ModelConfig
from tetrad.api.spec import ParallelTrainingJobSpec
from tetrad.api.validation import Problem, check_layout, microbatches, stages_per_rank
from tetrad.plan.estimate import Estimate, GiB, Workload, estimate

# Leave room for the CUDA context, NCCL buffers and allocator fragmentation.
USABLE_MEMORY_FRACTION = 0.9
LONG_SEQUENCE = 32768


@dataclass
class Solution:
    layout: Layout | None
    estimate: Estimate | None
    reason: str = ""
    candidates: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    )


def usable_bytes(spec: ParallelTrainingJobSpec) -> float | None:
    """Memory budget per device, or None on CPU where the planner does not bound memory."""
    if spec.resources.gpu == 0:
        return None
    return spec.resources.gpu_memory_gib * GiB * USABLE_MEMORY_FRACTION


def _candidates(spec: ParallelTrainingJobSpec, cfg: ModelConfig) -> list[Layout]:
    p = spec.parallelism
    world = spec.nodes * spec.nproc_per_node

    def options(value: int | str, auto: list[int]) -> list[int]:
        return auto if value == "auto" else [int(value)]

    tp_auto = [d for d in _divisors(spec.nproc_per_node) if cfg.heads % d == 0 and cfg.kv_heads % d == 0]
    out = []
    for pp, cp, tp in itertools.product(options(p.pp, _divisors(world)), options(p.cp, _divisors(world)),
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
        layout = Layout(pp=int(p.pp), dp_replicate=int(p.dp_replicate), dp_shard=int(p.dp_shard), cp=int(p.cp), tp=int(p.tp))
        return Solution(layout, estimate(cfg, layout, workload(spec, layout)), candidates=1)

    budget = usable_bytes(spec)
    valid: list[tuple[Layout, Estimate]] = []
    for layout in _candidates(spec, cfg):
        problems: list[Problem] = []
        check_layout(spec, cfg, layout, problems)
        if any(pr.severity == "error" for pr in problems):
            continue
        valid.append((layout, estimate(cfg, layout, workload(spec, layout))))
    if not valid:
        return Solution(None, None, (
            f"no layout of {spec.nodes}x{spec.nproc_per_node} processes satisfies the fixed degrees and the model"
            f" (heads={cfg.heads}, kvHeads={cfg.kv_heads}, layers={cfg.layers}, seqLen={cfg.seq_len},"
            f" globalBatch={spec.training.global_batch}); fix more degrees explicitly or change the batch"))
    fitting = [(lay, est) for lay, est in valid if budget is None or est.peak_bytes <= budget]
    if fitting:
        long = cfg.seq_len >= LONG_SEQUENCE

        def preference(le: tuple[Layout, Estimate]) -> tuple[int, ...]:
            lay = le[0]
            split = (lay.tp, lay.cp) if long else (lay.cp, lay.tp)
            return (lay.pp, *split, lay.dp_replicate)

        layout, est = min(fitting, key=preference)
        return Solution(layout, est, candidates=len(valid))
    layout, est = min(valid, key=lambda le: le[1].peak_bytes)
    assert budget is not None
    return Solution(None, est, (
        f"no layout fits {spec.resources.gpu_memory_gib:g} GiB per GPU ({budget / GiB:.1f} GiB usable);"
        f" the closest is {layout.label()} at {est.peak_bytes / GiB:.1f} GiB per GPU;"
        " enable activation checkpointing, lower microBatch, or add nodes"), candidates=len(valid))
