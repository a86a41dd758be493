"""Kueue's pod group at the end of a job: Kueue holds the finalizer of a group's failed or deleted
pods until new pods replace them, or until a pod of the group says none will
(`kueue.x-k8s.io/retriable-in-group: "false"`); then it finishes the group's Workload and lets
the pods go. A job that failed or is deleted says so on one of them (a job that succeeded needs
not: Kueue finishes a group whose pods all succeeded)."""

from __future__ import annotations

from collections.abc import Sequence

from tetrad.api.spec import ParallelTrainingJobSpec, Scheduler
from tetrad.render.gang import KUEUE_RETRIABLE_ANNOTATION
from tetrad_operator.lifecycle.actions import AnnotatePod
from tetrad_operator.observed import PodState


def closing(spec: ParallelTrainingJobSpec, pods: Sequence[PodState]) -> list[AnnotatePod]:
    """The annotation that closes the job's Kueue pod group, unless a pod has it already."""
    if spec.gang.scheduler != Scheduler.KUEUE or not pods or any(p.queue_group_closed for p in pods):
        return []
    return [AnnotatePod(pods[0].name, pods[0].uid, {KUEUE_RETRIABLE_ANNOTATION: "false"})]
