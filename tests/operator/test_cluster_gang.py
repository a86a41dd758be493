"""Gang scheduling in a real cluster: capacity holds, competing gangs, and the scheduler adapters."""

from __future__ import annotations

import time

import pytest
from tetrad_operator import admission

from tetrad.api import contract

from .helpers import JOBS, condition, finish_all, ptj, takes_pods, wait_for, wait_phase, wait_running

pytestmark = pytest.mark.cluster


def pool_job(name: str, pool, nodes: int, cpu: str = "6"):
    return ptj(name, nodes=nodes, cpu=cpu, template={"nodeSelector": pool.label})


def gated(api, ns, job):
    pods = api.pods(ns, job)
    return pods and all(p["spec"].get("schedulingGates") == [{"name": contract.GANG_GATE}] for p in pods)


def test_gang_holds_while_capacity_is_short_and_goes_when_it_frees(api, operator, namespace, pool):
    ns = namespace
    pool(2)
    api.create_job(ns, pool_job("big", pool, nodes=3))
    st = wait_phase(api, ns, "big", "GangWaiting")
    assert condition(st, "GangReleased")["reason"] == "WaitingForCapacity"
    wait_for(lambda: gated(api, ns, "big") and len(api.pods(ns, "big")) == 3, what="3 gated pods")
    # Nothing was released part-way: no pod of the gang is bound while it waits.
    assert not [p for p in api.pods(ns, "big") if p["spec"].get("nodeName")]
    pool(1)
    pods = wait_running(api, ns, "big", 3, timeout=30)
    assert len({p["spec"]["nodeName"] for p in pods}) == 3


def test_a_gang_that_fits_at_creation_is_created_released_one_write_per_pod(api, operator, namespace, pool,
                                                                           monkeypatch):
    """Then the job is deleted, and a job of its size created in its place is created released too: the
    admission, which remembers a release until the watch shows it, takes the pods' deletion for an end."""
    ns = namespace
    # A release not seen counts from memory for RELEASE_SEEN_SECONDS: longer than this test, so that only
    # the deletion can end it.
    monkeypatch.setattr(admission, "RELEASE_SEEN_SECONDS", 600.0)
    # Only this job's pods may use the pool: another test's pod there would make the gang wait.
    taint = {"key": "tetrad.dev/test-pool", "value": ns, "effect": "NoSchedule"}
    names = pool(2, taints=[taint])
    # The fit at creation reads the operator's own view of the nodes, which may lag the API's.
    wait_for(lambda: {n.name for n in operator.controller.nodes() if takes_pods(n)} >= set(names),
             what="the operator's node view shows the pool taking pods")
    api.create_job(ns, ptj("fits", nodes=2, cpu="6", template={
        "nodeSelector": pool.label, "tolerations": [{**taint, "operator": "Equal"}]}))
    pods = wait_running(api, ns, "fits", 2)
    st = api.status(ns, "fits")
    assert (condition(st, "GangReleased")["status"] == "True"
            and condition(st, "GangReleased")["reason"] == "Admitted")
    for p in pods:
        assert (not p["spec"].get("schedulingGates")
                and "tetrad.dev/gang-released" in p["metadata"]["annotations"])
        assert p["metadata"]["generation"] == 1, "the pod's spec was written once: created without its gate"
    assert "WaitingForCapacity" not in [e["reason"] for e in api.events(ns, "fits")]
    # No admission round ran since the release (no gang waited): the deletion is what it learns from.
    api.delete(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs/fits")
    wait_for(lambda: not [p for i in operator.controller.admission.informers for p in i.items.values()
                          if p.job == "fits"], what="the operator's view of fits' pods deleted", timeout=120)
    api.create_job(ns, ptj("next", nodes=2, cpu="6", template={
        "nodeSelector": pool.label, "tolerations": [{**taint, "operator": "Equal"}]}))
    wait_running(api, ns, "next", 2)
    assert all(p["metadata"]["generation"] == 1 for p in api.pods(ns, "next")), "created released"
    assert "WaitingForCapacity" not in [e["reason"] for e in api.events(ns, "next")]


def test_two_gangs_that_fit_only_one_at_a_time_do_not_deadlock(api, operator, namespace, pool):
    ns = namespace
    pool(2)
    # Each gang takes 6 of a node's 8 cpus on both nodes: either fits alone, not both together.
    api.create_job(ns, pool_job("first", pool, nodes=2))
    api.create_job(ns, pool_job("second", pool, nodes=2))
    # The oldest complete gang goes first; which gang completes first depends on the watch.
    running = wait_for(lambda: [j for j in ("first", "second")
                                if api.status(ns, j).get("phase") == "Running"],
                       what="one gang running")
    assert len(running) == 1
    winner, waiter = running[0], ({"first", "second"} - set(running)).pop()
    wait_running(api, ns, winner, 2)
    wait_phase(api, ns, waiter, "GangWaiting")
    assert gated(api, ns, waiter)
    assert not [p for p in api.pods(ns, waiter) if p["spec"].get("nodeName")]
    time.sleep(2)  # several admission rounds pass: the waiter keeps waiting
    assert gated(api, ns, waiter) and api.status(ns, winner)["phase"] == "Running"
    finish_all(api, ns, winner, 0)
    wait_phase(api, ns, winner, "Succeeded")
    wait_running(api, ns, waiter, 2, timeout=30)


def test_volcano_pod_group(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("vj", nodes=3, cpu="2", gang={"scheduler": "volcano", "queue": "research"}))
    pg = wait_for(lambda: api.get(f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{ns}/podgroups/vj"),
                  what="PodGroup")
    assert pg["spec"]["minMember"] == 3 and pg["spec"]["queue"] == "research"
    assert pg["spec"]["minResources"] == {"cpu": "6", "memory": "3Gi"}
    assert pg["metadata"]["ownerReferences"][0]["name"] == "vj"
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == 3 else None)(api.pods(ns, "vj")), what="3 pods")
    for p in pods:
        assert p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "vj"
        assert p["spec"]["schedulerName"] == "volcano"
        assert not p["spec"].get("schedulingGates")
    # No Volcano scheduler runs here: the gang waits for it.
    st = wait_phase(api, ns, "vj", "GangWaiting")
    assert condition(st, "GangWaiting")["reason"] == "WaitingForScheduler"


def test_gang_timeout_regates_a_gang_the_scheduler_cannot_place(api, operator, namespace, pool):
    ns = namespace
    pool(1)
    # The fit counts resources, not pod anti-affinity: it releases both pods onto the one node,
    # where the scheduler can place only one. The gang times out and goes back behind its gate.
    anti = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {contract.LABEL_JOB: "spread"}},
         "topologyKey": "kubernetes.io/hostname"}]}}
    api.create_job(ns, ptj("spread", nodes=2, cpu="1",
                           template={"nodeSelector": pool.label, "affinity": anti},
                           gang={"timeoutSeconds": 3}))
    timeout = wait_for(lambda: [e for e in api.events(ns, "spread") if e["reason"] == "GangTimeout"],
                       timeout=40, what="a GangTimeout event")
    assert timeout[0]["type"] == "Warning" and "still unscheduled 3s after release" in timeout[0]["message"]
    st = api.status(ns, "spread")
    assert st["restarts"] == 0, "a gang timeout is not a restart"
    pool(1)  # room for the second pod: the next release places both
    pods = wait_running(api, ns, "spread", 2, timeout=60)
    assert len({p["spec"]["nodeName"] for p in pods}) == 2
    assert api.status(ns, "spread")["restarts"] == 0
