"""gang.scheduler=kueue against the real Kueue manager (built from Go modules, started by
`hack/cluster.sh scheduler kueue`) with its pod-group integration, on kwok nodes."""

from __future__ import annotations

import time

import pytest

from tetrad.api import contract

from .helpers import (
    condition,
    condition_true,
    finish_all,
    ptj,
    terminate,
    wait_events,
    wait_for,
    wait_phase,
    wait_running,
)

pytestmark = pytest.mark.cluster

KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
ADMISSION_GATE = "kueue.x-k8s.io/admission"


@pytest.fixture
def queue(api, kueue, namespace):
    """A ClusterQueue of 16 GPUs (two 8-GPU pods) for this namespace, and its LocalQueue `team-a`."""
    name = f"cq-{namespace}"
    if not api.get(f"{KUEUE}/resourceflavors/default-flavor"):
        api.create(f"{KUEUE}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2",
                                                "kind": "ResourceFlavor",
                                                "metadata": {"name": "default-flavor"}})
    api.create(f"{KUEUE}/clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                 "preemption": {"withinClusterQueue": "LowerPriority"},
                 "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [
                     {"name": "default-flavor", "resources": [
                         {"name": "cpu", "nominalQuota": "64"}, {"name": "memory", "nominalQuota": "256Gi"},
                         {"name": "nvidia.com/gpu", "nominalQuota": "16"}]}]}]}})
    api.create(f"{KUEUE}/namespaces/{namespace}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team-a"},
        "spec": {"clusterQueue": name}})
    wait_for(lambda: condition_true(api.get(f"{KUEUE}/clusterqueues/{name}").get("status"), "Active"),
             timeout=60, what="the ClusterQueue Active")
    yield name
    api.delete(f"{KUEUE}/clusterqueues/{name}")


def kueue_job(name: str, nodes: int = 2, **spec):
    body = ptj(name, nodes=nodes, gang={"scheduler": "kueue", "queue": "team-a"}, **spec)
    body["spec"]["resources"]["gpu"] = body["spec"]["nprocPerNode"] = 8
    return body


def workloads(api, ns: str) -> list[dict]:
    return api.list(f"{KUEUE}/namespaces/{ns}/workloads")


def admission_gated(pods: list[dict]) -> bool:
    return bool(pods) and all(ADMISSION_GATE in [g["name"] for g in p["spec"].get("schedulingGates") or []]
                              and not p["spec"].get("nodeName") for p in pods)


def priority_class(api, name: str, value: int) -> str:
    if not api.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}"):
        api.create("/apis/scheduling.k8s.io/v1/priorityclasses",
                   {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                    "value": value})
    return name


def test_a_job_is_admitted_by_kueue_then_runs_and_succeeds(api, queue, operator, namespace):
    ns = namespace
    api.create_job(ns, kueue_job("kj"))
    pods = wait_running(api, ns, "kj", 2, timeout=90)
    wl = wait_for(lambda: workloads(api, ns), what="Kueue's Workload of the pod group")
    assert [w["metadata"]["name"] for w in wl] == ["kj"]  # the pod group's name
    assert condition(wl[0]["status"], "Admitted")["status"] == "True"
    assert wl[0]["status"]["admission"]["clusterQueue"] == queue
    # one podset of both pods, though rank 0's pod has ports the other has not
    assert [(ps["name"], ps["count"]) for ps in wl[0]["spec"]["podSets"]] == [("trainer", 2)]
    for p in pods:  # Kueue's webhook took them (its finalizer), its admission released them (no gate left)
        labels, annotations = p["metadata"]["labels"], p["metadata"]["annotations"]
        assert (labels["kueue.x-k8s.io/queue-name"] == "team-a"
                and labels["kueue.x-k8s.io/pod-group-name"] == "kj")
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "2"
        assert "kueue.x-k8s.io/managed" in p["metadata"]["finalizers"]
        assert not p["spec"].get("schedulingGates")
    finish_all(api, ns, "kj", 0)
    wait_phase(api, ns, "kj", "Succeeded")
    wait_for(lambda: condition_true(api.get(f"{KUEUE}/namespaces/{ns}/workloads/kj").get("status"),
                                    "Finished"),
             what="the Workload Finished")


def test_two_jobs_over_the_quota_one_waits_for_it_and_says_why(api, queue, operator, namespace):
    ns = namespace
    api.create_job(ns, kueue_job("first"))
    wait_running(api, ns, "first", 2, timeout=90)
    api.create_job(ns, kueue_job("second"))
    st = wait_phase(api, ns, "second", "GangWaiting")
    st = wait_for(lambda: (lambda s: s if condition(s, "GangWaiting")["reason"] == "WaitingForQueue"
                           else None)(api.status(ns, "second")), what="second waiting for its queue")
    assert "kueue has not admitted them: couldn't assign flavors" in st["message"]
    assert "insufficient unused quota for nvidia.com/gpu" in st["message"]
    assert wait_events(api, ns, "second", "WaitingForQueue", "insufficient unused quota")
    for _ in range(10):  # over the quota: not one pod of it is bound
        assert admission_gated(api.pods(ns, "second"))
        time.sleep(0.3)
    finish_all(api, ns, "first", 0)
    wait_phase(api, ns, "first", "Succeeded")
    wait_running(api, ns, "second", 2, timeout=90)
    finish_all(api, ns, "second", 0)
    wait_phase(api, ns, "second", "Succeeded")


def test_a_higher_priority_job_preempts_a_lower_one_which_checkpoints_and_resumes(
        api, queue, operator, namespace):
    ns = namespace
    low = priority_class(api, "tetrad-test-low", 10)
    high = priority_class(api, "tetrad-test-high", 1000)
    api.create_job(ns, kueue_job("low", template={"priorityClassName": low}))
    wait_running(api, ns, "low", 2, timeout=90)
    api.create_job(ns, kueue_job("high", template={"priorityClassName": high}))
    # Kueue evicts low's Workload and deletes its pods, marked TerminationTarget; the kubelet's
    # SIGTERM makes each trainer save a checkpoint and exit 75, played here.
    stopped = wait_for(lambda: (lambda ps: ps if len(ps) == 2 else None)(
        [p for p in api.pods(ns, "low") if p["metadata"].get("deletionTimestamp")]), timeout=60,
        what="low's pods stopped")
    for p in stopped:
        assert any(c["type"] == "TerminationTarget" for c in p["status"]["conditions"])
        terminate(api, ns, p["metadata"]["name"], 75)
    wait_running(api, ns, "high", 2, timeout=90)
    st = wait_for(lambda: (lambda s: s if (s.get("restarts") == 1 and s.get("phase") == "GangWaiting")
                           else None)(api.status(ns, "low")),
                  timeout=60, what="low's next incarnation waiting")
    assert condition(st, "GangWaiting")["reason"] == "WaitingForQueue"
    assert st.get("disruptions") == 1, "a preemption spends the disruption budget, not maxRestarts"
    said = wait_for(lambda: [e["message"] for e in api.events(ns, "low") if e["type"] == "Warning"
                             and "Preempted to accommodate a workload" in e["message"]],
                    what="the Warning that names the preemption")
    assert said
    # restart 1's pods wait at the gate (restart 0's, finished, may linger under Kueue's finalizer)
    assert admission_gated([p for p in api.pods(ns, "low")
                            if p["metadata"]["labels"][contract.LABEL_RESTART] == "1"])
    finish_all(api, ns, "high", 0)
    wait_phase(api, ns, "high", "Succeeded")
    pods = wait_running(api, ns, "low", 2, restart=1, timeout=90)
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "low" for p in pods)


def test_a_deleted_job_leaves_no_pod_held_by_kueue(api, queue, operator, namespace):
    """Kueue holds a deleted group pod's finalizer while it waits for a replacement: the operator
    tells it none will come (retriable-in-group: "false"), so every pod goes with the job."""
    ns = namespace
    api.create_job(ns, kueue_job("gone"))
    wait_running(api, ns, "gone", 2, timeout=90)
    api.delete(f"/apis/tetrad.dev/v1alpha1/namespaces/{ns}/paralleltrainingjobs/gone")
    wait_for(lambda: not api.pods(ns, "gone"), timeout=60, what="every pod of the deleted job gone")
    wait_for(lambda: not workloads(api, ns), timeout=60, what="its Workload gone")
