"""Gang-scheduling objects and pod fields for each scheduler.

builtin: every pod starts behind a scheduling gate the operator removes when the whole gang fits.
volcano / coscheduling: a PodGroup with minMember = nodes that the scheduler enforces.
kueue: the pod-group labels and annotations of Kueue's pod integration.
"""

from __future__ import annotations

from typing import Any

from tetrad.api import contract
from tetrad.api.quantity import scale_quantity
from tetrad.api.spec import ParallelTrainingJobSpec, Scheduler
from tetrad.render import names

VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"

DEFAULT_SCHEDULER_NAMES = {Scheduler.VOLCANO: "volcano", Scheduler.COSCHEDULING: "scheduler-plugins-scheduler"}


def gang_resources(spec: ParallelTrainingJobSpec) -> dict[str, str]:
    """The whole gang's requests: what the scheduler must find before any pod runs."""
    r = spec.resources
    out = {name: scale_quantity(value, spec.nodes) for name, value in (("cpu", r.cpu), ("memory", r.memory)) if value is not None}
    if r.gpu:
        out["nvidia.com/gpu"] = str(r.gpu * spec.nodes)
    return out


def pod_group(spec: ParallelTrainingJobSpec, job: str, namespace: str) -> dict[str, Any] | None:
    g = spec.gang
    meta = {"name": names.pod_group(job), "namespace": namespace, "labels": {contract.LABEL_JOB: job}}
    if g.scheduler == Scheduler.VOLCANO:
        vspec: dict[str, Any] = {"minMember": spec.nodes, "minResources": gang_resources(spec), "queue": g.queue or "default"}
        if spec.template.priority_class_name:
            vspec["priorityClassName"] = spec.template.priority_class_name
        return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": vspec}
    if g.scheduler == Scheduler.COSCHEDULING:
        return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": meta,
                "spec": {"minMember": spec.nodes, "minResources": gang_resources(spec),
                         "scheduleTimeoutSeconds": g.timeout_seconds}}
    return None


def apply_to_pod(spec: ParallelTrainingJobSpec, job: str, pod: dict[str, Any]) -> None:
    """Add the scheduler's gang fields to a rendered pod."""
    g = spec.gang
    meta, pod_spec = pod["metadata"], pod["spec"]
    scheduler_name = g.scheduler_name or DEFAULT_SCHEDULER_NAMES.get(g.scheduler)
    if scheduler_name:
        pod_spec["schedulerName"] = scheduler_name
    if g.scheduler == Scheduler.BUILTIN:
        pod_spec["schedulingGates"] = [{"name": contract.GANG_GATE}]
    elif g.scheduler == Scheduler.VOLCANO:
        meta["annotations"][VOLCANO_GROUP_ANNOTATION] = names.pod_group(job)
        if g.queue:
            meta["annotations"]["volcano.sh/queue-name"] = g.queue
    elif g.scheduler == Scheduler.COSCHEDULING:
        meta["labels"][COSCHEDULING_GROUP_LABEL] = names.pod_group(job)
    elif g.scheduler == Scheduler.KUEUE:
        assert g.queue, "validation requires gang.queue for kueue"
        meta["labels"][KUEUE_QUEUE_LABEL] = g.queue
        meta["labels"][KUEUE_GROUP_LABEL] = names.pod_group(job)
        meta["annotations"][KUEUE_COUNT_ANNOTATION] = str(spec.nodes)
