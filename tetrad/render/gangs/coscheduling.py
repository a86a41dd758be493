"""coscheduling (scheduler-plugins): a PodGroup per incarnation (scheduling.x-k8s.io) that the pods
name by label. scheduler-plugins counts a group's pods by label, terminating ones too, and its
controller leaves a PodGroup Failed for good: each restart's gang gets a new one."""

from __future__ import annotations

from typing import Any

from tetrad.api.spec import Scheduler
from tetrad.render.gangs.backend import GangBackend, Incarnation, gang_resources

API_VERSION = "scheduling.x-k8s.io/v1alpha1"
GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


class Coscheduling(GangBackend):
    scheduler = Scheduler.COSCHEDULING
    scheduler_name = "scheduler-plugins-scheduler"
    group_per_incarnation = True

    def objects(self, inc: Incarnation) -> list[dict[str, Any]]:
        spec = inc.spec
        return [{"apiVersion": API_VERSION, "kind": "PodGroup", "metadata": self.group_metadata(inc),
                 "spec": {"minMember": spec.nodes, "minResources": gang_resources(spec),
                          "scheduleTimeoutSeconds": spec.gang.timeout_seconds}}]

    def label_pod(self, inc: Incarnation, pod: dict[str, Any]) -> None:
        pod["metadata"]["labels"][GROUP_LABEL] = inc.group
