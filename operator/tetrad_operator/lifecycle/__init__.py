"""The job's state machine, as one pure function.

    decide(job body, observed pods, observed nodes, now) -> Decision(status, actions, events, ...)

It reads only its arguments, so every transition is unit-testable and any handler can call it
again at any time: the actions it returns are idempotent (deterministic names, create-if-absent,
delete-if-present), and everything it must remember lives in the job's status or in the pods'
restart label. That is what makes the operator safe to kill at any moment.

Phases: Pending -> GangWaiting -> Running -> Succeeded, with Restarting between gang incarnations,
Failed at any point and Suspended while spec.runPolicy.suspend is true. Each phase has a
condition of the same type; exactly the current phase's condition is True.

- actions.py: the actions, events and the Decision;
- machine.py: one pass (`JobPass`): transitions, lost nodes, deletions, the job's end; the tunables;
- policy.py: the failure and restart policy (what fails the job, what restarts the gang, backoff);
- release.py: the built-in gang's gates, release and timeout;
- checkpoint.py: a suspend that lets the trainer save first, and checkpoint-now requests;
- figures.py: the last figures rank 0 left in its termination message, into the status;
- goodput.py: status.goodput, the ledger of the job's wall time, settled at each phase change;
- core.py: `decide`, the phases in order.
"""

from tetrad.api.spec import RunPolicy
from tetrad_operator.lifecycle.actions import (
    Action,
    AnnotatePod,
    AskInPlace,
    CreatePod,
    Decision,
    DeleteJob,
    DeletePod,
    DeleteStaleGang,
    Ensure,
    Event,
    Ungate,
)
from tetrad_operator.lifecycle.core import PodRejection, ResolvedJob, decide, resolve_job
from tetrad_operator.lifecycle.machine import Settings
from tetrad_operator.lifecycle.policy import backoff_seconds

__all__ = [
    "Action", "AnnotatePod", "AskInPlace", "CreatePod", "Decision", "DeleteJob", "DeletePod",
    "DeleteStaleGang", "Ensure", "Event", "PodRejection", "ResolvedJob",
    "RunPolicy", "Settings", "Ungate", "backoff_seconds", "decide", "resolve_job",
]
