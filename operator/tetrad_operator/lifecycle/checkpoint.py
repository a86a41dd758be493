"""The checkpoint side of the lifecycle: a suspend that lets the trainer save first, and
checkpoint-now requests forwarded to rank 0.

Suspend: the pods are deleted with their grace period, so the kubelet's SIGTERM reaches the trainer,
which finishes its step, saves and exits 75 (tetrad_trainer.preemption); rank 0 leaves the step it
committed in its termination message. The job is Suspended at once (reason Suspending) and, once
every pod is gone, Suspended with the saved step in the condition, an Event and status.checkpoint.
No failure is judged meanwhile, so a suspend spends neither maxRestarts nor maxDisruptions; a resume
recreates the same incarnation (status.restarts is unchanged), whose trainer resumes from the step.

checkpoint-now: a new token in the job's annotation is copied onto rank 0's running pod, once
(status.checkpoint.requested records it); the trainer saves at its next step and the scraper
reports the commit in status.checkpoint.requestCommitted.
"""

from __future__ import annotations

from datetime import UTC, datetime

from tetrad.api import contract
from tetrad.api.spec import CheckpointStatus, ParallelTrainingJob, Phase
from tetrad_operator.lifecycle import figures, release
from tetrad_operator.lifecycle.actions import AnnotatePod, Event
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, format_time


def recorded(m: JobPass) -> CheckpointStatus:
    """status.checkpoint as read (the scraper's and earlier passes' writes)."""
    return m.read.checkpoint or CheckpointStatus()


def suspend(m: JobPass, job: ParallelTrainingJob) -> None:
    """spec.runPolicy.suspend is true, or the suspend's pods are still going: let them save, then go."""
    spec = job.spec
    if m.phase != Phase.SUSPENDED:
        if m.phase == Phase.RUNNING and any(not p.terminal for p in m.pods):
            m.transition(Phase.SUSPENDED, "Suspending",
                         "spec.runPolicy.suspend is true: the pods are deleted "
                         f"with their grace period ({spec.run_policy.termination_grace_period_seconds}s), "
                         + ("in which the trainer saves a checkpoint and exits" if spec.checkpoint.enabled
                            else "and checkpointing is off (spec.checkpoint.enabled=false): the training "
                                 "state is lost"))
        else:
            m.transition(Phase.SUSPENDED, "Suspended",
                         "spec.runPolicy.suspend is true: pods deleted, the job is kept")
        m.status.start_time = None
        release.withdraw(m, "Suspended", "the job is suspended")
    restart = m.status.restarts
    rank0 = next((p for p in m.pods if p.rank == 0 and p.restart == restart and p.message), None)
    figures.record_left(m, job, rank0)
    if spec.checkpoint.enabled:
        _record_saved(m, job, rank0)
    if m.pods:
        m.delete(m.pods)
        return
    if (suspended := m.condition(Phase.SUSPENDED)) is not None and suspended.reason == "Suspending":
        m.transition(Phase.SUSPENDED, "Suspended", f"the pods are gone; {_saved_note(m, job)}")


def _record_saved(m: JobPass, job: ParallelTrainingJob, rank0: PodState | None) -> None:
    """Rank 0's termination message says which step it committed last: into status.checkpoint."""
    if rank0 is None or (step := rank0.said.checkpoint_step) is None or recorded(m).step == step:
        return
    at = rank0.said.checkpoint_time
    m.checkpoint.step, m.checkpoint.path = step, contract.step_path(job.spec.checkpoint.path, step)
    # committed by an earlier process when absent: its time is unknown here
    m.checkpoint.time = format_time(datetime.fromtimestamp(at, UTC)) if at is not None else None


def _saved_note(m: JobPass, job: ParallelTrainingJob) -> str:
    if not job.spec.checkpoint.enabled:
        return ("checkpointing is off (spec.checkpoint.enabled=false): the training state is lost, "
                "a resume starts from step 0")
    step = m.checkpoint.step
    if step is None:
        return "no checkpoint was committed: a resume starts from step 0"
    return f"the last committed checkpoint is step {step} (status.checkpoint); a resume continues from it"


def resumed(m: JobPass, job: ParallelTrainingJob) -> None:
    """suspend is false again: the same incarnation is created anew and resumes from the last checkpoint."""
    step = recorded(m).step
    where = (f"; the trainer resumes from checkpoint step {step}"
             if job.spec.checkpoint.enabled and step is not None else "")
    m.transition(Phase.PENDING, "Resumed", f"the job was resumed{where}")
    m.status.start_time = None
    # The resume of the gone incarnation no longer describes the job: the new one reports its own.
    m.checkpoint.resumed_from = m.checkpoint.resumed_at_restart = None


def forward_request(m: JobPass, job: ParallelTrainingJob, rank0: PodState) -> None:
    """A checkpoint-now token not forwarded yet: onto rank 0's running pod, whose trainer saves at its
    next step."""
    token = (m.meta.get("annotations") or {}).get(contract.ANNOTATION_CHECKPOINT_NOW)
    if not token or recorded(m).requested == token or rank0.phase != "Running" or rank0.deleting:
        return
    m.checkpoint.requested = token
    if not job.spec.checkpoint.enabled:
        m.decision.events.append(Event("Warning", "CheckpointNotConfigured",
                                       f"checkpoint-now {token!r} ignored: "
                                       "checkpointing is off (spec.checkpoint.enabled=false)"))
        return
    if rank0.checkpoint_request != token:
        m.decision.actions.append(AnnotatePod(rank0.name, rank0.uid,
                                              {contract.ANNOTATION_CHECKPOINT_NOW: token}))
    m.decision.events.append(Event("Normal", "CheckpointRequested", f"checkpoint-now {token!r}: asked rank 0 "
                                   f"({rank0.name}) to save a checkpoint after its next step"))
