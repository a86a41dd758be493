"""workload: Kubernetes' own gang scheduling (scheduling.k8s.io/v1alpha2, alpha in 1.36 behind the
GangScheduling gate). Each incarnation gets a Workload (the policy) and a PodGroup (gang minCount =
nodes) that every pod names in spec.schedulingGroup; the Workload is created first, since the API
admits a PodGroup only once its Workload exists. Its topology constraint has no preferred form."""

from __future__ import annotations

from typing import Any

from tetrad.api import contract
from tetrad.api.spec import Scheduler, TopologyMode
from tetrad.render.gangs.backend import GangBackend, Incarnation

API_VERSION = "scheduling.k8s.io/v1alpha2"
TEMPLATE = "workers"


class Workload(GangBackend):
    scheduler = Scheduler.WORKLOAD
    group_per_incarnation = True
    topology_modes = frozenset({TopologyMode.REQUIRED})

    def objects(self, inc: Incarnation) -> list[dict[str, Any]]:
        def group() -> dict[str, Any]:  # the template's policy; the PodGroup carries its own copy
            out: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": inc.spec.nodes}}}
            if inc.own_domain:
                out["schedulingConstraints"] = {"topology": [{"key": inc.spec.gang.topology_key}]}
            return out

        workload = {"apiVersion": API_VERSION, "kind": "Workload", "metadata": self.group_metadata(inc),
                    "spec": {"controllerRef": {"apiGroup": contract.API_VERSION.split("/")[0],
                                               "kind": contract.KIND, "name": inc.job},
                             "podGroupTemplates": [{"name": TEMPLATE, **group()}]}}
        ref = {"workload": {"workloadName": inc.group, "podGroupTemplateName": TEMPLATE}}
        pod_group = {"apiVersion": API_VERSION, "kind": "PodGroup", "metadata": self.group_metadata(inc),
                     "spec": {"podGroupTemplateRef": ref, **group()}}
        return [workload, pod_group]

    def label_pod(self, inc: Incarnation, pod: dict[str, Any]) -> None:
        pod["spec"]["schedulingGroup"] = {"podGroupName": inc.group}
