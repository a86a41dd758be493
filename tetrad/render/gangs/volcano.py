"""volcano: a PodGroup with minMember = nodes that the Volcano scheduler enforces; the pods name it
by annotation. A one-stage gang's topology is the PodGroup's networkTopology (tier 1: the lowest
HyperNode tier, e.g. one rack's switch)."""

from __future__ import annotations

from typing import Any

from tetrad.api.spec import Scheduler, TopologyMode
from tetrad.render.gangs.backend import GangBackend, Incarnation, gang_resources

API_VERSION = "scheduling.volcano.sh/v1beta1"
GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
QUEUE_ANNOTATION = "volcano.sh/queue-name"


class Volcano(GangBackend):
    scheduler = Scheduler.VOLCANO
    scheduler_name = "volcano"
    topology_modes = frozenset(TopologyMode)

    def objects(self, inc: Incarnation) -> list[dict[str, Any]]:
        spec, g = inc.spec, inc.spec.gang
        group: dict[str, Any] = {"minMember": spec.nodes, "minResources": gang_resources(spec),
                                 "queue": g.queue or "default"}
        if spec.template.priority_class_name:
            group["priorityClassName"] = spec.template.priority_class_name
        if inc.own_domain:
            mode = "hard" if g.topology_mode == TopologyMode.REQUIRED else "soft"
            group["networkTopology"] = {"mode": mode, "highestTierAllowed": 1}
        return [{"apiVersion": API_VERSION, "kind": "PodGroup", "metadata": self.group_metadata(inc),
                 "spec": group}]

    def label_pod(self, inc: Incarnation, pod: dict[str, Any]) -> None:
        annotations = pod["metadata"]["annotations"]
        annotations[GROUP_ANNOTATION] = inc.group
        if inc.spec.gang.queue:
            annotations[QUEUE_ANNOTATION] = inc.spec.gang.queue
