"""builtin: Tetrad's own gang. Every pod starts behind the scheduling gate contract.GANG_GATE, and
the operator's one admission loop removes a whole gang's gates once all of it fits on the free
capacity (tetrad_operator.admission); the default scheduler then places the pods."""

from __future__ import annotations

from typing import Any

from tetrad.api import contract
from tetrad.api.spec import Scheduler
from tetrad.render.gangs.backend import GangBackend, Incarnation


class Builtin(GangBackend):
    scheduler = Scheduler.BUILTIN
    operator_admits = True

    def label_pod(self, inc: Incarnation, pod: dict[str, Any]) -> None:
        pod["spec"]["schedulingGates"] = [{"name": contract.GANG_GATE}]
