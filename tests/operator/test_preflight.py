"""The preflight gate in the lifecycle (the controller on the fake cluster): a pod that exits 69 naming a node
restarts the gang as a disruption, the node is named in status.failedNodes and the next pods avoid
it, within spec.preflight.maxExcludedNodes; slow nodes the scraper found make the SlowNodes condition."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tetrad_operator import scrape

from tetrad.api.contract import EXIT_PREFLIGHT, LABEL_RANK, METRIC_PREFLIGHT_BUS_BANDWIDTH
from tetrad.api.termination import NodeFailure, TerminationMessage, rendezvous_failure

from .fakes import FakeCluster, job_body, node_body

FAST = {"backoffSeconds": 10, "backoffMaxSeconds": 40, "maxRestarts": 0}
NODES = [node_body(n) for n in ("n0", "n1", "n2")]  # 16 CPUs each: the gang's two 4-CPU pods fit on one


def cluster(**preflight: Any) -> FakeCluster:
    return FakeCluster(job_body(nodes=2, runPolicy=FAST, preflight=preflight), nodes=[dict(n) for n in NODES])


def running(c: FakeCluster) -> None:
    for _ in range(20):
        c.reconcile()
        c.tick()
        if c.phase == "Running":
            return
    raise AssertionError(f"not Running: {c.status}")


def fail_preflight(c: FakeCluster, rank: int, *failures: NodeFailure) -> None:
    """Pod `rank` exits 69 with the termination message its supervisor writes."""
    c.finish(EXIT_PREFLIGHT, rank=rank)
    pod = next(p for p in c.pods.values() if p["metadata"]["labels"][LABEL_RANK] == str(rank)
               and p["status"]["phase"] == "Failed")
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = TerminationMessage(
        preflight=failures).encode()


def excluded_in(pod: dict[str, Any]) -> list[str]:
    terms = pod["spec"].get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    return [v for t in terms for f in t.get("matchFields", []) if f["operator"] == "NotIn"
            for v in f["values"]]


def restart_and_run(c: FakeCluster) -> None:
    c.reconcile()
    assert c.phase == "Restarting"
    c.settle(steps=3)
    c.tick(60)  # past the backoff
    running(c)


def test_a_node_failing_the_gate_is_named_excluded_and_avoided_by_the_next_gang() -> None:
    c = cluster()
    running(c)
    bad = {p["spec"]["nodeName"] for p in c.pods.values()}
    assert bad == {"n0"}, "first fit puts the whole gang on n0"
    reason = "cpu: resources.cpu requests 4 CPUs, this node's processes may run on 1 (their CPU affinity)"
    fail_preflight(c, 1, NodeFailure("n0-as-the-pod-saw-it", 1, reason))
    c.reconcile()
    assert c.phase == "Restarting"
    restarting = next(x for x in c.status["conditions"] if x["type"] == "Restarting")
    assert restarting["reason"] == "PreflightFailed"
    assert restarting["message"].startswith(f"pod job-r0-1 failed the preflight gate: node n0: {reason}")
    assert c.status["failedNodes"] == [{"node": "n0", "reason": reason, "restart": 0, "excluded": True}], \
        "the node the API server bound the named rank's pod to"
    assert c.status["disruptions"] == 1, "a bad node is a disruption: maxRestarts=0 is not spent"
    assert any(e.reason == "NodeExcluded" and "n0" in e.message for e in c.events)
    restart_and_run(c)
    assert c.status["restarts"] == 1
    new = [p for p in c.pods.values() if p["metadata"]["labels"]["tetrad.dev/restart"] == "1"]
    assert len(new) == 2 and all(excluded_in(p) == ["n0"] for p in new)
    assert {p["spec"]["nodeName"] for p in new} == {"n1"}, "the built-in gang fit honours the exclusion"
    c.reconcile()
    assert len(c.status["failedNodes"]) == 1, "a later pass records the failure once"


def test_the_exclusion_budget_names_a_node_beyond_it_without_avoiding_it() -> None:
    c = cluster(maxExcludedNodes=1)
    running(c)
    fail_preflight(c, 0, NodeFailure("n0", 0, "devices: 7 CUDA devices visible"))
    restart_and_run(c)
    fail_preflight(c, 0, NodeFailure(
        "n1", 0, "cpu: resources.cpu requests 4 CPUs, this node's processes may run on 1"))
    c.reconcile()
    assert [(f["node"], f["restart"], f["excluded"]) for f in c.status["failedNodes"]] == [
        ("n0", 0, True), ("n1", 1, False)]
    assert any(e.reason == "NodeNotExcluded" and "maxExcludedNodes=1" in e.message for e in c.events)
    restart_and_run(c)
    assert all(excluded_in(p) == ["n0"] for p in c.pods.values() if p["status"]["phase"] == "Running")


def test_a_user_who_disallows_exclusion_gets_the_node_named_and_a_plain_restart() -> None:
    c = cluster(excludeFailedNodes=False)
    running(c)
    fail_preflight(c, 1, NodeFailure("n0", 1, "devices: 3 CUDA devices visible"))
    c.reconcile()
    assert c.status["failedNodes"] == [{"node": "n0", "reason": "devices: 3 CUDA devices visible",
                                        "restart": 0, "excluded": False}]
    assert any(e.reason == "NodeNotExcluded" and "excludeFailedNodes is false" in e.message for e in c.events)
    restart_and_run(c)
    assert all(excluded_in(p) == [] for p in c.pods.values())


def test_a_worker_whose_pod_0_name_never_resolved_restarts_the_gang_as_a_disruption_without_excluding_it(
) -> None:
    """tetrad.node.rendezvous: the worker waited rendezvous.timeoutSeconds and exited 69 naming itself.
    Pod 0 not running or the cluster's DNS is to blame, not the job (maxRestarts=0 is not spent) nor the
    node (not avoided)."""
    c = cluster()
    running(c)
    reason = rendezvous_failure("job-r0-0.job.ns.svc", 900, "Name or service not known")
    fail_preflight(c, 1, NodeFailure("n0", 1, reason))
    c.reconcile()
    assert c.phase == "Restarting" and c.status["disruptions"] == 1
    assert next(x for x in c.status["conditions"] if x["type"] == "Restarting")["reason"] == "PreflightFailed"
    assert c.status["failedNodes"] == [{"node": "n0", "reason": reason, "restart": 0, "excluded": False}]
    assert any(e.reason == "NodeNotExcluded" and "says nothing against the node" in e.message
               for e in c.events)
    restart_and_run(c)
    assert c.status["restarts"] == 1 and all(excluded_in(p) == [] for p in c.pods.values())


def test_a_gang_wide_failure_restarts_without_blaming_a_node() -> None:
    c = cluster()
    running(c)
    fail_preflight(c, 0, NodeFailure(None, None, "the all-reduce did not complete within 120 s"))
    c.reconcile()
    assert c.phase == "Restarting" and not c.status.get("failedNodes")
    assert "the all-reduce did not complete within 120 s" in c.status["message"]
    restart_and_run(c)
    assert c.status["restarts"] == 1 and all(excluded_in(p) == [] for p in c.pods.values())


def measured(c: FakeCluster, restart: int, n1: float) -> None:
    """What the scraper writes from rank 0's preflight gauges (n0 measured 10 GB/s)."""
    assert c.job is not None
    c.job["status"]["preflight"] = {"restart": restart, "busBandwidthGBps": (10.0 + n1) / 2, "nodes": [
        {"node": "n0", "nodeRank": 0, "busBandwidthGBps": 10.0},
        {"node": "n1", "nodeRank": 1, "busBandwidthGBps": n1}]}


def test_a_slow_node_is_a_condition_and_one_warning_event() -> None:
    c = cluster(slowNodeFraction=0.5)
    running(c)
    measured(c, restart=7, n1=2.0)  # another incarnation's figures: not judged
    c.reconcile()
    assert not any(x["type"] == "SlowNodes" for x in c.status["conditions"])
    measured(c, restart=0, n1=2.0)  # below half the median of 6
    c.reconcile()
    slow = next(x for x in c.status["conditions"] if x["type"] == "SlowNodes")
    assert slow["status"] == "True" and slow["message"] == (
        "node n1 measured a preflight all-reduce bus bandwidth below spec.preflight.slowNodeFraction=0.5 "
        "of the gang's median (6 GB/s): n1 2 GB/s")
    assert c.status["phase"] == "Running", "a slow node is reported, not acted on"
    c.reconcile()
    assert [e.reason for e in c.events].count("SlowNodes") == 1, "one event, not one per pass"
    measured(c, restart=0, n1=4.0)  # above half the median of 7
    c.reconcile()
    assert next(x for x in c.status["conditions"] if x["type"] == "SlowNodes")["status"] == "False"


def samples(exposition: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(exposition) for s in family.samples]


def test_status_preflight_is_read_from_rank_0s_gauges() -> None:
    exposition = "\n".join([
        f"# TYPE {METRIC_PREFLIGHT_BUS_BANDWIDTH} gauge",
        f'{METRIC_PREFLIGHT_BUS_BANDWIDTH}{{node="n1",node_rank="1"}} 2.5e9',
        f'{METRIC_PREFLIGHT_BUS_BANDWIDTH}{{node="n0",node_rank="0"}} 1.0e10',
        f'{METRIC_PREFLIGHT_BUS_BANDWIDTH}{{node="n2",node_rank="2"}} NaN',
        "# TYPE tetrad_step gauge", "tetrad_step 3", ""])
    assert scrape.preflight(samples(exposition)) == {"busBandwidthGBps": 6.25, "nodes": [
        {"node": "n0", "nodeRank": 0, "busBandwidthGBps": 10.0},
        {"node": "n1", "nodeRank": 1, "busBandwidthGBps": 2.5}]}
    assert scrape.preflight(samples("tetrad_step 3\n")) == {}, "no gate reported yet: nothing"
