"""gang.scheduler=workload against the real 1.36 kube-scheduler with the Workload-Aware Scheduling
gates (hack/cluster.sh turns them on), and gang.topologyKey placing pipeline stages by rack."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tetrad.api import contract

from .helpers import Api, condition, finish_all, ptj, terminate, wait_for, wait_phase, wait_running

pytestmark = pytest.mark.cluster

WORKLOAD_API = "/apis/scheduling.k8s.io/v1alpha2"
RACK = "tetrad.dev/test-rack"


def pool_job(name: str, pool: Any, nodes: int, cpu: str = "6", **spec: Any) -> dict[str, Any]:
    gang = {"scheduler": "workload", **spec.pop("gang", {})}
    return ptj(name, nodes=nodes, cpu=cpu, template={"nodeSelector": pool.label}, gang=gang, **spec)


def workload_objects(api: Api, ns: str, kind: str) -> list[str]:
    return sorted(o["metadata"]["name"] for o in api.list(f"{WORKLOAD_API}/namespaces/{ns}/{kind}")
                  if not o["metadata"].get("deletionTimestamp"))


def bound(api: Api, ns: str, job: str) -> list[dict[str, Any]]:
    return [p for p in api.pods(ns, job) if p["spec"].get("nodeName")]


def placement(api: Api, ns: str, job: str) -> str:
    """Where each pod of the gang is and what the scheduler last said, and the PodGroup's conditions:
    what a timed-out wait shows."""
    lines = []
    for p in api.pods(ns, job):
        said = next((c.get("message", "") for c in p["status"].get("conditions") or []
                     if c["type"] == "PodScheduled"), "")
        lines.append(f"{p['metadata']['name']}: node {p['spec'].get('nodeName')}, {p['status'].get('phase')}"
                     f" {said}")
    for pg in api.list(f"{WORKLOAD_API}/namespaces/{ns}/podgroups"):
        lines.append(f"PodGroup {pg['metadata']['name']}: {pg.get('status', {}).get('conditions')}")
    return "\n".join(lines)


def stays_unbound(api: Api, ns: str, job: str, pods: int, seconds: float = 4) -> None:
    """Every pod exists and none is bound for `seconds` (the scheduler has had its tries)."""
    wait_for(lambda: len(api.pods(ns, job)) == pods, what=f"{pods} pods of {job}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not bound(api, ns, job), f"part of gang {job} was bound"
        time.sleep(0.2)


def test_the_kube_scheduler_binds_the_gang_only_when_all_of_it_fits(api, operator, namespace, pool):
    ns = namespace
    pool(2)  # each pod takes 6 of a node's 8 cpus: two of the three fit
    api.create_job(ns, pool_job("wl", pool, nodes=3))
    wl = wait_for(lambda: api.get(f"{WORKLOAD_API}/namespaces/{ns}/workloads/wl-r0"), what="the Workload")
    (template,) = wl["spec"]["podGroupTemplates"]
    assert template["name"] == "workers" and template["schedulingPolicy"] == {"gang": {"minCount": 3}}
    assert wl["metadata"]["ownerReferences"][0]["name"] == "wl"
    pg = wait_for(lambda: api.get(f"{WORKLOAD_API}/namespaces/{ns}/podgroups/wl-r0"), what="the PodGroup")
    assert pg["spec"]["podGroupTemplateRef"]["workload"]["workloadName"] == "wl-r0"
    st = wait_phase(api, ns, "wl", "GangWaiting")
    assert "workload" in st["message"]
    # The real scheduler could place two pods, but places none: the gang does not fit.
    stays_unbound(api, ns, "wl", 3)
    for p in api.pods(ns, "wl"):
        assert (p["spec"]["schedulingGroup"] == {"podGroupName": "wl-r0"}
                and not p["spec"].get("schedulingGates"))
    pg = api.get(f"{WORKLOAD_API}/namespaces/{ns}/podgroups/wl-r0")
    scheduled = next(c for c in pg["status"]["conditions"] if c["type"] == "PodGroupScheduled")
    assert scheduled["status"] == "False" and scheduled["reason"] == "Unschedulable"
    pool(1)
    try:  # the scheduler retries the gang at once on the new node; a loaded CI machine once took over 60 s
        pods = wait_running(api, ns, "wl", 3, timeout=120)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{placement(api, ns, 'wl')}") from None
    assert len({p["spec"]["nodeName"] for p in pods}) == 3


def test_a_whole_gang_restart_schedules_through_the_new_incarnations_pod_group(
        api, operator, namespace, pool):
    ns = namespace
    pool(2)
    api.create_job(ns, pool_job("re", pool, nodes=2))
    wait_running(api, ns, "re", 2, timeout=60)
    terminate(api, ns, "re-r0-1", 1)  # a failure: the whole gang restarts
    pods = wait_running(api, ns, "re", 2, restart=1, timeout=60)
    assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {"re-r1"}
    # The old incarnation's Workload and PodGroup are gone (the PodGroup once its pods were).
    wait_for(lambda: workload_objects(api, ns, "podgroups") == ["re-r1"], timeout=30,
             what="only re-r1's PodGroup")
    wait_for(lambda: workload_objects(api, ns, "workloads") == ["re-r1"], timeout=30,
             what="only re-r1's Workload")
    assert api.status(ns, "re")["restarts"] == 1
    finish_all(api, ns, "re", 0)
    wait_phase(api, ns, "re", "Succeeded")


def node_racks(api: Api) -> dict[str, str | None]:
    return {n["metadata"]["name"]: n["metadata"]["labels"].get(RACK) for n in api.list("/api/v1/nodes")}


def stage_racks(api: Api, ns: str, job: str) -> dict[str, set[str]]:
    racks = node_racks(api)
    out: dict[str, set[str]] = {}
    for p in bound(api, ns, job):
        out.setdefault(p["metadata"]["labels"]["tetrad.dev/pipeline-stage"], set()).add(
            racks[p["spec"]["nodeName"]])
    return out


def test_each_pipeline_stage_lands_in_one_rack(api, operator, namespace, pool):
    """pp=2 over 4 whole-node pods, gang.topologyKey = a rack label: while no rack holds a stage
    (one node per rack) nothing binds; with racks of two nodes each stage lands in one rack."""
    ns = namespace
    for r in range(3):
        pool(1, labels={RACK: f"{ns}-rack-{r}"})
    spec = {"parallelism": {"pp": 2, "dpShard": "auto"}, "gang": {"topologyKey": RACK}}
    api.create_job(ns, pool_job("pp", pool, nodes=4, **spec))
    stays_unbound(api, ns, "pp", 4)
    for r in range(3):  # three racks of two nodes: room for both stages, four nodes to spare
        pool(1, labels={RACK: f"{ns}-rack-{r}"})
    pool(2)  # and two nodes outside any rack
    wait_running(api, ns, "pp", 4, timeout=60)
    racks = stage_racks(api, ns, "pp")
    assert set(racks) == {"0", "1"} and all(len(r) == 1 and None not in r for r in racks.values()), racks
    assert racks["0"] != racks["1"]  # a rack of two nodes holds one stage's two pods


def test_the_builtin_gang_places_each_pipeline_stage_in_one_rack(api, operator, namespace, pool):
    """The default backend: the operator's fit keeps the gang behind its gate while no rack holds a
    stage (no release, so no gang timeout), then releases each stage pinned to the rack the fit chose
    (its pods' nodeSelector). Racks of mixed sizes: the kube-scheduler places a stage's first pod
    alone, and unpinned it could take a rack of one node, where the stage's second pod never binds.
    A second such job, which fits when it is created, is created released and pinned alike."""
    ns = namespace
    for r in range(4):  # room for four pods, but no rack holds a stage
        pool(1, labels={RACK: f"{ns}-rack-{r}"})
    # Gated for longer than the gang timeout, which must not fire; once released, the scheduler gets
    # the timeout to bind the four pods.
    spec = {"parallelism": {"pp": 2, "dpShard": "auto"},
            "gang": {"scheduler": "builtin", "topologyKey": RACK, "timeoutSeconds": 45}}
    api.create_job(ns, pool_job("bi", pool, nodes=4, **spec))
    st = wait_phase(api, ns, "bi", "GangWaiting")
    assert condition(st, "GangReleased")["reason"] == "WaitingForCapacity"
    stays_unbound(api, ns, "bi", 4, seconds=48)
    assert all(p["spec"].get("schedulingGates") for p in api.pods(ns, "bi"))
    for r in range(2):  # racks 0 and 1 now hold a stage each; racks 2 and 3 still one node
        pool(1, labels={RACK: f"{ns}-rack-{r}"})
    on = node_racks(api)

    def pinned_by_stage(job: str) -> None:
        wait_running(api, ns, job, 4, timeout=60)
        racks = stage_racks(api, ns, job)
        assert racks == {"0": {f"{ns}-rack-0"}, "1": {f"{ns}-rack-1"}}, racks
        for p in bound(api, ns, job):
            assert p["spec"]["nodeSelector"][RACK] == on[p["spec"]["nodeName"]], p["metadata"]["name"]
        assert api.status(ns, job)["restarts"] == 0
        assert not [e for e in api.events(ns, job) if e["reason"] == "GangTimeout"]

    pinned_by_stage("bi")
    # A gang that fits when it is created goes out released, already pinned (one write per pod).
    finish_all(api, ns, "bi", 0)
    wait_phase(api, ns, "bi", "Succeeded")
    # The fit at creation reads the operator's own view of the pods, which may lag the API's.
    wait_for(lambda: not [p for i in operator.controller.admission.informers for p in i.items.values()
                          if p.job == "bi" and not p.terminal], what="the operator's view of bi's pods ended")
    api.create_job(ns, pool_job("again", pool, nodes=4, **spec))
    pinned_by_stage("again")
    assert all(p["metadata"]["generation"] == 1 for p in api.pods(ns, "again")), "created released"
    assert "WaitingForCapacity" not in [e["reason"] for e in api.events(ns, "again")]


def test_a_single_stage_uses_the_pod_groups_topology_constraint(api, operator, namespace, pool):
    """pp=1: the whole gang in one rack through the PodGroup's schedulingConstraints (the scheduler's
    TopologyAwareWorkloadScheduling), with no pod affinity."""
    ns = namespace
    pool(1, labels={RACK: f"{ns}-a"})
    pool(1, labels={RACK: f"{ns}-b"})
    api.create_job(ns, pool_job("tas", pool, nodes=2, gang={"topologyKey": RACK}))
    pg = wait_for(lambda: api.get(f"{WORKLOAD_API}/namespaces/{ns}/podgroups/tas-r0"), what="the PodGroup")
    assert pg["spec"]["schedulingConstraints"] == {"topology": [{"key": RACK}]}
    stays_unbound(api, ns, "tas", 2)  # two free nodes, but in two racks
    assert not any(p["spec"].get("affinity") for p in api.pods(ns, "tas"))
    new = pool(1, labels={RACK: f"{ns}-b"})
    pods = wait_running(api, ns, "tas", 2, timeout=60)
    assert {p["spec"]["nodeName"] for p in pods} == {f"{ns}-n1", *new}
    assert {p["metadata"]["labels"][contract.LABEL_JOB] for p in pods} == {"tas"}


def test_a_resumed_job_schedules_again_through_its_pod_group(api, operator, namespace, pool):
    """Suspend deletes the pods and keeps the incarnation's Workload and PodGroup; the resumed
    pods of the same restart name the same PodGroup and the scheduler places them as a gang."""
    ns = namespace
    pool(2)
    api.create_job(ns, pool_job("sus", pool, nodes=2))
    wait_running(api, ns, "sus", 2, timeout=60)
    job = f"/apis/tetrad.dev/v1alpha1/namespaces/{ns}/paralleltrainingjobs/sus"
    api.patch(job, {"spec": {"runPolicy": {"suspend": True}}})
    wait_phase(api, ns, "sus", "Suspended", timeout=60)
    wait_for(lambda: not api.pods(ns, "sus"), timeout=60, what="the pods gone")
    assert workload_objects(api, ns, "podgroups") == ["sus-r0"]
    api.patch(job, {"spec": {"runPolicy": {"suspend": False}}})
    pods = wait_running(api, ns, "sus", 2, timeout=60)
    assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {"sus-r0"}
