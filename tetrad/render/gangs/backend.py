"""The gang backend protocol: what one gang scheduler adds to a gang incarnation, and what the
operator must know of it. Each backend is one module of this package with one `GangBackend`,
registered under its gang.scheduler in `tetrad.render.gangs.BACKENDS`.

The render side is pure and serves every consumer of the renderer: the group objects of an
incarnation (`objects`) and the fields its pods carry (`label_pod`). The operator side is plain
facts and pure readings the operator acts on: whether Tetrad's own admission releases the gang,
whether each incarnation has a group of its own, where the scheduler says why a gang waits, what
tells it a failed or deleted job's group is over, and the pod condition it sets on pods it takes
away. The core never imports the operator; the operator reads these through the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tetrad.api import contract
from tetrad.api.quantity import scale_quantity
from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import ParallelTrainingJobSpec, Scheduler, TopologyMode
from tetrad.render import names


def gang_resources(spec: ParallelTrainingJobSpec) -> dict[str, str]:
    """The whole gang's requests: what the scheduler must find before any pod runs."""
    r = spec.resources
    out = {name: scale_quantity(value, spec.nodes) for name, value in (("cpu", r.cpu), ("memory", r.memory))
           if value is not None}
    if r.gpu:
        out["nvidia.com/gpu"] = str(r.gpu * spec.nodes)
    return out


@dataclass(frozen=True)
class Incarnation:
    """One incarnation of a job's gang, as its backend renders it."""

    spec: ParallelTrainingJobSpec
    config: ResolvedConfig
    job: str
    namespace: str
    restart: int
    group: str  # the name of the gang's group: its PodGroup, Kueue's pod group
    own_domain: bool  # the scheduler keeps the whole gang in one domain of gang.topologyKey by its own field


class GangBackend:
    """One gang scheduler; the defaults are a scheduler that needs nothing of the kind."""

    scheduler: Scheduler
    scheduler_name: str | None = None  # the pods' schedulerName unless gang.schedulerName names one
    operator_admits: bool = False  # pods start behind Tetrad's gate, and its admission releases whole gangs
    group_per_incarnation: bool = False  # a restart's gang gets a group of its own; the old ones are deleted
    # The gang.topologyMode values in which it keeps a one-stage gang (pp=1) in one domain by its own field.
    topology_modes: frozenset[TopologyMode] = frozenset()
    # (apiVersion, plural) of its object, named after the group, that says why it holds a gang.
    queue_object: tuple[str, str] | None = None
    # The annotation that, on one of a failed or deleted job's pods, tells it no pod will replace them.
    closing_annotation: tuple[str, str] | None = None
    # A pod condition of its own meaning "taken away by the cluster" (its message says why).
    disruption_condition: str | None = None

    def group_name(self, job: str, restart: int) -> str:
        return names.incarnation(job, restart) if self.group_per_incarnation else names.pod_group(job)

    def keeps_domain(self, spec: ParallelTrainingJobSpec, cfg: ResolvedConfig) -> bool:
        """Whether it keeps the whole gang in one domain itself: the stage is the gang (pp=1)."""
        g = spec.gang
        return bool(g.topology_key) and cfg.layout.pp == 1 and g.topology_mode in self.topology_modes

    def incarnation(self, spec: ParallelTrainingJobSpec, cfg: ResolvedConfig, job: str, namespace: str,
                    restart: int) -> Incarnation:
        return Incarnation(spec, cfg, job, namespace, restart, self.group_name(job, restart),
                           self.keeps_domain(spec, cfg))

    def objects(self, inc: Incarnation) -> list[dict[str, Any]]:
        """The incarnation's group objects, in the order they are created."""
        return []

    def label_pod(self, inc: Incarnation, pod: dict[str, Any]) -> None:
        """Add the scheduler's fields to one of the incarnation's rendered pods."""

    def queued_reason(self, obj: Mapping[str, Any] | None) -> str | None:
        """Why the scheduler holds the gang, read from its `queue_object` (None: it does not say)."""
        return None

    def group_metadata(self, inc: Incarnation) -> dict[str, Any]:
        labels = {contract.LABEL_JOB: inc.job}
        if self.group_per_incarnation:
            labels[contract.LABEL_RESTART] = str(inc.restart)
        return {"name": inc.group, "namespace": inc.namespace, "labels": labels}
