"""gang.topologyKey for every backend: each pipeline stage's pods in one domain of a node label.
Where the stage is the whole gang (pp=1) and the scheduler places whole groups by topology, its
own field carries it (`Incarnation.own_domain`, the backends' `topology_modes`); otherwise a pod
affinity per stage."""

from __future__ import annotations

from typing import Any

from tetrad.api import contract
from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import TopologyMode
from tetrad.render.gangs.backend import Incarnation

STAGE_LABEL = "tetrad.dev/pipeline-stage"


def pipeline_stage(cfg: ResolvedConfig, node_rank: int) -> int:
    """The pipeline stage of the pod's first process. The mesh is (pp, ..., tp), pp outermost, so a
    stage is a block of consecutive global ranks and therefore of consecutive pods."""
    return node_rank * cfg.nproc_per_node * cfg.layout.pp // cfg.world_size


def keep_stage_together(inc: Incarnation, pod: dict[str, Any], rank: int) -> None:
    g, cfg = inc.spec.gang, inc.config
    assert g.topology_key
    stage = pipeline_stage(cfg, rank)
    pod["metadata"]["labels"][STAGE_LABEL] = str(stage)
    if inc.own_domain:
        return
    # The stage's pods of this incarnation attract each other within one domain of the key; the
    # first one placed picks the domain, and prefers one without the other stages' pods, so a
    # stage placed later does not take room an earlier one still needs.
    gang_pods = {contract.LABEL_JOB: inc.job, contract.LABEL_RESTART: str(inc.restart)}
    term = {"labelSelector": {"matchLabels": {**gang_pods, STAGE_LABEL: str(stage)}},
            "topologyKey": g.topology_key}
    affinity = pod["spec"].setdefault("affinity", {})
    together = affinity.setdefault("podAffinity", {})
    if g.topology_mode == TopologyMode.REQUIRED:
        together.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        together.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "podAffinityTerm": term})
    if cfg.layout.pp > 1:
        others = {"matchLabels": gang_pods,
                  "matchExpressions": [{"key": STAGE_LABEL, "operator": "NotIn", "values": [str(stage)]}]}
        affinity.setdefault("podAntiAffinity", {}).setdefault(
            "preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 50, "podAffinityTerm": {"labelSelector": others, "topologyKey": g.topology_key}})
