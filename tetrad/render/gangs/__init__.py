"""Gang scheduling as plug-ins: one module per gang.scheduler, each holding a `GangBackend`
(backend.py, the protocol), registered in BACKENDS. The renderer asks for an incarnation's group
objects (`objects`) and each pod's fields (`apply_to_pod`); the operator asks `backend(spec)` what
the job's scheduler needs of it (tetrad_operator never names a scheduler).

A new scheduler: its value in tetrad.api.spec.Scheduler, a module here with its GangBackend, its
line in BACKENDS, and the chart's RBAC for its objects (docs/architecture.md, "Gang backends").
"""

from __future__ import annotations

from typing import Any

from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import ParallelTrainingJobSpec, Scheduler
from tetrad.render.gangs import builtin, coscheduling, kueue, volcano, workload
from tetrad.render.gangs.backend import GangBackend, Incarnation, gang_resources
from tetrad.render.gangs.topology import STAGE_LABEL, keep_stage_together, pipeline_stage

BACKENDS: dict[Scheduler, GangBackend] = {b.scheduler: b for b in (
    builtin.Builtin(),
    volcano.Volcano(),
    coscheduling.Coscheduling(),
    kueue.Kueue(),
    workload.Workload(),
)}
# What the operator reads off any pod, whatever its job's scheduler.
DISRUPTION_CONDITIONS = frozenset(b.disruption_condition for b in BACKENDS.values() if b.disruption_condition)
CLOSING_ANNOTATIONS = frozenset(b.closing_annotation for b in BACKENDS.values() if b.closing_annotation)

__all__ = ["BACKENDS", "CLOSING_ANNOTATIONS", "DISRUPTION_CONDITIONS", "STAGE_LABEL", "GangBackend",
           "Incarnation", "apply_to_pod", "backend", "gang_resources", "group_name", "objects",
           "pipeline_stage"]


def backend(spec: ParallelTrainingJobSpec) -> GangBackend:
    return BACKENDS[spec.gang.scheduler]


def group_name(spec: ParallelTrainingJobSpec, job: str, restart: int) -> str:
    """The name of the gang's group: the PodGroup, or Kueue's pod group."""
    return backend(spec).group_name(job, restart)


def objects(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, namespace: str,
            restart: int) -> list[dict[str, Any]]:
    """The incarnation's group objects, in the order they are created."""
    b = backend(spec)
    return b.objects(b.incarnation(spec, cfg, job, namespace, restart))


def apply_to_pod(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, pod: dict[str, Any], *,
                 rank: int, restart: int) -> None:
    """Add the scheduler's gang and topology fields to a rendered pod."""
    b = backend(spec)
    inc = b.incarnation(spec, cfg, job, pod["metadata"]["namespace"], restart)
    if scheduler_name := spec.gang.scheduler_name or b.scheduler_name:
        pod["spec"]["schedulerName"] = scheduler_name
    b.label_pod(inc, pod)
    if spec.gang.topology_key:
        keep_stage_together(inc, pod, rank)
