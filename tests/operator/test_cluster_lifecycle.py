"""The operator against a real API server, scheduler, controller-manager and kwok nodes.

The tests play the kubelet for pod outcomes: they patch pod status to Succeeded/Failed with the
trainer container's exit code (kwok only moves Pending pods to Running, so it keeps such patches).
"""

from __future__ import annotations

import json

import pytest

from tests.api.helpers import container_env
from tetrad.api import contract

from .helpers import (
    JOBS,
    condition,
    fake_node,
    finish_all,
    ptj,
    running_pods,
    terminate,
    wait_events,
    wait_for,
    wait_phase,
    wait_running,
)

pytestmark = pytest.mark.cluster


def test_job_runs_to_success_with_every_object_correct(api, operator, namespace):
    ns = namespace
    job = api.create_job(ns, ptj("train", nodes=3))
    uid = job["metadata"]["uid"]

    pods = wait_running(api, ns, "train", 3)
    assert sorted(p["metadata"]["name"] for p in pods) == ["train-r0-0", "train-r0-1", "train-r0-2"]
    shared = api.get(f"/api/v1/namespaces/{ns}/configmaps/train-env")
    assert shared["metadata"]["ownerReferences"][0]["uid"] == uid
    for p in pods:
        meta = p["metadata"]
        assert meta["ownerReferences"] == [{"apiVersion": "tetrad.dev/v1alpha1",
                                            "kind": "ParallelTrainingJob", "name": "train", "uid": uid,
                                            "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"][contract.LABEL_RESTART] == "0"
        assert not p["spec"].get("schedulingGates"), "the gang was released"
        assert "tetrad.dev/gang-released" in meta["annotations"]
        assert p["spec"]["nodeName"]
        env = container_env(p, {"train-env": shared["data"]})
        assert env["PET_NNODES"] == "3" and env["TETRAD_RESTART"] == "0"
        assert env["PET_MASTER_ADDR"] == f"train-0.train.{ns}.svc"
    svc = api.get(f"/api/v1/namespaces/{ns}/services/train")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"][0]["uid"] == uid
    cm = api.get(f"/api/v1/namespaces/{ns}/configmaps/train-config")
    config = json.loads(cm["data"]["config.json"])
    assert config["nodes"] == 3 and config["layout"]["dpShard"] == 3
    assert cm["metadata"]["ownerReferences"][0]["uid"] == uid

    st = api.status(ns, "train")
    assert st["worldSize"] == 3 and st["mesh"] == "pp1.dpr1.dps3.cp1.tp1"
    assert st["observedGeneration"] == 1 and st["startTime"] and st["restarts"] == 0
    assert condition(st, "Running")["status"] == "True"
    assert condition(st, "GangReleased")["status"] == "True"
    # Released at creation, the gang may never have waited; if it did, it waits no more.
    assert all(c["status"] == "False" for c in st["conditions"] if c["type"] == "GangWaiting")

    finish_all(api, ns, "train", 0)
    st = wait_phase(api, ns, "train", "Succeeded")
    assert st["completionTime"] and condition(st, "Succeeded")["reason"] == "Succeeded"
    assert not running_pods(api, ns, "train"), "no pod left Running after success"
    wait_events(api, ns, "train", "Succeeded")
    reasons = [e["reason"] for e in sorted(api.events(ns, "train"), key=lambda e: e["firstTimestamp"])]
    for r in ("Created", "AllPodsRunning", "Succeeded"):
        assert r in reasons, reasons
    assert all(e["source"]["component"] == "tetrad-operator" for e in api.events(ns, "train"))


def test_failed_pod_restarts_the_whole_gang_then_succeeds(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("flaky", nodes=2, runPolicy={"maxRestarts": 2}))
    wait_running(api, ns, "flaky", 2)
    terminate(api, ns, "flaky-r0-1", 1)

    wait_for(lambda: api.status(ns, "flaky").get("restarts") == 1, what="restart recorded")
    pods = wait_running(api, ns, "flaky", 2, restart=1)
    assert sorted(p["metadata"]["name"] for p in pods) == ["flaky-r1-0", "flaky-r1-1"]
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    assert env["TETRAD_RESTART"] == "1" and env["PET_RDZV_ID"].endswith("-1")
    assert not [p for p in api.pods(ns, "flaky") if p["metadata"]["labels"][contract.LABEL_RESTART] == "0"]
    # Left behind, the Restarting condition names the transition that ended it; the Event keeps why.
    assert condition(api.status(ns, "flaky"), "Restarting")["status"] == "False"
    failed = wait_events(api, ns, "flaky", "PodFailed")
    assert len(failed) == 1 and failed[0]["type"] == "Warning"
    assert "flaky-r0-1 failed with exit code 1" in failed[0]["message"]

    finish_all(api, ns, "flaky", 0)
    st = wait_phase(api, ns, "flaky", "Succeeded")
    assert (st["restarts"], st["disruptions"]) == (1, 0)


def test_max_restarts_exhausted_fails_with_reason(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("doomed", nodes=2, runPolicy={"maxRestarts": 1}))
    wait_running(api, ns, "doomed", 2)
    terminate(api, ns, "doomed-r0-0", 75)  # preempted: a disruption spends no budget
    wait_running(api, ns, "doomed", 2, restart=1)
    assert api.status(ns, "doomed")["disruptions"] == 1
    terminate(api, ns, "doomed-r1-0", 2)  # the one failure maxRestarts allows
    wait_running(api, ns, "doomed", 2, restart=2)
    terminate(api, ns, "doomed-r2-0", 2)
    st = wait_phase(api, ns, "doomed", "Failed")
    assert condition(st, "Failed")["reason"] == "MaxRestartsExceeded"
    assert "maxRestarts=1; 1 disruptions not counted" in st["message"]
    assert (st["restarts"], st["disruptions"]) == (2, 1)
    wait_for(lambda: not running_pods(api, ns, "doomed"),
             what="survivors cleaned up (cleanPodPolicy Running)")


def test_permanent_exit_code_fails_at_once(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("config-error", nodes=2))
    wait_running(api, ns, "config-error", 2)
    terminate(api, ns, "config-error-r0-1", 78)
    st = wait_phase(api, ns, "config-error", "Failed")
    assert condition(st, "Failed")["reason"] == "PermanentExitCode" and st["restarts"] == 0
    assert "exit code 78" in st["message"]


def test_evicted_pod_restarts_the_gang_even_with_a_retryable_list(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("evicted", nodes=2, runPolicy={"retryableExitCodes": [42]}))
    wait_running(api, ns, "evicted", 2)
    api.patch(f"/api/v1/namespaces/{ns}/pods/evicted-r0-0/status", {"status": {
        "phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}})
    wait_for(lambda: api.status(ns, "evicted").get("restarts") == 1, what="restart after the eviction")
    # kopf posts events in the background: the Warning may land just after the restart's status write
    wait_for(lambda: [e["reason"] for e in api.events(ns, "evicted")
                      if e["type"] == "Warning"] == ["PodEvicted"],
             timeout=30, what="one PodEvicted Warning")
    assert api.status(ns, "evicted")["disruptions"] == 1
    wait_running(api, ns, "evicted", 2, restart=1)


def test_deleted_node_restarts_the_gang(api, operator, namespace):
    ns = namespace
    pool = {"tetrad.dev/test-pool": ns}
    for i in range(3):
        api.create("/api/v1/nodes", fake_node(f"{ns}-n{i}", cpu="4", labels=pool))
    try:
        # Each node fits one pod: the 2-pod gang runs on two of the three nodes.
        api.create_job(ns, ptj("lost", nodes=2, cpu="3", template={"nodeSelector": pool}))
        pods = wait_running(api, ns, "lost", 2, timeout=60)
        victim = pods[0]["spec"]["nodeName"]
        api.delete(f"/api/v1/nodes/{victim}")
        wait_for(lambda: api.status(ns, "lost").get("restarts") == 1, what="restart after the node loss")
        lost = wait_events(api, ns, "lost", "NodeLost")
        assert len(lost) == 1 and f"node {victim} no longer exists" in lost[0]["message"]
        pods = wait_running(api, ns, "lost", 2, restart=1, timeout=60)
        assert victim not in {p["spec"]["nodeName"] for p in pods}
        assert not [p for p in api.pods(ns, "lost") if p["spec"].get("nodeName") == victim]
    finally:
        for i in range(3):
            api.delete(f"/api/v1/nodes/{ns}-n{i}")


def test_suspend_deletes_pods_and_resume_recreates_them(api, operator, namespace):
    ns = namespace
    path = f"{JOBS}/namespaces/{ns}/paralleltrainingjobs/pausable"
    api.create_job(ns, ptj("pausable", nodes=2))
    wait_running(api, ns, "pausable", 2)
    api.patch(path, {"spec": {"runPolicy": {"suspend": True}}})
    st = wait_phase(api, ns, "pausable", "Suspended")
    assert st["observedGeneration"] == 2 and condition(st, "Suspended")["status"] == "True"
    wait_for(lambda: not api.pods(ns, "pausable"), what="pods deleted on suspend")
    assert api.job(ns, "pausable") is not None
    api.patch(path, {"spec": {"runPolicy": {"suspend": False}}})
    pods = wait_running(api, ns, "pausable", 2)
    assert sorted(p["metadata"]["name"] for p in pods) == ["pausable-r0-0", "pausable-r0-1"]
    assert api.status(ns, "pausable")["restarts"] == 0


def test_deleting_the_job_garbage_collects_every_owned_object(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("gone", nodes=2))
    wait_running(api, ns, "gone", 2)
    api.delete(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs/gone")
    wait_for(lambda: api.job(ns, "gone") is None, what="job deleted")
    wait_for(lambda: not api.pods(ns, "gone"), timeout=60, what="pods garbage-collected")
    wait_for(lambda: api.get(f"/api/v1/namespaces/{ns}/services/gone") is None, timeout=60, what="service GC")
    wait_for(lambda: api.get(f"/api/v1/namespaces/{ns}/configmaps/gone-config") is None, timeout=60,
             what="configmap GC")


def test_ttl_deletes_the_finished_job(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("short-lived", nodes=1, runPolicy={"ttlSecondsAfterFinished": 2}))
    wait_running(api, ns, "short-lived", 1)
    finish_all(api, ns, "short-lived", 0)
    wait_phase(api, ns, "short-lived", "Succeeded")
    assert api.job(ns, "short-lived") is not None
    wait_for(lambda: api.job(ns, "short-lived") is None, timeout=30, what="TTL deletion")


def test_active_deadline_fails_the_job(api, operator, namespace):
    ns = namespace
    # long enough for the pod to run first on a loaded machine (3 s was not, once in CI)
    api.create_job(ns, ptj("slow", nodes=1, runPolicy={"activeDeadlineSeconds": 10}))
    wait_running(api, ns, "slow", 1)
    st = wait_phase(api, ns, "slow", "Failed", timeout=25)
    assert condition(st, "Failed")["reason"] == "DeadlineExceeded"
    wait_for(lambda: not running_pods(api, ns, "slow"), what="running pods deleted")
