"""From a validated job to the trainer's resolved config."""

from __future__ import annotations

from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import ParallelTrainingJob
from tetrad.api.validation import InvalidJob, check_spec, microbatches, stages_per_rank


def resolve(job: ParallelTrainingJob) -> ResolvedConfig:
    """Solve every `auto`, expand the preset; raise InvalidJob listing every problem."""
    spec = job.spec
    checked = check_spec(spec)
    if not checked.ok:
        raise InvalidJob(checked.problems)
    cfg, layout = checked.model, checked.solution.layout if checked.solution else None
    assert cfg is not None and layout is not None, "check_spec admitted an unsolvable job"
    return ResolvedConfig(
        job_name=job.metadata.name,
        namespace=job.metadata.namespace,
        nodes=spec.nodes,
        nproc_per_node=spec.nproc_per_node,
        layout=layout,
        pp_schedule=spec.parallelism.pp_schedule,
        pp_microbatches=microbatches(spec, layout),
        pp_stages_per_rank=stages_per_rank(spec) if layout.pp > 1 else 1,
        model=cfg,
        training=spec.training,
        data=spec.data,
        checkpoint=spec.checkpoint,
        metrics=spec.metrics,
        gpu_type=spec.resources.gpu_type,
        use_gpu=spec.resources.gpu > 0,
    )
