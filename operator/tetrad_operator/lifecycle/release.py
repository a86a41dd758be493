"""The built-in gang's decisions: hold the gang behind its scheduling gates until it is complete
and the admission releases it, finish a release that stopped part-way, and re-gate a released
gang the scheduler could not place within gang.timeoutSeconds.

The GangReleased condition records where the gang stands (its transition time dates the
timeout). Whether the gang fits is not decided here: a complete, gated gang is handed to the
operator's one admission loop as `Decision.gang` (see tetrad_operator.admission).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tetrad.api.spec import ParallelTrainingJob, Phase
from tetrad_operator.lifecycle.actions import Ungate
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, parse_time
from tetrad_operator.packing import GangRequest

RELEASED = "GangReleased"


def timed_out(m: JobPass) -> bool:
    """The last release timed out: the gang is being re-created behind its gates."""
    c = m.condition(RELEASED)
    return c is not None and c.status == "False" and c.reason == "GangTimeout"


def creating(m: JobPass, nodes: int, restart: int, new: Sequence[Mapping[str, Any]] = ()) -> None:
    """The incarnation's pods are being created (gated). `new`: every pod of a new incarnation, which
    the admission may create released if the gang fits at once; never right after a gang timeout,
    when the scheduler could not place what the fit had released (the gang waits gated instead)."""
    released = m.condition(RELEASED)
    if released is None or released.status == "True":
        m.set_condition(RELEASED, "False", "Creating", f"creating the {nodes} pods of restart {restart}")
    if new and not timed_out(m):
        created = parse_time(m.meta.get("creationTimestamp"))
        m.decision.release_at_creation = GangRequest(m.namespace, m.name, created, restart,
                                                     tuple(PodState.from_body(p) for p in new))


def withdraw(m: JobPass, reason: str, message: str) -> None:
    """The gang goes away (restart, suspend): a recorded release no longer holds."""
    if m.condition(RELEASED):
        m.set_condition(RELEASED, "False", reason, message)


def drive(m: JobPass, job: ParallelTrainingJob, pods: list[PodState], restart: int) -> bool:
    """Drive the scheduling gates of a complete gang; True when this step decided the pass's outcome."""
    spec = job.spec
    gated = [p for p in pods if p.gated]
    if len(gated) == len(pods):
        if m.phase != Phase.GANG_WAITING:
            m.transition(Phase.GANG_WAITING, "WaitingForCapacity",
                         f"all {spec.nodes} pods are gated until the whole gang fits on the free capacity")
        m.set_condition(RELEASED, "False", "WaitingForCapacity",
                        "waiting until free allocatable resources fit every pod")
        created = parse_time(m.meta.get("creationTimestamp"))
        m.decision.gang = GangRequest(m.namespace, m.name, created, restart, tuple(pods))
        return True
    if gated:  # released part-way (the operator stopped mid-release): finish the release, unpinned
        # (a stage's pods released already hold its rack, and its pod affinity brings the rest there)
        m.decision.actions.append(Ungate(tuple((p.name, p.uid) for p in gated)))
    m.set_condition(RELEASED, "True", "Admitted", "the whole gang fits; scheduling gates removed")
    unbound = [p for p in pods if p.node is None and not p.terminal]
    if not unbound:
        return False
    waited = (m.now - m.since(RELEASED)).total_seconds()
    timeout = spec.gang.timeout_seconds
    if waited < timeout:
        m.decision.after(timeout - waited)
        return False
    message = (f"{len(unbound)} of {spec.nodes} pods were still unscheduled {timeout}s after release; "
               "re-creating the gang behind its gate")
    m.set_condition(RELEASED, "False", "GangTimeout", message)
    m.transition(Phase.GANG_WAITING, "GangTimeout", message, warning=True)
    m.delete(pods)
    return True
