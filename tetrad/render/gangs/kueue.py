"""kueue: the pod-group labels and annotations of Kueue's pod integration. Kueue makes a Workload
per pod group (named after the group) and admits the group once its queue has quota; its
QuotaReserved condition says why it waits. It holds the finalizer of a group's failed or deleted
pods until new pods replace them, or until a pod of the group says none will
(RETRIABLE_ANNOTATION "false"): a job that fails or is deleted says so on one pod. It marks the
pods of a group it stops (preempted, evicted) with a condition of its own, STOP_CONDITION.

Topology: a one-stage gang's podset topology annotation; pipeline stages as podset slices of a
stage's pods each, when gang.topologyMode is Required and the stages are whole pods."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tetrad.api.spec import Scheduler, TopologyMode
from tetrad.render.gangs.backend import GangBackend, Incarnation

API_VERSION = "kueue.x-k8s.io/v1beta2"  # its Workload per pod group, named after the group
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"  # "false" on one pod: the group is over
STOP_CONDITION = "TerminationTarget"
# Every pod of a gang is one role, one podset of Kueue's Workload: their requests, node selection and
# tolerations are the same by construction. Left to itself Kueue hashes each pod's shape, and rank
# 0's ports and each pipeline stage's pod affinity would split the gang into up to pp + 1 podsets
# (Kueue takes 8 at most, and its topology slices are counted per podset).
ROLE_HASH_ANNOTATION = "kueue.x-k8s.io/role-hash"
ROLE = "trainer"
TOPOLOGY_ANNOTATIONS = {TopologyMode.REQUIRED: "kueue.x-k8s.io/podset-required-topology",
                        TopologyMode.PREFERRED: "kueue.x-k8s.io/podset-preferred-topology"}
SLICE_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-slice-required-topology"
SLICE_SIZE_ANNOTATION = "kueue.x-k8s.io/podset-slice-size"


class Kueue(GangBackend):
    scheduler = Scheduler.KUEUE
    topology_modes = frozenset(TopologyMode)
    queue_object = (API_VERSION, "workloads")
    closing_annotation = (RETRIABLE_ANNOTATION, "false")
    disruption_condition = STOP_CONDITION

    def label_pod(self, inc: Incarnation, pod: dict[str, Any]) -> None:
        spec, g, pp = inc.spec, inc.spec.gang, inc.config.layout.pp
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert g.queue, "validation requires gang.queue for kueue"
        labels[QUEUE_LABEL] = g.queue
        labels[GROUP_LABEL] = inc.group
        annotations[COUNT_ANNOTATION] = str(spec.nodes)
        annotations[ROLE_HASH_ANNOTATION] = ROLE
        if not g.topology_key:
            return
        if inc.own_domain:
            annotations[TOPOLOGY_ANNOTATIONS[g.topology_mode]] = g.topology_key
        elif g.topology_mode == TopologyMode.REQUIRED and spec.nodes % pp == 0:
            annotations[SLICE_TOPOLOGY_ANNOTATION] = g.topology_key
            annotations[SLICE_SIZE_ANNOTATION] = str(spec.nodes // pp)

    def queued_reason(self, obj: Mapping[str, Any] | None) -> str | None:
        """Its Workload's QuotaReserved=False message."""
        reserved = next((c for c in ((obj or {}).get("status") or {}).get("conditions") or []
                         if c.get("type") == "QuotaReserved"), None)
        if reserved is None or reserved.get("status") != "False":
            return None
        return str(reserved.get("message") or reserved.get("reason") or "no quota reserved")
