"""The preflight gate against a real API server: a pod that terminates with exit code 69 and a
termination message naming its node gets the node named in status.failedNodes, and the next gang's
pods carry a required node anti-affinity that the built-in gang and the kube-scheduler honour."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tetrad.api import contract
from tetrad.api.termination import NodeFailure, TerminationMessage

from .conftest import free_port, operator_in_thread
from .helpers import (
    Api,
    condition,
    events_when_succeeded,
    fake_node,
    finish_all,
    now,
    ptj,
    wait_events,
    wait_for,
    wait_phase,
    wait_running,
)

pytestmark = pytest.mark.cluster


def fail_preflight(api: Api, ns: str, pod: str, message: str) -> None:
    """What the kubelet reports when the node's supervisor exits 69 after writing /dev/termination-log."""
    t = now()
    state = {"terminated": {"exitCode": contract.EXIT_PREFLIGHT, "reason": "Error", "message": message,
                            "startedAt": t, "finishedAt": t}}
    api.patch(f"/api/v1/namespaces/{ns}/pods/{pod}/status", {"status": {
        "phase": "Failed",
        "containerStatuses": [{"name": "trainer", "image": "tetrad/trainer:0.1.0", "imageID": "",
                               "ready": False, "restartCount": 0, "state": state}]}})


def excluded_in(pod: dict[str, Any]) -> list[str]:
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    return [v for t in terms for f in t.get("matchFields", []) if f["operator"] == "NotIn"
            for v in f["values"]]


def test_a_node_that_fails_the_gate_is_named_and_the_next_gang_avoids_it(api, operator, namespace):
    ns = namespace
    label = {"tetrad.dev/test-pool": ns}
    nodes = [f"{ns}-a", f"{ns}-b"]
    for name in nodes:  # one 4-CPU pod per node
        api.create("/api/v1/nodes", fake_node(name, cpu="4", labels=label))
    try:
        api.create_job(ns, ptj("gate", nodes=2, cpu="4", template={"nodeSelector": label},
                               runPolicy={"backoffSeconds": 1, "maxRestarts": 0}))
        pods = wait_running(api, ns, "gate", 2)
        bad = next(p["spec"]["nodeName"] for p in pods if p["metadata"]["labels"][contract.LABEL_RANK] == "1")
        reason = "devices: 7 CUDA devices visible, the job runs nprocPerNode=8 processes, one per GPU"
        fail_preflight(api, ns, "gate-r0-1",
                       TerminationMessage(preflight=(NodeFailure(bad, 1, reason),)).encode())

        st = wait_for(lambda: (lambda s: s if s.get("failedNodes") else None)(api.status(ns, "gate")),
                      what="the failed node in status")
        assert st["failedNodes"] == [{"node": bad, "reason": reason, "restart": 0, "excluded": True}]
        assert st["disruptions"] == 1, "a bad node is a disruption: maxRestarts=0 is not spent"
        wait_events(api, ns, "gate", "NodeExcluded")
        events = {e["reason"]: e for e in api.events(ns, "gate")}
        assert (f"pod gate-r0-1 failed the preflight gate: node {bad}: {reason}"
                in events["PreflightFailed"]["message"])
        assert events["NodeExcluded"]["type"] == "Warning" and bad in events["NodeExcluded"]["message"]

        # The next gang avoids the bad node: with one good node it cannot fit, a third one lets it run.
        wait_phase(api, ns, "gate", "GangWaiting")
        new = wait_for(lambda: (lambda ps: ps if len(ps) == 2 else None)(
            [p for p in api.pods(ns, "gate") if p["metadata"]["labels"][contract.LABEL_RESTART] == "1"]),
            what="the pods of restart 1")
        assert all(excluded_in(p) == [bad] for p in new)
        api.create("/api/v1/nodes", fake_node(f"{ns}-c", cpu="4", labels=label))
        nodes.append(f"{ns}-c")
        # room for a loaded machine: the admission's next round sees the new node (30 s ran out in CI once)
        running = wait_running(api, ns, "gate", 2, restart=1, timeout=90)
        assert bad not in {p["spec"]["nodeName"] for p in running}
        finish_all(api, ns, "gate", 0)
        st = wait_phase(api, ns, "gate", "Succeeded")
        assert condition(st, "Succeeded")["status"] == "True" and st["failedNodes"][0]["node"] == bad
    finally:
        for name in nodes:
            api.delete(f"/api/v1/nodes/{name}")


def test_the_measured_bandwidth_reaches_status_and_a_slow_node_is_reported(api, operator_cluster, namespace):
    """rank 0's preflight gauges (a Prometheus endpoint standing in for it) -> status.preflight, and a node
    below spec.preflight.slowNodeFraction of the median -> condition SlowNodes and one Warning Event."""
    ns, registry = namespace, CollectorRegistry()
    bandwidth = Gauge(contract.METRIC_PREFLIGHT_BUS_BANDWIDTH, "", ["node", "node_rank"], registry=registry)
    for rank, (node, value) in enumerate([("fast-0", 40e9), ("fast-1", 38e9), ("slow-2", 9e9)]):
        bandwidth.labels(node=node, node_rank=str(rank)).set(value)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}):
            api.create_job(ns, ptj("bw", nodes=3, metrics={"port": port},
                                   preflight={"slowNodeFraction": 0.5}))
            wait_running(api, ns, "bw", 3)
            st = wait_for(lambda: (lambda s: s if any(c["type"] == "SlowNodes"
                                                      for c in s.get("conditions", []))
                                   else None)(api.status(ns, "bw")), what="the SlowNodes condition")
            assert st["preflight"]["restart"] == 0 and st["preflight"]["busBandwidthGBps"] == 38.0
            assert [(n["node"], n["nodeRank"], n["busBandwidthGBps"]) for n in st["preflight"]["nodes"]] == [
                ("fast-0", 0, 40.0), ("fast-1", 1, 38.0), ("slow-2", 2, 9.0)]
            slow = condition(st, "SlowNodes")
            assert slow["status"] == "True" and slow["message"].startswith("node slow-2 measured")
            assert st["phase"] == "Running", "reported, not acted on"
            wait_for(lambda: [e for e in api.events(ns, "bw") if e["reason"] == "SlowNodes"],
                     what="the event")
            events = events_when_succeeded(api, ns, "bw", "SlowNodes")
            assert len(events) == 1 and events[0]["type"] == "Warning" and "9 GB/s" in events[0]["message"]
    finally:
        server.shutdown()
        server.server_close()
