"""What tells the gang scheduler at a job's end that no pod will replace the job's pods (its
backend's `closing_annotation`, on one pod). Kueue holds the finalizer of a group's failed or
deleted pods until new pods replace them, or until a pod of the group says none will; then it
finishes the group's Workload and lets the pods go. A job that failed or is deleted says so (a job
that succeeded needs not: Kueue finishes a group whose pods all succeeded)."""

from __future__ import annotations

from collections.abc import Sequence

from tetrad.api.spec import ParallelTrainingJobSpec
from tetrad.render import gangs
from tetrad_operator.lifecycle.actions import AnnotatePod
from tetrad_operator.observed import PodState


def close_group(spec: ParallelTrainingJobSpec, pods: Sequence[PodState]) -> list[AnnotatePod]:
    """The annotation that closes the job's group, unless a pod has it already."""
    mark = gangs.backend(spec).closing_annotation
    if mark is None or not pods or any(p.group_closed for p in pods):
        return []
    key, value = mark
    return [AnnotatePod(pods[0].name, pods[0].uid, {key: value})]
