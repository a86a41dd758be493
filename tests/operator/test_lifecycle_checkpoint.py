"""The lifecycle's checkpoint side, driven through the controller on the fake cluster: a suspend of a
running job that lets the trainer save first (with and without checkpointing), the resume, and
checkpoint-now requests forwarded to rank 0."""

from __future__ import annotations

import json

from tetrad_operator.lifecycle import AnnotatePod, DeletePod

from tetrad.api import contract

from .fakes import FakeCluster, job_body, terminated
from .test_lifecycle import cond, running

CHECKPOINTED = {"checkpoint": {"enabled": True, "path": "/ckpt", "interval": 100}}
FAST = {"backoffSeconds": 1, "maxRestarts": 0, "maxDisruptions": 0}  # any restart would fail the job


def set_suspend(c: FakeCluster, value: bool) -> None:
    assert c.job is not None
    c.job["spec"]["runPolicy"] = {**FAST, "suspend": value}
    c.job["metadata"]["generation"] += 1


def saved(step: int | None, at: float | None = 1_900_000_000.0) -> str:
    message: dict[str, object] = {contract.TERMINATION_CHECKPOINT_STEP: step}
    if at is not None:
        message[contract.TERMINATION_CHECKPOINT_TIME] = at
    return json.dumps(message)


def test_suspend_of_a_running_job_lets_the_trainer_save_then_records_the_step_and_resumes_from_it():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST, **CHECKPOINTED))
    running(c)
    c.status["checkpoint"] = {"step": 100, "resumedFrom": 0, "resumedAtRestart": 0}  # as the scraper wrote it
    set_suspend(c, True)
    d = c.reconcile()
    assert c.phase == "Suspended" and cond(c, "Suspended")["reason"] == "Suspending"
    assert "grace period (120s), in which the trainer saves a checkpoint" in cond(c, "Suspended")["message"]
    deletes = [a for a in d.actions if isinstance(a, DeletePod)]
    assert len(deletes) == 2 and not any(a.force for a in deletes), "graceful: the kubelet sends SIGTERM"

    # The kubelet's SIGTERM: every rank saves step 137 and exits 75; the pods are still terminating.
    for pod in c.pods.values():
        terminated(pod, contract.EXIT_PREEMPTED,
                   saved(137) if pod["metadata"]["name"].endswith("-0") else None)
    c.reconcile()
    assert c.phase == "Suspended" and cond(c, "Suspended")["reason"] == "Suspending"
    assert c.status["checkpoint"] == {"step": 137, "path": "/ckpt/step-00000137",
                                      "time": "2030-03-17T17:46:40Z", "resumedFrom": 0, "resumedAtRestart": 0}
    assert c.status["restarts"] == 0 and c.status["disruptions"] == 0, "a suspend is no restart"
    c.tick()  # the pods are gone
    c.reconcile()
    suspended = cond(c, "Suspended")
    assert suspended["reason"] == "Suspended" and suspended["status"] == "True"
    assert "the last committed checkpoint is step 137" in suspended["message"]
    assert any(e.reason == "Suspended" and "step 137" in e.message for e in c.events)

    set_suspend(c, False)
    c.reconcile()
    assert c.phase == "Pending" and "resumes from checkpoint step 137" in cond(c, "Pending")["message"]
    assert set(c.pods) == {"job-r0-0", "job-r0-1"}, "the same incarnation again"
    assert c.status["checkpoint"] == {"step": 137, "path": "/ckpt/step-00000137",
                                      "time": "2030-03-17T17:46:40Z"}
    running(c)
    assert c.status["restarts"] == 0 and c.status["disruptions"] == 0 and c.phase == "Running"


def test_suspend_without_checkpointing_says_the_state_is_lost():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    set_suspend(c, True)
    c.reconcile()
    assert "checkpointing is off (spec.checkpoint.enabled=false): the training state is lost" in \
        cond(c, "Suspended")["message"]
    for pod in c.pods.values():
        terminated(pod, contract.EXIT_PREEMPTED, saved(None, None))
    c.reconcile()
    c.tick()
    c.reconcile()
    assert cond(c, "Suspended")["reason"] == "Suspended" and not c.pods
    assert "the training state is lost, a resume starts from step 0" in cond(c, "Suspended")["message"]
    assert "checkpoint" not in c.status
    set_suspend(c, False)
    c.reconcile()
    assert cond(c, "Pending")["message"] == "the job was resumed"
    running(c)
    assert c.status["restarts"] == 0


def test_a_resume_before_the_suspended_pods_are_gone_waits_for_them():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST, **CHECKPOINTED))
    running(c)
    set_suspend(c, True)
    c.reconcile()
    set_suspend(c, False)  # at once, while the trainer still saves
    d = c.reconcile()
    assert c.phase == "Suspended" and not [a for a in d.actions if not isinstance(a, DeletePod)]
    for pod in c.pods.values():
        terminated(pod, contract.EXIT_PREEMPTED, saved(5))
    c.reconcile()
    assert c.status["checkpoint"]["step"] == 5
    c.tick()
    c.reconcile()  # gone: resumed
    assert c.phase == "Pending" and "resumes from checkpoint step 5" in cond(c, "Pending")["message"]
    running(c)
    assert c.status["restarts"] == 0 and c.status["disruptions"] == 0


def test_checkpoint_now_is_forwarded_once_to_rank_0():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST, **CHECKPOINTED))
    running(c)
    assert c.job is not None
    c.job["metadata"]["annotations"] = {contract.ANNOTATION_CHECKPOINT_NOW: "t1"}
    d = c.reconcile()
    assert [a for a in d.actions if isinstance(a, AnnotatePod)] == [
        AnnotatePod("job-r0-0", c.pods["job-r0-0"]["metadata"]["uid"],
                    {contract.ANNOTATION_CHECKPOINT_NOW: "t1"})]
    assert c.status["checkpoint"] == {"requested": "t1"}
    assert c.pods["job-r0-0"]["metadata"]["annotations"][contract.ANNOTATION_CHECKPOINT_NOW] == "t1"
    assert contract.ANNOTATION_CHECKPOINT_NOW not in c.pods["job-r0-1"]["metadata"].get("annotations", {})
    assert [e.reason for e in d.events] == ["CheckpointRequested"]
    d = c.reconcile()
    assert not d.actions and not d.events and not d.merged, "once per token"
    c.job["metadata"]["annotations"][contract.ANNOTATION_CHECKPOINT_NOW] = "t2"
    d = c.reconcile()
    assert [a.annotations for a in d.actions if isinstance(a, AnnotatePod)] == [
        {contract.ANNOTATION_CHECKPOINT_NOW: "t2"}]
    assert c.status["checkpoint"]["requested"] == "t2"


def test_checkpoint_now_without_checkpointing_is_a_warning_not_a_request():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    assert c.job is not None
    c.job["metadata"]["annotations"] = {contract.ANNOTATION_CHECKPOINT_NOW: "t1"}
    d = c.reconcile()
    assert not [a for a in d.actions if isinstance(a, AnnotatePod)]
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "CheckpointNotConfigured")]
    assert not c.reconcile().events
