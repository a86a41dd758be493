"""Gang-scheduling objects and pod fields for each scheduler.

builtin: every pod starts behind a scheduling gate the operator removes when the whole gang fits.
volcano: a PodGroup with minMember = nodes that the scheduler enforces.
coscheduling: the same per incarnation (scheduling.x-k8s.io): scheduler-plugins counts a group's
pods by label, terminating ones too, and its controller leaves a PodGroup Failed for good.
kueue: the pod-group labels and annotations of Kueue's pod integration.
workload: Kubernetes' own Workload (the policy) and, per incarnation, a PodGroup (gang minCount =
nodes) that every pod names in spec.schedulingGroup (scheduling.k8s.io/v1alpha2, 1.36 alpha).

gang.topologyKey keeps each pipeline stage's pods in one domain of a node label: where the stage
is the whole gang (pp=1) and the scheduler places whole groups by topology (workload, kueue,
volcano), through its own field; otherwise with a pod affinity per stage.
"""

from __future__ import annotations

from typing import Any

from tetrad.api import contract
from tetrad.api.quantity import scale_quantity
from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import ParallelTrainingJobSpec, Scheduler, TopologyMode
from tetrad.render import names

VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"  # its Workload per pod group, named after the group
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"  # "false" on one pod: the group is over
# Every pod of a gang is one role, one podset of Kueue's Workload: their requests, node selection and
# tolerations are the same by construction. Left to itself Kueue hashes each pod's shape, and rank
# 0's ports and each pipeline stage's pod affinity would split the gang into up to pp + 1 podsets
# (Kueue takes 8 at most, and its topology slices are counted per podset).
KUEUE_ROLE_HASH_ANNOTATION = "kueue.x-k8s.io/role-hash"
KUEUE_ROLE = "trainer"
KUEUE_TOPOLOGY_ANNOTATIONS = {TopologyMode.REQUIRED: "kueue.x-k8s.io/podset-required-topology",
                              TopologyMode.PREFERRED: "kueue.x-k8s.io/podset-preferred-topology"}
KUEUE_SLICE_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-slice-required-topology"
KUEUE_SLICE_SIZE_ANNOTATION = "kueue.x-k8s.io/podset-slice-size"
WORKLOAD_API_VERSION = "scheduling.k8s.io/v1alpha2"
WORKLOAD_TEMPLATE = "workers"
STAGE_LABEL = "tetrad.dev/pipeline-stage"

DEFAULT_SCHEDULER_NAMES = {Scheduler.VOLCANO: "volcano", Scheduler.COSCHEDULING: "scheduler-plugins-scheduler"}
# Schedulers whose group is one incarnation's: a restart's gang gets its own, the old one is deleted.
GROUP_PER_INCARNATION = frozenset({Scheduler.COSCHEDULING, Scheduler.WORKLOAD})


def gang_resources(spec: ParallelTrainingJobSpec) -> dict[str, str]:
    """The whole gang's requests: what the scheduler must find before any pod runs."""
    r = spec.resources
    out = {name: scale_quantity(value, spec.nodes) for name, value in (("cpu", r.cpu), ("memory", r.memory)) if value is not None}
    if r.gpu:
        out["nvidia.com/gpu"] = str(r.gpu * spec.nodes)
    return out


def pipeline_stage(cfg: ResolvedConfig, node_rank: int) -> int:
    """The pipeline stage of the pod's first process. The mesh is (pp, ..., tp), pp outermost, so a
    stage is a block of consecutive global ranks and therefore of consecutive pods."""
    return node_rank * cfg.nproc_per_node * cfg.layout.pp // cfg.world_size


def _native_topology(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig) -> bool:
    """The scheduler keeps the whole gang in one domain itself: the stage is the gang (pp=1)."""
    g = spec.gang
    if not g.topology_key or cfg.layout.pp != 1:
        return False
    if g.scheduler == Scheduler.WORKLOAD:  # its topology constraint has no preferred form
        return g.topology_mode == TopologyMode.REQUIRED
    return g.scheduler in (Scheduler.KUEUE, Scheduler.VOLCANO)


def _pod_group_meta(job: str, name: str, namespace: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {contract.LABEL_JOB: job, **(labels or {})}}


def workload(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, namespace: str,
             restart: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The incarnation's Workload and its PodGroup (the gang the scheduler places), for gang.scheduler=workload."""
    if spec.gang.scheduler != Scheduler.WORKLOAD:
        return None
    name = group_name(spec, job, restart)
    labels = {contract.LABEL_RESTART: str(restart)}
    native = _native_topology(spec, cfg)

    def group() -> dict[str, Any]:  # the template's policy; the PodGroup carries its own copy
        out: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": spec.nodes}}}
        if native:
            out["schedulingConstraints"] = {"topology": [{"key": spec.gang.topology_key}]}
        return out

    wl = {"apiVersion": WORKLOAD_API_VERSION, "kind": "Workload", "metadata": _pod_group_meta(job, name, namespace, labels),
          "spec": {"controllerRef": {"apiGroup": contract.API_VERSION.split("/")[0], "kind": contract.KIND, "name": job},
                   "podGroupTemplates": [{"name": WORKLOAD_TEMPLATE, **group()}]}}
    ref = {"workload": {"workloadName": name, "podGroupTemplateName": WORKLOAD_TEMPLATE}}
    pg = {"apiVersion": WORKLOAD_API_VERSION, "kind": "PodGroup", "metadata": _pod_group_meta(job, name, namespace, labels),
          "spec": {"podGroupTemplateRef": ref, **group()}}
    return wl, pg


def group_name(spec: ParallelTrainingJobSpec, job: str, restart: int) -> str:
    """The name of the gang's group: the PodGroup, or Kueue's pod group."""
    return names.incarnation(job, restart) if spec.gang.scheduler in GROUP_PER_INCARNATION else names.pod_group(job)


def pod_group(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, namespace: str,
              restart: int) -> dict[str, Any] | None:
    g = spec.gang
    labels = {contract.LABEL_RESTART: str(restart)} if g.scheduler in GROUP_PER_INCARNATION else None
    meta = _pod_group_meta(job, group_name(spec, job, restart), namespace, labels)
    if g.scheduler == Scheduler.VOLCANO:
        vspec: dict[str, Any] = {"minMember": spec.nodes, "minResources": gang_resources(spec), "queue": g.queue or "default"}
        if spec.template.priority_class_name:
            vspec["priorityClassName"] = spec.template.priority_class_name
        if _native_topology(spec, cfg):  # tier 1: the lowest HyperNode tier (e.g. one rack's switch)
            mode = "hard" if g.topology_mode == TopologyMode.REQUIRED else "soft"
            vspec["networkTopology"] = {"mode": mode, "highestTierAllowed": 1}
        return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": vspec}
    if g.scheduler == Scheduler.COSCHEDULING:
        return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": meta,
                "spec": {"minMember": spec.nodes, "minResources": gang_resources(spec),
                         "scheduleTimeoutSeconds": g.timeout_seconds}}
    return None


def apply_to_pod(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, pod: dict[str, Any], *,
                 rank: int, restart: int) -> None:
    """Add the scheduler's gang and topology fields to a rendered pod."""
    g = spec.gang
    meta, pod_spec = pod["metadata"], pod["spec"]
    scheduler_name = g.scheduler_name or DEFAULT_SCHEDULER_NAMES.get(g.scheduler)
    if scheduler_name:
        pod_spec["schedulerName"] = scheduler_name
    if g.scheduler == Scheduler.BUILTIN:
        pod_spec["schedulingGates"] = [{"name": contract.GANG_GATE}]
    elif g.scheduler == Scheduler.VOLCANO:
        meta["annotations"][VOLCANO_GROUP_ANNOTATION] = group_name(spec, job, restart)
        if g.queue:
            meta["annotations"]["volcano.sh/queue-name"] = g.queue
    elif g.scheduler == Scheduler.COSCHEDULING:
        meta["labels"][COSCHEDULING_GROUP_LABEL] = group_name(spec, job, restart)
    elif g.scheduler == Scheduler.KUEUE:
        assert g.queue, "validation requires gang.queue for kueue"
        meta["labels"][KUEUE_QUEUE_LABEL] = g.queue
        meta["labels"][KUEUE_GROUP_LABEL] = group_name(spec, job, restart)
        meta["annotations"][KUEUE_COUNT_ANNOTATION] = str(spec.nodes)
        meta["annotations"][KUEUE_ROLE_HASH_ANNOTATION] = KUEUE_ROLE
    elif g.scheduler == Scheduler.WORKLOAD:
        pod_spec["schedulingGroup"] = {"podGroupName": group_name(spec, job, restart)}
    if g.topology_key:
        _apply_topology(spec, cfg, job, pod, rank=rank, restart=restart)


def _apply_topology(spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, pod: dict[str, Any], *,
                    rank: int, restart: int) -> None:
    g, meta = spec.gang, pod["metadata"]
    assert g.topology_key
    stage = pipeline_stage(cfg, rank)
    meta["labels"][STAGE_LABEL] = str(stage)
    if g.scheduler == Scheduler.KUEUE and cfg.layout.pp == 1:
        meta["annotations"][KUEUE_TOPOLOGY_ANNOTATIONS[g.topology_mode]] = g.topology_key
    if _native_topology(spec, cfg):
        return
    if g.scheduler == Scheduler.KUEUE and g.topology_mode == TopologyMode.REQUIRED and spec.nodes % cfg.layout.pp == 0:
        meta["annotations"][KUEUE_SLICE_TOPOLOGY_ANNOTATION] = g.topology_key
        meta["annotations"][KUEUE_SLICE_SIZE_ANNOTATION] = str(spec.nodes // cfg.layout.pp)
    # The stage's pods of this incarnation attract each other within one domain of the key; the
    # first one placed picks the domain, and prefers one without the other stages' pods, so a
    # stage placed later does not take room an earlier one still needs.
    gang_pods = {contract.LABEL_JOB: job, contract.LABEL_RESTART: str(restart)}
    term = {"labelSelector": {"matchLabels": {**gang_pods, STAGE_LABEL: str(stage)}}, "topologyKey": g.topology_key}
    affinity = pod["spec"].setdefault("affinity", {})
    together = affinity.setdefault("podAffinity", {})
    if g.topology_mode == TopologyMode.REQUIRED:
        together.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        together.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append({"weight": 100, "podAffinityTerm": term})
    if cfg.layout.pp > 1:
        others = {"matchLabels": gang_pods, "matchExpressions": [{"key": STAGE_LABEL, "operator": "NotIn", "values": [str(stage)]}]}
        affinity.setdefault("podAntiAffinity", {}).setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 50, "podAffinityTerm": {"labelSelector": others, "topologyKey": g.topology_key}})
