"""An elastic job's sizes (spec.elastic): the same job on fewer pods.

At n pods the job keeps its resolved tp, cp and pp and its global batch; only the data-parallel
degrees change. dpShard is kept where it divides what is left (HSDP keeps its shard groups, and fewer
replicas run), otherwise every data-parallel rank shards (dpReplicate 1). The trainer accumulates
more micro batches per step and reshards the checkpoint on resume, so the run computes the same
updates (tests/checkpoint/test_trainer.py). Whether a size can run at all (the global batch divides,
the memory fits) is the resolver's to say: `tetrad.resolve.resolve` of `resized(job, layout, n)`.
"""

from __future__ import annotations

from tetrad.api.problems import counted
from tetrad.api.resolved import Layout
from tetrad.api.spec import ParallelTrainingJob, ParallelTrainingJobSpec


def indivisible(layout: Layout, world: int) -> str | None:
    """Why the layout cannot run on `world` ranks at any data-parallel degree, or None when it can."""
    fixed = layout.tp * layout.cp * layout.pp
    return f"tp x cp x pp = {fixed} does not divide {counted(world, 'process')}" if world % fixed else None


def degrees(layout: Layout, world: int) -> Layout | None:
    """The layout on `world` ranks, or None when it cannot run there (`indivisible`)."""
    if indivisible(layout, world) is not None:
        return None
    dp = world // (layout.tp * layout.cp * layout.pp)
    shard, replicate = layout.dp_shard, layout.dp_replicate
    if dp % shard == 0:
        replicate = dp // shard
    elif replicate > 1 and dp % replicate == 0:
        shard = dp // replicate
    else:
        shard, replicate = dp, 1
    return layout.model_copy(update={"dp_shard": shard, "dp_replicate": replicate})


def resized_spec(spec: ParallelTrainingJobSpec, layout: Layout, nodes: int) -> ParallelTrainingJobSpec:
    """The spec on `nodes` pods, its degrees pinned to `degrees` (the full layout's where the world
    does not divide: the resolver then names the problem)."""
    at = degrees(layout, nodes * spec.nproc_per_node) or layout
    pinned = {"dp_replicate": at.dp_replicate, "dp_shard": at.dp_shard, "tp": at.tp, "cp": at.cp, "pp": at.pp}
    return spec.model_copy(update={"nodes": nodes, "parallelism": spec.parallelism.model_copy(update=pinned)})


def resized(job: ParallelTrainingJob, layout: Layout, nodes: int) -> ParallelTrainingJob:
    """`job` on `nodes` pods; `layout` is its resolved layout at spec.nodes."""
    if nodes == job.spec.nodes:
        return job
    return job.model_copy(update={"spec": resized_spec(job.spec, layout, nodes)})
