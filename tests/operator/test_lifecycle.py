"""The job's state machine, driven through whole scenarios: the real controller on the in-memory
Kubernetes (FakeCluster). A few tests call the pure `decide` alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tetrad_operator import lifecycle, status
from tetrad_operator.admission import created_released
from tetrad_operator.lifecycle import CreatePod, DeleteJob, DeletePod, Ensure, Ungate, decide
from tetrad_operator.observed import PodState, format_time, parse_time

from tetrad.api import contract
from tetrad.api.termination import TerminationMessage
from tetrad.node import supervisor
from tetrad.render import names

from .fakes import FakeCluster, job_body, node_body, terminated

FAST = {"backoffSeconds": 10, "backoffMaxSeconds": 40, "maxRestarts": 2}


def cond(c: FakeCluster, type_: str) -> dict:
    return next(x for x in c.status["conditions"] if x["type"] == type_)


def running(c: FakeCluster, steps: int = 10) -> None:
    for _ in range(steps):
        c.reconcile()
        c.tick()
        if c.phase == "Running":
            return
    raise AssertionError(f"not Running: {c.status}")


def test_first_reconcile_creates_every_object_and_fills_status():
    c = FakeCluster(job_body(nodes=3))
    d = c.reconcile(admit=False)
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds == ["Ensure", "Ensure", "Ensure", "CreatePod", "CreatePod", "CreatePod"]
    assert [a.obj["metadata"]["name"] for a in d.actions if isinstance(a, Ensure)] == ["job", "job-config",
                                                                                        "job-env"]
    assert [a.name for a in d.actions if isinstance(a, CreatePod)] == ["job-r0-0", "job-r0-1", "job-r0-2"]
    s = c.status
    assert s["phase"] == "Pending" and s["restarts"] == 0 and s["observedGeneration"] == 1
    assert s["worldSize"] == 3 and s["mesh"] == "pp1.dpr1.dps3.cp1.tp1"
    assert s["startTime"] == "2030-01-01T00:00:00Z"
    assert cond(c, "Pending")["status"] == "True"
    assert [e.reason for e in c.events] == ["Created"]
    for pod in c.pods.values():
        assert pod["spec"]["schedulingGates"] == [{"name": contract.GANG_GATE}]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-job"


def test_builtin_gang_waits_gated_then_runs_and_succeeds():
    c = FakeCluster(job_body(nodes=2))
    c.reconcile(admit=False)
    d = c.reconcile(admit=False)
    assert c.phase == "GangWaiting" and d.gang is not None
    assert {p.name for p in d.gang.pods} == {"job-r0-0", "job-r0-1"}
    assert cond(c, "GangReleased")["reason"] == "WaitingForCapacity"
    running(c)
    assert cond(c, "GangReleased")["status"] == "True"
    assert cond(c, "GangWaiting")["status"] == "False" and cond(c, "Running")["status"] == "True"
    c.finish(0, rank=1)
    c.reconcile()
    assert c.phase == "Running"  # rank 0 still runs
    c.finish(0)
    d = c.reconcile()
    assert c.phase == "Succeeded" and c.status["completionTime"]
    assert not d.actions and not c.alive()
    assert [e.reason for e in c.events] == ["Created", "WaitingForCapacity", "AllPodsRunning", "Succeeded"]


def test_steady_state_is_a_fixed_point():
    c = FakeCluster(job_body(nodes=2))
    running(c)
    before = dict(c.status)
    d1 = decide(c.job, c.pod_states(), c.node_states(), c.now)
    d2 = decide(c.job, c.pod_states(), c.node_states(), c.now + timedelta(seconds=30))
    assert status.wire(d1.status) == before and status.wire(d2.status) == before
    assert d1.actions == d2.actions == [] and not d1.events and not d1.verify


def test_a_failed_pod_restarts_the_whole_gang_after_backoff():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.finish(1, rank=1)
    d = c.reconcile()
    assert c.phase == "Restarting" and c.status["restarts"] == 1
    assert cond(c, "Restarting")["reason"] == "PodFailed"
    assert "exit code 1" in c.status["message"]
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"job-r0-0", "job-r0-1"}
    assert d.requeue_after == 2  # polls while the old gang terminates
    c.tick(1)  # the kubelet removes the old gang
    assert not c.pods
    d = c.reconcile()
    assert not d.actions and 8 <= d.requeue_after <= 9  # backoff holds the new gang
    c.tick(9)
    d = c.reconcile()
    created = [a for a in d.actions if isinstance(a, CreatePod)]
    assert [a.name for a in created] == ["job-r1-0", "job-r1-1"]
    env = {e["name"]: e.get("value") for e in created[0].obj["spec"]["containers"][0]["env"]}
    assert env["TETRAD_RESTART"] == "1" and env["PET_RDZV_ID"].endswith("-1")
    assert created[0].obj["metadata"]["labels"][contract.LABEL_RESTART] == "1"
    running(c)
    c.finish(0)
    c.reconcile()
    assert c.phase == "Succeeded" and c.status["restarts"] == 1


def test_backoff_doubles_and_is_capped():
    p = lifecycle.RunPolicy(backoff_seconds=10, backoff_max_seconds=25)
    assert [lifecycle.backoff_seconds(p, r) for r in range(5)] == [0, 10, 20, 25, 25]


def test_max_restarts_exhausted_fails_with_reason():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "maxRestarts": 1}))
    running(c)
    c.finish(3, rank=0)
    c.settle(15)
    assert c.status["restarts"] == 1
    running(c)
    c.finish(3, rank=0)
    c.reconcile()
    assert c.phase == "Failed"
    assert cond(c, "Failed")["reason"] == "MaxRestartsExceeded"
    assert "maxRestarts=1" in c.status["message"] and "exit code 3" in c.status["message"]
    c.tick()
    assert not c.alive()  # cleanPodPolicy Running removed the survivor


def test_disruptions_restart_without_spending_the_budget():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "maxRestarts": 1}))
    running(c)
    for restart in (1, 2, 3):  # preempted three times: more restarts than maxRestarts allows
        c.finish(75, rank=0)
        c.finish(1, rank=1)  # its peer lost a collective: covered by the disruption
        c.reconcile()
        assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "PodFailed"
        assert "exit code 75" in cond(c, "Restarting")["message"]
        assert (c.status["restarts"], c.status["disruptions"]) == (restart, restart)
        c.settle(60)
        running(c)
    c.finish(3, rank=1)  # the first real failure spends the one restart maxRestarts allows
    c.settle(60)
    assert (c.status["restarts"], c.status["disruptions"]) == (4, 3)
    running(c)
    c.finish(3, rank=1)
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "MaxRestartsExceeded"
    assert ("restarted 1 times after failures (maxRestarts=1; 3 disruptions not counted)"
            in c.status["message"])


def test_disruptions_have_their_own_budget():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "maxDisruptions": 2}))
    running(c)
    for restart in (1, 2):
        c.pods[f"job-r{restart - 1}-1"]["status"].update(phase="Failed", reason="Evicted")
        c.reconcile()
        assert (c.phase == "Restarting"
                and (c.status["restarts"], c.status["disruptions"]) == (restart, restart))
        c.settle(60)
        running(c)
    c.pods["job-r2-0"]["status"].update(phase="Failed", reason="Evicted")  # the third disruption: over budget
    d = c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "DisruptionBudgetExceeded"
    assert "restarted 2 times after disruptions (spec.runPolicy.maxDisruptions=2)" in c.status["message"]
    assert (c.status["restarts"], c.status["disruptions"]) == (2, 2)
    assert [e.reason for e in c.events][-1] == "DisruptionBudgetExceeded" and c.events[-1].type == "Warning"
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"job-r2-1"}


def test_zero_disruption_budget_fails_at_the_first_disruption_but_not_on_failures():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "maxDisruptions": 0}))
    running(c)
    c.finish(3, rank=1)  # a failure spends maxRestarts, not the disruption budget
    c.settle(60)
    running(c)
    assert (c.status["restarts"], c.status["disruptions"]) == (1, 0)
    c.finish(75, rank=0)  # preempted
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "DisruptionBudgetExceeded"
    assert "maxDisruptions=0" in c.status["message"] and "exit code 75" in c.status["message"]


def test_a_restart_keeps_the_last_committed_checkpoint():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST, checkpoint={"enabled": True, "path": "/ckpt"}))
    running(c)
    committed = {"step": 40, "time": format_time(c.now), "path": "/ckpt/step-00000040", "resumedFrom": 0,
                 "resumedAtRestart": 0}
    c.job["status"]["checkpoint"] = dict(committed)  # what the scraper wrote
    c.finish(75, rank=0)  # preempted after committing step 40
    d = c.reconcile()
    assert c.phase == "Restarting" and "checkpoint" not in status.wire(d.status)  # a pass never writes it ...
    c.settle(60)
    running(c)
    assert c.status["restarts"] == 1 and c.status["checkpoint"] == committed  # ... so the restart keeps it


def test_permanent_exit_code_fails_at_once():
    c = FakeCluster(job_body(nodes=3, runPolicy=FAST))
    running(c)
    c.finish(78, rank=2)
    d = c.reconcile()
    assert c.phase == "Failed" and c.status["restarts"] == 0
    assert cond(c, "Failed")["reason"] == "PermanentExitCode"
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"job-r0-0", "job-r0-1"}


def test_device_out_of_memory_fails_at_once_and_says_what_to_read():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.finish(contract.EXIT_OOM, rank=1)
    c.reconcile()
    assert c.phase == "Failed" and c.status["restarts"] == 0, "retrying the same layout cannot help"
    assert cond(c, "Failed")["reason"] == "DeviceOutOfMemory"
    assert c.status["message"] == ("pod job-r0-1 failed with exit code 77 in container trainer: "
                                   "the trainer ran out of device memory; see the pod log for the planner's "
                                   "figures and the knobs to turn")
    assert c.events[-1].type == "Warning" and c.events[-1].reason == "DeviceOutOfMemory"


def test_a_worker_the_oom_killer_ended_fails_the_job_as_host_out_of_memory():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    said = supervisor.out_of_host_memory(1, None)
    c.finish(contract.EXIT_OOM, rank=0,
             message=TerminationMessage(reason=contract.REASON_HOST_OUT_OF_MEMORY, message=said).encode())
    c.reconcile()
    assert c.phase == "Failed" and c.status["restarts"] == 0
    assert cond(c, "Failed")["reason"] == "HostOutOfMemory"
    assert "Raise spec.resources.memory" in c.status["message"] and "exit code 77" in c.status["message"]


def test_device_out_of_memory_restarts_when_the_user_made_it_retryable():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "permanentExitCodes": [78]}))
    running(c)
    c.finish(contract.EXIT_OOM, rank=0)
    c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "PodFailed"


def test_pods_the_api_server_refuses_fail_the_job_after_a_few_passes():
    refused = ('pods "job-r0-0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=0, '
               'limited: pods=0')
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    c.refuse = refused
    attempts = c.settings.pod_create_attempts
    for _ in range(attempts):
        c.reconcile()
        assert c.phase == "Pending" and not c.pods
    assert c.rejection is not None and c.rejection.attempts == attempts
    d = c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "PodCreationRejected"
    assert c.status["message"] == (f"the API server rejected the job's pods {attempts} times in a row: "
                                   f"{refused}")
    assert not [a for a in d.actions if isinstance(a, CreatePod)]


def test_a_refusal_that_clears_in_time_does_not_fail_the_job():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    c.refuse = "exceeded quota"
    for _ in range(c.settings.pod_create_attempts - 1):
        c.reconcile()
    c.refuse = None  # e.g. the quota was raised
    running(c)
    assert c.rejection is None and c.status["restarts"] == 0


@pytest.mark.parametrize(("retryable", "code", "phase"), [
    ([42], 1, "Failed"), ([42], 42, "Restarting"), ([42], 75, "Restarting"), ([], 75, "Restarting")])
def test_retryable_exit_codes(retryable, code, phase):
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "retryableExitCodes": retryable}))
    running(c)
    c.finish(code, rank=0)
    c.reconcile()
    assert c.phase == phase
    if phase == "Failed":
        assert cond(c, "Failed")["reason"] == "NonRetryableExitCode"


def test_eviction_is_retryable_even_with_a_retryable_list():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "retryableExitCodes": [42]}))
    running(c)
    pod = c.pods["job-r0-0"]
    pod["status"].update(phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
    c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "PodEvicted"


def test_deleted_node_is_a_lost_pod_force_deleted():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST),
                    nodes=[node_body("a", cpu="4"), node_body("b", cpu="4")])
    running(c)
    victim = next(p for p in c.pods.values() if p["spec"]["nodeName"] == "b")
    c.tick(20)
    del c.nodes["b"]
    d = c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "NodeLost"
    forced = {a.name for a in d.actions if isinstance(a, DeletePod) and a.force}
    assert forced == {victim["metadata"]["name"]}


def test_not_ready_node_is_lost_only_after_the_grace_period():
    settings = lifecycle.Settings(node_lost_seconds=60)
    c = FakeCluster(job_body(nodes=1, runPolicy=FAST), settings=settings)
    running(c)
    c.nodes["n0"] = node_body("n0", cpu="64", memory="256Gi", ready=False, since=c.now)
    c.tick(30)
    d = c.reconcile()
    assert c.phase == "Running" and d.requeue_after == pytest.approx(30)
    c.tick(31)
    c.reconcile()
    assert c.phase == "Restarting" and "not been Ready" in c.status["message"]


def test_stuck_terminating_pod_is_force_deleted():
    settings = lifecycle.Settings(stuck_terminating_seconds=5)
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "terminationGracePeriodSeconds": 5}),
                    settings=settings)
    running(c)
    c.finish(1, rank=1)  # the API server removes the finished pod at once; rank 0's deletion takes its grace
    c.reconcile()
    c.tick(1, kubelet_deletes=False)
    d = c.reconcile()
    assert not [a for a in d.actions if isinstance(a, DeletePod) and a.force]
    c.tick(40, kubelet_deletes=False)  # well past its grace period (5 s) and stuck_terminating_seconds (5 s)
    d = c.reconcile()
    assert [a.name for a in d.actions if isinstance(a, DeletePod) and a.force] == ["job-r0-0"]


def test_externally_deleted_or_missing_pod_restarts_the_gang():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.pods["job-r0-1"]["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:05Z"
    c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "PodDeleted"

    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    del c.pods["job-r0-0"]
    d = c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "PodMissing"
    assert d.verify, "an absence must be confirmed against the API before acting on it"
    deleted = [a for a in d.actions if isinstance(a, DeletePod)]
    assert [(a.name, a.uid) for a in deleted] == [("job-r0-1", c.pods["job-r0-1"]["metadata"]["uid"])]


def test_restart_count_survives_a_lost_status():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.finish(1, rank=0)
    c.settle(20)
    assert c.status["restarts"] == 1 and c.phase == "Running"
    c.job["status"] = {}  # e.g. restored from a backup without status
    d = c.reconcile()
    assert c.status["restarts"] == 1
    assert not [a for a in d.actions if isinstance(a, CreatePod | DeletePod)]


def test_suspend_deletes_pods_and_resume_recreates_them():
    c = FakeCluster(job_body(nodes=2))
    running(c)
    c.job["spec"]["runPolicy"] = {"suspend": True}
    c.job["metadata"]["generation"] = 2
    d = c.reconcile()
    assert c.phase == "Suspended" and c.status["observedGeneration"] == 2
    assert "startTime" not in c.status
    assert len([a for a in d.actions if isinstance(a, DeletePod)]) == 2
    c.tick()
    c.reconcile()
    assert not c.pods
    c.job["spec"]["runPolicy"] = {"suspend": False}
    c.reconcile()
    assert c.phase == "Pending" and cond(c, "Pending")["reason"] == "Resumed"
    assert set(c.pods) == {"job-r0-0", "job-r0-1"} and c.status["restarts"] == 0
    running(c)


def test_created_suspended_never_creates_pods():
    c = FakeCluster(job_body(nodes=2, runPolicy={"suspend": True}))
    d = c.reconcile()
    assert c.phase == "Suspended" and not d.actions and not c.pods


def test_active_deadline_fails_the_job():
    c = FakeCluster(job_body(nodes=2, runPolicy={"activeDeadlineSeconds": 100}))
    running(c)
    d = c.reconcile()
    assert d.requeue_after is not None and d.requeue_after <= 100
    c.tick(100)
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "DeadlineExceeded"
    c.tick()
    assert not c.alive()


def test_ttl_deletes_the_finished_job():
    c = FakeCluster(job_body(nodes=1, runPolicy={"ttlSecondsAfterFinished": 30}))
    running(c)
    c.finish(0)
    d = c.reconcile()
    assert c.phase == "Succeeded" and d.requeue_after == 30
    c.tick(29)
    assert not any(isinstance(a, DeleteJob) for a in c.reconcile().actions)
    c.tick(1)
    c.reconcile()
    assert c.job is None


@pytest.mark.parametrize(("policy", "left"), [("All", set()), ("Running", {"job-r0-1"}),
                                              ("None", {"job-r0-0", "job-r0-1"})])
def test_clean_pod_policy(policy, left):
    c = FakeCluster(job_body(nodes=2, runPolicy={"cleanPodPolicy": policy}))
    running(c)
    c.finish(78, rank=1)
    c.reconcile()
    c.tick()
    c.reconcile()
    assert c.phase == "Failed" and set(c.pods) == left


def test_spec_failing_deeper_checks_is_failed_with_the_field():
    c = FakeCluster(job_body(nodes=2, parallelism={"dpShard": 2}, training={"globalBatch": 3}))
    d = c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "InvalidSpec"
    assert "spec.training.globalBatch" in c.status["message"]
    assert not d.actions and d.events[0].type == "Warning"
    c.reconcile()
    assert c.phase == "Failed"


def test_unparseable_spec_is_failed_not_raised():
    body = job_body(nodes=2)
    body["spec"]["nodes"] = "many"
    c = FakeCluster(body)
    c.reconcile()
    assert c.phase == "Failed" and "spec.nodes" in c.status["message"]


def test_partial_release_is_completed():
    c = FakeCluster(job_body(nodes=3))
    c.reconcile(admit=False)
    c._ungate("job-r0-1")
    d = c.reconcile(admit=False)
    ungate = [a for a in d.actions if isinstance(a, Ungate)]
    assert ungate and {n for n, _ in ungate[0].pods} == {"job-r0-0", "job-r0-2"}
    assert d.gang is None


def test_gang_timeout_recreates_the_gang_behind_its_gate():
    c = FakeCluster(job_body(nodes=2, gang={"timeoutSeconds": 60}, runPolicy=FAST))
    c.reconcile(admit=False)
    c.reconcile()  # admitted and ungated
    c.tick(schedule=False)
    c.reconcile()
    assert cond(c, "GangReleased")["status"] == "True"
    c.tick(61, schedule=False)
    d = c.reconcile()
    assert cond(c, "GangReleased")["reason"] == "GangTimeout" and c.phase == "GangWaiting"
    assert c.events[-1].reason == "GangTimeout" and c.events[-1].type == "Warning"
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"job-r0-0", "job-r0-1"}
    assert not c.pods  # unbound pods go at once
    assert not c.reconcile().actions  # fixed backoff after a gang timeout
    c.tick(10)
    c.reconcile(admit=False)
    assert set(c.pods) == {"job-r0-0", "job-r0-1"} and c.status["restarts"] == 0
    assert all(p["spec"]["schedulingGates"] for p in c.pods.values())
    running(c)


def test_a_new_incarnation_offers_itself_for_release_at_creation():
    c = FakeCluster(job_body(nodes=2))
    d = c.reconcile(admit=False)
    offer = d.release_at_creation
    assert offer is not None and offer.restart == 0 and offer.key == ("ns", "job")
    assert [p.name for p in offer.pods] == ["job-r0-0", "job-r0-1"] and all(p.gated for p in offer.pods)
    # The admission found it fits: the controller creates the pods released, with no gate.
    now = datetime.now(UTC)
    for name in list(c.pods):
        c.pods[name] = created_released(c.pods[name], now)
    d = c.reconcile(admit=False)
    assert d.gang is None and not [a for a in d.actions if isinstance(a, Ungate)]
    assert cond(c, "GangReleased")["status"] == "True" and cond(c, "GangReleased")["reason"] == "Admitted"
    assert all(PodState.from_body(p).released and not PodState.from_body(p).gated for p in c.pods.values())
    running(c)
    assert "WaitingForCapacity" not in [e.reason for e in c.events]


def test_no_release_at_creation_for_missing_pods_a_gang_timeout_or_other_schedulers():
    c = FakeCluster(job_body(nodes=2, gang={"timeoutSeconds": 60}, runPolicy=FAST))
    c.reconcile(admit=False)
    del c.pods["job-r0-1"]  # a pod of a gated incarnation deleted before its release
    d = c.reconcile(admit=False)
    assert ([a.name for a in d.actions if isinstance(a, CreatePod)] == ["job-r0-1"]
            and d.release_at_creation is None)
    c.reconcile()  # admitted and ungated
    c.tick(schedule=False)
    c.reconcile()
    c.tick(61, schedule=False)
    c.reconcile()
    assert cond(c, "GangReleased")["reason"] == "GangTimeout" and not c.pods
    c.tick(10)
    d = c.reconcile(admit=False)
    assert set(c.pods) == {"job-r0-0", "job-r0-1"} and d.release_at_creation is None
    for scheduler in ("volcano", "coscheduling", "workload"):
        d = FakeCluster(job_body(nodes=2, gang={"scheduler": scheduler})).reconcile(admit=False)
        assert d.release_at_creation is None, scheduler


def test_volcano_gets_a_pod_group_and_no_gate():
    c = FakeCluster(job_body(nodes=2, gang={"scheduler": "volcano", "queue": "q"}))
    d = c.reconcile()
    groups = [a.obj for a in d.actions if isinstance(a, Ensure) and a.obj["kind"] == "PodGroup"]
    assert groups and groups[0]["spec"]["minMember"] == 2
    assert groups[0]["metadata"]["ownerReferences"][0]["kind"] == "ParallelTrainingJob"
    assert all("schedulingGates" not in p["spec"] for p in c.pods.values())
    c.reconcile()
    assert c.phase == "GangWaiting" and cond(c, "GangWaiting")["reason"] == "WaitingForScheduler"
    running(c)


def test_coscheduling_gets_a_pod_group_per_incarnation_and_deletes_the_old_one():
    c = FakeCluster(job_body(nodes=2, gang={"scheduler": "coscheduling"}, runPolicy=FAST))
    d = c.reconcile()
    assert [(a.obj["kind"], a.obj["metadata"]["name"]) for a in d.actions if isinstance(a, Ensure)][-1] == (
        "PodGroup", "job-r0")
    assert not any(isinstance(a, lifecycle.DeleteStaleGang) for a in d.actions)
    c.reconcile()
    assert c.phase == "GangWaiting" and cond(c, "GangWaiting")["reason"] == "WaitingForScheduler"
    running(c)
    c.finish(1, rank=0)
    c.settle(12)
    assert c.status["restarts"] == 1 and set(c.pods) == {"job-r1-0", "job-r1-1"}
    assert {p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] for p in c.pods.values()} == {"job-r1"}
    assert sorted(k for k in c.objects if k[0] == "PodGroup") == [("PodGroup", "job-r1")]


def test_a_job_waiting_for_its_scheduler_says_why_in_status():
    c = FakeCluster(job_body(nodes=2, gang={"scheduler": "coscheduling"}))
    c.reconcile()
    c.reconcile()
    assert c.status["message"] == "all 2 pods exist; waiting for coscheduling to place and start them"
    events = len(c.events)
    for why in ("0/4 nodes are available: 4 Insufficient cpu.",
                "rejected due to timeout after waiting 10s at permit"):
        c.pods["job-r0-1"].setdefault("status", {})["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]
        c.reconcile()
        assert c.phase == "GangWaiting" and c.status["message"].endswith(f"place and start them: {why}")
        assert cond(c, "GangWaiting")["message"] == c.status["message"]
    assert len(c.events) == events, "a new reason from the scheduler updates status, not another event"


def test_a_job_kueue_holds_says_why_and_tells_it_once():
    c = FakeCluster(job_body(nodes=2, gang={"scheduler": "kueue", "queue": "team-a"}))
    c.reconcile()
    c.reconcile()
    assert cond(c, "GangWaiting")["reason"] == "WaitingForScheduler"
    for quota in ("insufficient unused quota for nvidia.com/gpu, 8 more needed", "... 16 more needed"):
        c.queued = f"couldn't assign flavors to pod set main: {quota}"
        c.reconcile()
        assert cond(c, "GangWaiting")["reason"] == "WaitingForQueue"
        assert c.status["message"] == f"all 2 pods exist; kueue has not admitted them: {c.queued}"
    assert [e.reason for e in c.events].count("WaitingForQueue") == 1, (
        "a changed reason updates status, not another event")
    c.queued = None  # admitted
    running(c)


def test_a_failed_kueue_job_closes_its_pod_group_on_one_pod_once():
    c = FakeCluster(job_body(nodes=2, gang={"scheduler": "kueue", "queue": "team-a"},
                             runPolicy={"maxRestarts": 0}))
    running(c)
    c.finish(1)
    for _ in range(3):
        c.reconcile()
        c.tick()
    assert c.phase == "Failed"
    closed = [n for n, p in c.pods.items()
              if p["metadata"].get("annotations", {}).get("kueue.x-k8s.io/retriable-in-group") == "false"]
    assert len(closed) == 1, (
        "one pod says the group is over; Kueue then finishes its Workload and lets the pods go")
    d = c.reconcile()
    assert not [a for a in d.actions if isinstance(a, lifecycle.AnnotatePod)], "said once"
    ok = FakeCluster(job_body(nodes=2, gang={"scheduler": "kueue", "queue": "team-a"}))
    running(ok)
    ok.finish(0)
    ok.settle(3)
    assert ok.phase == "Succeeded" and not [a for a in ok.reconcile().actions
                                            if isinstance(a, lifecycle.AnnotatePod)]


def test_a_finished_pod_held_by_a_finalizer_does_not_hold_up_the_next_incarnation():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.finish(1, rank=0)
    c.reconcile()
    for pod in c.pods.values():  # the finished pods stay, deleted but held (Kueue's finalizer)
        pod["status"]["phase"] = "Failed"
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        pod["metadata"]["finalizers"] = ["kueue.x-k8s.io/managed"]
    for _ in range(12):
        c.tick()
        c.reconcile()
    assert {"job-r1-0", "job-r1-1"} <= set(c.pods), "restart 1 was created beside the held pods of restart 0"


def test_workload_gang_gets_a_workload_and_pod_group_per_incarnation():
    c = FakeCluster(job_body(nodes=2, gang={"scheduler": "workload"}, runPolicy=FAST))
    d = c.reconcile()
    ensured = [(a.obj["kind"], a.obj["metadata"]["name"]) for a in d.actions if isinstance(a, Ensure)]
    assert ensured[-2:] == [("Workload", "job-r0"), ("PodGroup", "job-r0")]
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "job-r0"}
               and "schedulingGates" not in p["spec"]
               for p in c.pods.values())
    assert not any(isinstance(a, lifecycle.DeleteStaleGang) for a in d.actions)  # nothing earlier to remove
    c.reconcile()
    assert c.phase == "GangWaiting" and cond(c, "GangWaiting")["reason"] == "WaitingForScheduler"
    assert "GangReleased" not in {x["type"] for x in c.status["conditions"]}  # the scheduler holds the gang
    running(c)
    c.finish(1, rank=0)
    c.settle(12)
    assert c.status["restarts"] == 1 and set(c.pods) == {"job-r1-0", "job-r1-1"}
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "job-r1"} for p in c.pods.values())
    # The new incarnation's Workload and PodGroup replace the old ones.
    assert sorted(k for k in c.objects if k[0] in ("Workload", "PodGroup")) == [("PodGroup", "job-r1"),
                                                                                ("Workload", "job-r1")]


# ----------------------------------------------------------------------------- properties

OPS = st.lists(st.sampled_from(["reconcile", "tick", "fail", "fail78", "evict", "succeed_one", "long_tick"]),
               min_size=5, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_invariants_hold_for_any_interleaving(ops):
    c = FakeCluster(job_body(nodes=3, runPolicy={**FAST, "maxRestarts": 3}))
    seen_restarts = 0
    for op in ops:
        if c.job is None:
            break
        if op == "reconcile":
            c.reconcile()
        elif op == "tick":
            c.tick(1)
        elif op == "long_tick":
            c.tick(45)
        else:
            live = [p for p in c.pods.values() if p["status"]["phase"] == "Running"]
            if live:
                pod = live[0]
                if op == "evict":
                    pod["status"].update(phase="Failed", reason="Evicted")
                else:
                    terminated(pod, {"fail": 1, "fail78": 78, "succeed_one": 0}[op])
        # Invariants after every step.
        restarts = c.status.get("restarts", 0)
        assert restarts >= seen_restarts and restarts <= 3
        seen_restarts = restarts
        live = [p for p in c.pods.values() if not p["metadata"].get("deletionTimestamp")]
        incarnations = {p["metadata"]["labels"][contract.LABEL_RESTART] for p in live
                        if p["status"]["phase"] in ("Pending", "Running")}
        assert len(incarnations) <= 1, f"two gangs alive at once: {incarnations}"
        for name, pod in c.pods.items():
            labels = pod["metadata"]["labels"]
            assert name == names.pod("job", int(labels[contract.LABEL_RESTART]),
                                     int(labels[contract.LABEL_RANK]))
            assert int(labels[contract.LABEL_RESTART]) <= restarts
    # With no more faults the job always ends.
    for _ in range(80):
        if c.job is None or c.phase in ("Succeeded", "Failed"):
            break
        c.reconcile()
        c.tick(15)
        c.finish(0)
    assert c.job is None or c.phase in ("Succeeded", "Failed")
    if c.phase == "Succeeded":
        assert not c.alive()


def test_a_missing_pod_is_rendered_exactly_like_the_whole_gang():
    from tetrad.api import parse
    from tetrad.render import render

    c = FakeCluster(job_body(nodes=3))
    first = {a.name: a.obj for a in c.reconcile(admit=False).actions if isinstance(a, CreatePod)}
    del c.pods["job-r0-2"]  # e.g. the operator stopped half-way through creating the gang
    d = c.reconcile(admit=False)
    # The incarnation's objects exist, but an operator older than the environment ConfigMap may
    # have begun it: that one is ensured before the missing pod.
    assert [a.obj["metadata"]["name"] for a in d.actions if isinstance(a, Ensure)] == ["job-env"]
    again = [a.obj for a in d.actions if isinstance(a, CreatePod)]
    job, _ = parse({k: c.job[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    assert again == [first["job-r0-2"]] == [render(job, restart=0).pods[2]]


# ---------------------------------------------------------------------- stall detection


def scraped(c: FakeCluster, *, last_step_ago: float | None, step_time: float | None = None,
            startup: float | None = None, step: int | None = None) -> None:
    """What the controller's scraper writes into status.training: rank 0's figures, read now."""
    training: dict = {"updated": format_time(c.now)}
    if step is not None:
        training["step"] = step
    if startup is not None:
        training["startupSeconds"] = startup
    if last_step_ago is not None:
        training["lastStepTime"] = format_time(c.now - timedelta(seconds=last_step_ago))
    if step_time is not None:
        training["stepTimeSeconds"] = step_time
    c.job["status"]["training"] = training


def quiet_for(c: FakeCluster, seconds: float) -> lifecycle.Decision:
    """Time passes without a step; then a scrape reads the same heartbeat. A stalled gang is first asked to
    restart in place: these pods have no coordinator, so the ask is refused, and the pass that refusal's
    write wakes recreates the gang."""
    c.now += timedelta(seconds=seconds)
    if "updated" in (training := c.job["status"].get("training") or {}):
        training["updated"] = format_time(c.now)
    decided = c.reconcile()
    if any(isinstance(a, lifecycle.AskInPlace) for a in decided.actions):
        assert c.status["inPlaceAsk"]["accepted"] is False
        return c.reconcile()
    return decided


def unread_for(c: FakeCluster, seconds: float) -> lifecycle.Decision:
    """Time passes and no scrape reaches rank 0."""
    c.now += timedelta(seconds=seconds)
    return c.reconcile()


def test_a_gang_whose_rank_0_stops_stepping_is_restarted_as_a_disruption():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    scraped(c, last_step_ago=0, step_time=2.0)  # default timeout: max(10 x 2 s, 300 s) = 300 s
    d = quiet_for(c, 299)
    assert c.phase == "Running" and d.requeue_after is not None and d.requeue_after <= 1
    d = quiet_for(c, 1)
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    assert "rank 0 (job-r0-0) completed no step since" in c.status["message"]
    assert ("over the stall timeout of 300s (the default: 10 x the step time, at least 300s)"
            in c.status["message"])
    assert (c.status["restarts"], c.status["disruptions"]) == (1, 1)
    assert (c.events[-1].type, c.events[-1].reason) == ("Warning", "Stalled")
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"job-r0-0", "job-r0-1"}
    c.settle(60)
    running(c)
    # The old incarnation's heartbeat is not this one's: nothing is judged until a scrape of it.
    unread_for(c, 1000)
    assert c.phase == "Running" and c.status["restarts"] == 1
    # Scraped, but no step yet (a long start-up): counted from Running, with the same floor.
    running_since = parse_time(cond(c, "Running")["lastTransitionTime"])
    c.now = running_since + timedelta(seconds=299)
    scraped(c, last_step_ago=1500, step_time=2.0)
    c.reconcile()
    assert c.phase == "Running"
    quiet_for(c, 1)
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    assert "completed no step for 300s" in c.status["message"]
    assert (c.status["restarts"], c.status["disruptions"]) == (2, 2)


def test_the_default_stall_timeout_grows_with_the_measured_step_time():
    c = FakeCluster(job_body(nodes=1, runPolicy=FAST))
    running(c)
    scraped(c, last_step_ago=0, step_time=60.0)  # 10 x 60 s = 600 s
    quiet_for(c, 599)
    assert c.phase == "Running"
    scraped(c, last_step_ago=599, step_time=60.0)  # a later scrape, still the same heartbeat
    quiet_for(c, 1)
    assert c.phase == "Restarting" and "stall timeout of 600s" in c.status["message"]


def test_the_default_stall_timeout_waits_past_the_collective_timeout():
    c = FakeCluster(job_body(nodes=1, runPolicy={**FAST, "collectiveTimeoutSeconds": 600}))
    running(c)
    scraped(c, last_step_ago=0, step_time=2.0)  # max(10 x 2 s, 300 s, 600 s + 60 s) = 660 s
    quiet_for(c, 659)
    assert c.phase == "Running", "a hung collective must end as CollectiveTimeout, not Stalled"
    quiet_for(c, 1)
    assert c.phase == "Restarting" and (
        "stall timeout of 660s (the default: 10 x the step time, at least 660s)" in c.status["message"])


def test_a_collective_timeout_restarts_the_gang_naming_the_collective_and_its_peers():
    said = ("rank 0: gloo:all_reduce #41 in process group default_pg (ranks 0,1,2,3) timed out after 240s; "
            "not answering: rank 1")
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.finish(contract.EXIT_COLLECTIVE_TIMEOUT, rank=0,
             message=TerminationMessage(collective_timeout=said).encode())
    c.finish(contract.EXIT_COLLECTIVE_TIMEOUT, rank=1)  # no message: still the same reason
    d = c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "CollectiveTimeout"
    assert c.status["message"].startswith(f"pod job-r0-0 failed with exit code 79 in container trainer: "
                                          f"a collective timed out ({said}) (and 1 more); "
                                          f"restarting the whole gang as restart 1")
    assert (c.status["restarts"], c.status["disruptions"]) == (1, 0)  # a failure: it spends maxRestarts
    assert (c.events[-1].type, c.events[-1].reason) == ("Warning", "CollectiveTimeout")
    assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {"job-r0-0", "job-r0-1"}
    c.settle(60)
    running(c)
    c.finish(0)
    c.reconcile()
    assert c.phase == "Succeeded" and c.status["restarts"] == 1


def test_a_collective_timeout_is_permanent_only_when_the_user_says_so():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "maxRestarts": 0}))
    running(c)
    c.finish(contract.EXIT_COLLECTIVE_TIMEOUT, rank=1)
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "MaxRestartsExceeded"
    assert c.status["message"].startswith("pod job-r0-1 failed with exit code 79 in container trainer: "
                                          "a collective timed out; the gang was already restarted 0 times")
    permanent = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "permanentExitCodes": [78, 79]}))
    running(permanent)
    permanent.finish(contract.EXIT_COLLECTIVE_TIMEOUT, rank=0)
    permanent.reconcile()
    assert permanent.phase == "Failed" and cond(permanent, "Failed")["reason"] == "PermanentExitCode"


def test_a_steady_heartbeat_never_stalls_and_zero_disables_detection():
    c = FakeCluster(job_body(nodes=1, runPolicy=FAST))
    running(c)
    for _ in range(20):  # an hour of steps, each one seen by the scraper
        scraped(c, last_step_ago=5, step_time=2.0)
        quiet_for(c, 180)
    assert c.phase == "Running" and c.status["disruptions"] == 0
    off = FakeCluster(job_body(nodes=1, runPolicy={**FAST, "stallTimeoutSeconds": 0}))
    running(off)
    scraped(off, last_step_ago=0)
    d = quiet_for(off, 100_000)
    assert off.phase == "Running" and (d.requeue_after is None or d.requeue_after > 1000)


def test_an_explicit_stall_timeout_and_the_disruption_budget():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 50, "maxDisruptions": 1}))
    running(c)
    scraped(c, last_step_ago=0, step_time=30.0)  # explicit: the step time does not matter
    quiet_for(c, 50)
    assert cond(c, "Restarting")["reason"] == "Stalled"
    assert "stall timeout of 50s (spec.runPolicy.stallTimeoutSeconds)" in c.status["message"]
    c.settle(60)
    running(c)
    scraped(c, last_step_ago=0)
    quiet_for(c, 50)
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "DisruptionBudgetExceeded"
    assert "Stalled" not in c.status["message"] and "completed no step" in c.status["message"]


def test_a_stall_deadline_that_passed_after_the_last_read_asks_for_a_read_now():
    """The pass at the deadline cannot tell from a read made before it: it asks the controller to scrape
    now (whose write, the heartbeat unmoved, wakes the job) instead of waiting out the scrape interval."""
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 50}))
    running(c)
    scraped(c, last_step_ago=0)
    d = unread_for(c, 30)
    assert not d.read_now and d.requeue_after == 20  # the deadline's pass
    d = unread_for(c, 20)
    assert d.read_now and c.phase == "Running"  # no extrapolation: the last read saw 30 s of quiet
    d = unread_for(c, 5)
    assert d.read_now and c.phase == "Running"  # rank 0 did not answer: ask again, still no stall
    quiet_for(c, 0)  # the read
    assert cond(c, "Restarting")["reason"] == "Stalled"
    steady = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 50}))
    running(steady)
    for _ in range(5):
        scraped(steady, last_step_ago=1)
        assert not unread_for(steady, 15).read_now


def test_an_explicit_short_stall_timeout_spares_the_start_up_up_to_the_default_floor():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 30}))
    running(c)
    running_since = parse_time(cond(c, "Running")["lastTransitionTime"])
    scraped(c, last_step_ago=None)  # reachable, no step yet: importing torch, building, loading
    c.now = running_since + timedelta(seconds=299)
    quiet_for(c, 0)
    assert c.phase == "Running", "30 s is the timeout between steps, not for the start-up"
    quiet_for(c, 1)
    assert cond(c, "Restarting")["reason"] == "Stalled"
    assert ("completed no step for 300s, over the stall timeout of 300s (before the first step: "
            "at least 300s and 2 x the last start-up)") in c.status["message"]


def test_a_rank_0_that_stops_answering_is_judged_by_its_last_read_not_by_the_clock():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 30},
                             training={"globalBatch": 24, "steps": 100}))
    running(c)
    c.now += timedelta(seconds=60)
    scraped(c, last_step_ago=10, step=99)  # then the last step, its save and exit: no scrape sees them
    d = unread_for(c, 3600)
    assert c.phase == "Running" and c.status["disruptions"] == 0
    assert d.requeue_after is None or d.requeue_after >= 30, (
        "no timer spins on a verdict only a read can give")
    quiet_for(c, 0)  # it answers again, at the same step: 3,610 s without one
    assert cond(c, "Restarting")["reason"] == "Stalled" and "completed no step since" in c.status["message"]
    assert "for 3610s, over the stall timeout of 30s" in c.status["message"]


def test_after_the_last_step_a_long_save_and_exit_is_no_stall():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 30},
                             training={"globalBatch": 24, "steps": 100}))
    running(c)
    scraped(c, last_step_ago=0, step=99)
    quiet_for(c, 30)
    assert cond(c, "Restarting")["reason"] == "Stalled", "a step was still due"
    c.settle(60)
    running(c)
    scraped(c, last_step_ago=0, step=100)  # the last step: the trainer saves and exits, no step is due
    quiet_for(c, 3600)
    assert c.phase == "Running" and c.status["disruptions"] == 1
    c.finish(0)
    c.reconcile()
    assert c.phase == "Succeeded"


def test_before_the_first_step_a_start_up_like_the_last_one_is_no_stall():
    c = FakeCluster(job_body(nodes=1, runPolicy=FAST))
    running(c)
    running_since = parse_time(cond(c, "Running")["lastTransitionTime"])
    scraped(c, last_step_ago=None, step_time=2.0, startup=400.0)  # the last incarnation took 400 s to start
    c.now = running_since + timedelta(seconds=799)
    quiet_for(c, 0)
    assert c.phase == "Running"
    quiet_for(c, 1)
    assert c.phase == "Restarting" and ("completed no step for 800s, over the stall timeout of 800s"
                                        in c.status["message"])
    c.settle(60)
    running(c)
    scraped(c, last_step_ago=0, step_time=2.0, startup=400.0)  # once stepping, the start-up no longer counts
    quiet_for(c, 300)
    assert c.phase == "Restarting" and "stall timeout of 300s" in c.status["message"]


def test_a_scrape_that_never_succeeds_restarts_nothing():
    c = FakeCluster(job_body(nodes=1, runPolicy=FAST))
    running(c)
    quiet_for(c, 10_000)
    assert c.phase == "Running" and c.status["restarts"] == 0


# ---------------------------------------------------------------- scripts of one's own (spec.script)

SCRIPT = {"path": "/app/train.py"}


def script_body(**spec: object) -> dict:
    body = job_body(nodes=2, **{"runPolicy": FAST, "script": SCRIPT, **spec})
    del body["spec"]["training"]  # a script job gives none of the trainer's sections
    return body


def test_a_script_that_never_reports_is_never_stalled_one_that_reports_is():
    c = FakeCluster(script_body())
    running(c)
    scraped(c, last_step_ago=None)  # a metrics endpoint (the runtime library) but no step reported yet
    quiet_for(c, 100_000)
    assert c.phase == "Running" and c.status["disruptions"] == 0, "no heartbeat was promised: none is missed"
    scraped(c, last_step_ago=0, step_time=2.0, step=7)  # its first report: from now on it beats
    quiet_for(c, 300)
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    assert "rank 0 (job-r0-0) completed no step since" in c.status["message"]


def test_a_builtin_job_without_a_heartbeat_still_stalls_at_start_up():
    c = FakeCluster(job_body(nodes=1, runPolicy=FAST))
    running(c)
    scraped(c, last_step_ago=None)
    quiet_for(c, 300)
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"


def test_the_cause_a_node_names_is_the_jobs_reason_and_message():
    c = FakeCluster(script_body())
    running(c)
    said = "spec.script.path: /app/train.py is not a file in the image (working directory /)"
    c.finish(contract.EXIT_CONFIG_ERROR, rank=1,
             message=TerminationMessage(reason=contract.REASON_ENTRY_POINT, message=said).encode())
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "EntryPointNotFound"
    assert c.status["message"] == (f"pod job-r0-1 failed with exit code 78 in container trainer: {said}; "
                                   "exit code 78 is not retryable")


def test_a_scripts_own_exit_code_follows_the_exit_code_policy():
    retried = FakeCluster(script_body())
    running(retried)
    retried.finish(3, rank=0)  # sys.exit(3) on rank 0's node; the other node's workers were stopped
    retried.reconcile()
    assert retried.phase == "Restarting" and cond(retried, "Restarting")["reason"] == "PodFailed"
    assert retried.status["message"].startswith("pod job-r0-0 failed with exit code 3 in container trainer;")
    permanent = FakeCluster(script_body(runPolicy={**FAST, "permanentExitCodes": [3]}))
    running(permanent)
    permanent.finish(3, rank=0)
    permanent.reconcile()
    assert permanent.phase == "Failed" and cond(permanent, "Failed")["reason"] == "PermanentExitCode"


def test_a_container_the_image_cannot_start_fails_the_job_naming_the_image():
    c = FakeCluster(script_body())
    running(c)
    pod = c.pods["job-r0-1"]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {
        "exitCode": 128, "reason": "StartError",
        "message": 'failed to create containerd task: exec: "python3": '
                   "executable file not found in $PATH: unknown"}}}]
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "ContainerCannotStart"
    assert ('the container of pod job-r0-1 could not start: failed to create containerd task: '
            'exec: "python3"' in c.status["message"]
            and "spec.image must hold what the pods run: python3 with torch" in c.status["message"])
    transient = FakeCluster(script_body())
    running(transient)
    pod = transient.pods["job-r0-0"]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {
        "exitCode": 128, "reason": "StartError", "message": "context deadline exceeded"}}}]
    transient.reconcile()
    assert transient.phase == "Restarting", "a start error that is not about the image is retried"
