"""gang.scheduler=coscheduling against the real scheduler-plugins scheduler and PodGroup controller
(built from Go modules, started by `hack/cluster.sh scheduler coscheduling`) on kwok nodes."""

from __future__ import annotations

import time

import pytest

from .helpers import condition, finish_all, ptj, terminate, wait_for, wait_phase, wait_running

pytestmark = pytest.mark.cluster

SCHEDULER = "scheduler-plugins-scheduler"
GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


def podgroups(ns: str, name: str = "") -> str:
    return f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{ns}/podgroups" + (f"/{name}" if name else "")


def cosched_job(name: str, pool, nodes: int = 2, cpu: str = "6", timeout: int = 10):
    """Each pod takes 6 of a pool node's 8 cpus: two such gangs never fit on the same nodes."""
    return ptj(name, nodes=nodes, cpu=cpu, template={"nodeSelector": pool.label},
               gang={"scheduler": "coscheduling", "timeoutSeconds": timeout})


def bound(api, ns: str, job: str) -> list[dict]:
    return [p for p in api.pods(ns, job) if p["spec"].get("nodeName")]


def binders(api, ns: str, pods: list[dict]) -> set[str]:
    """Who reported each pod's Scheduled event (a scheduler reports under its profile's name)."""
    names = {p["metadata"]["name"] for p in pods}
    events = [e for e in api.list(f"/api/v1/namespaces/{ns}/events", fieldSelector="reason=Scheduled")
              if e["involvedObject"]["name"] in names]
    assert {e["involvedObject"]["name"] for e in events} == names, "a Scheduled event for every pod"
    return {e.get("reportingComponent") or e["source"]["component"] for e in events}


def group_phase(api, ns: str, name: str) -> str | None:
    pg = api.get(podgroups(ns, name))
    return ((pg or {}).get("status") or {}).get("phase")


def test_a_job_is_gang_scheduled_by_scheduler_plugins_and_succeeds(
        api, coscheduling, operator, namespace, pool):
    ns = namespace
    pool(2)
    api.create_job(ns, cosched_job("cj", pool))
    pg = wait_for(lambda: api.get(podgroups(ns, "cj-r0")), what="the PodGroup of restart 0")
    assert pg["spec"] == {"minMember": 2, "minResources": {"cpu": "12", "memory": "2Gi"},
                          "scheduleTimeoutSeconds": 10}
    assert pg["metadata"]["ownerReferences"][0]["name"] == "cj"
    pods = wait_running(api, ns, "cj", 2, timeout=90)
    for p in pods:
        assert p["spec"]["schedulerName"] == SCHEDULER and p["metadata"]["labels"][GROUP_LABEL] == "cj-r0"
        assert not p["spec"].get("schedulingGates")
    assert len({p["spec"]["nodeName"] for p in pods}) == 2
    assert wait_for(lambda: binders(api, ns, pods), what="the pods' Scheduled events") == {SCHEDULER}
    # Its controller follows the group: Running, then Finished once every pod succeeded.
    wait_for(lambda: group_phase(api, ns, "cj-r0") == "Running", timeout=30, what="PodGroup Running")
    finish_all(api, ns, "cj", 0)
    wait_phase(api, ns, "cj", "Succeeded")
    wait_for(lambda: group_phase(api, ns, "cj-r0") == "Finished", timeout=30, what="PodGroup Finished")


def test_two_gangs_with_room_for_one_and_a_half_run_one_after_the_other(
        api, coscheduling, operator, namespace, pool):
    """All or nothing, and no deadlock: two 3-pod gangs on 4 nodes can each take two nodes and wait
    for a third forever (Volcano #3373, scheduler-plugins #713); here one runs whole, the other has
    no pod bound although a node has room for one, and starts once the first finishes."""
    ns = namespace
    pool(4)
    api.create_job(ns, cosched_job("first", pool, nodes=3))
    api.create_job(ns, cosched_job("second", pool, nodes=3))
    running = wait_for(lambda: [j for j in ("first", "second")
                                if api.status(ns, j).get("phase") == "Running"],
                       timeout=120, what="one gang running")
    assert len(running) == 1
    winner, waiter = running[0], ({"first", "second"} - set(running)).pop()
    wait_running(api, ns, winner, 3)
    st = wait_phase(api, ns, waiter, "GangWaiting")
    assert condition(st, "GangWaiting")["reason"] == "WaitingForScheduler"
    # Its status gives the scheduler's reason, as the pods' PodScheduled condition says it.
    # e.g. "0/1 nodes are available: 1 optimistic rejection in PostFilter."
    wait_for(lambda: api.status(ns, waiter)["message"].partition("place and start them: ")[2], timeout=60,
             what="the scheduler's reason in the waiter's status")
    for _ in range(30):  # past its 10 s permit timeout: the waiter goes round the scheduler, none bound
        assert not bound(api, ns, waiter) and len(bound(api, ns, winner)) == 3
        time.sleep(0.5)
    finish_all(api, ns, winner, 0)
    wait_phase(api, ns, winner, "Succeeded")
    pods = wait_running(api, ns, waiter, 3, timeout=120)
    assert binders(api, ns, pods) == {SCHEDULER}


def test_a_whole_gang_restart_is_scheduled_again_through_a_new_pod_group(
        api, coscheduling, operator, namespace, pool):
    ns = namespace
    pool(2)
    api.create_job(ns, cosched_job("re", pool))
    wait_running(api, ns, "re", 2, timeout=90)
    terminate(api, ns, "re-r0-1", 1)  # a failure: the whole gang restarts
    pods = wait_running(api, ns, "re", 2, restart=1, timeout=120)
    assert {p["metadata"]["labels"][GROUP_LABEL] for p in pods} == {"re-r1"}
    assert wait_for(lambda: binders(api, ns, pods), what="the new pods' Scheduled events") == {SCHEDULER}
    # The failed incarnation's PodGroup (left Failed by its controller for good) is gone.
    wait_for(lambda: [g["metadata"]["name"] for g in api.list(podgroups(ns))] == ["re-r1"], timeout=30,
             what="only re-r1's PodGroup")
    assert api.status(ns, "re")["restarts"] == 1
    finish_all(api, ns, "re", 0)
    wait_phase(api, ns, "re", "Succeeded")
