"""Slow ranks in the lifecycle (the controller on the fake cluster): the nodes condition SlowRank names
are kept with the time since when; one named for spec.metrics.excludeSlowNodesAfterSeconds is excluded
at the gang's next restart like a node that failed the preflight gate, within its budget; a slow node
alone restarts nothing."""

from __future__ import annotations

from typing import Any

from .fakes import FakeCluster, job_body
from .test_preflight import NODES, excluded_in, restart_and_run, running

RANK_1_ON = {"rank": 1, "lag": 0.5, "ownSeconds": 1.5}


def cluster(window: int | None = 60, **preflight: Any) -> FakeCluster:
    metrics = {"excludeSlowNodesAfterSeconds": window} if window else {}
    return FakeCluster(job_body(nodes=2, runPolicy={"backoffSeconds": 10, "maxRestarts": 3},
                                metrics=metrics, preflight=preflight), nodes=[dict(n) for n in NODES])


def gathered(c: FakeCluster, restart: int, **lag_by_node: float) -> None:
    """What the scraper writes into status.stragglers: rank 1 on each node, with its lag."""
    assert c.job is not None
    c.job["status"]["stragglers"] = {"restart": restart, "step": 9, "medianOwnSeconds": 1.0, "ranks": [
        {**RANK_1_ON, "node": node, "lag": lag} for node, lag in lag_by_node.items()]}


def fail(c: FakeCluster) -> None:
    c.finish(1, rank=0)


def test_a_node_slow_for_the_window_is_excluded_at_the_next_restart() -> None:
    c = cluster()
    running(c)
    gathered(c, 0, n0=0.5)
    c.reconcile()
    since = c.status["slowRankNodes"]
    assert [n["node"] for n in since] == ["n0"] and c.phase == "Running", "named, nothing restarted"
    c.tick(30)
    c.reconcile()
    assert c.status["slowRankNodes"] == since, "still named: the time it was first named stays"
    c.tick(31)
    c.reconcile()
    assert c.phase == "Running" and not c.status.get("failedNodes"), "a slow node alone restarts nothing"
    fail(c)
    restart_and_run(c)
    (failed,) = c.status["failedNodes"]
    assert (failed["node"], failed["restart"], failed["excluded"]) == ("n0", 0, True)
    assert failed["reason"].startswith("a rank on it stayed slow for 6")
    assert "spec.metrics.excludeSlowNodesAfterSeconds=60" in failed["reason"]
    assert any(e.reason == "NodeExcluded" and e.message.startswith("node n0 stayed slow") for e in c.events)
    new = [p for p in c.pods.values() if p["metadata"]["labels"]["tetrad.dev/restart"] == "1"]
    assert len(new) == 2 and all(excluded_in(p) == ["n0"] for p in new)
    assert c.status["slowRankNodes"] == [], "an excluded node is no longer tracked"


def test_a_node_slow_for_less_than_the_window_or_named_with_a_break_is_not_excluded() -> None:
    c = cluster()
    running(c)
    gathered(c, 0, n0=0.5)
    c.reconcile()
    c.tick(40)
    gathered(c, 0, n0=0.1)  # level again: no longer named
    c.reconcile()
    assert c.status["slowRankNodes"] == []
    gathered(c, 0, n0=0.5)
    c.reconcile()
    c.tick(40)  # 80 s since first named, 40 s without a break
    c.reconcile()
    fail(c)
    restart_and_run(c)
    assert not c.status.get("failedNodes")
    assert all(excluded_in(p) == [] for p in c.pods.values())


def test_without_the_field_or_the_budget_a_slow_node_is_named_not_avoided() -> None:
    off = cluster(window=None)
    running(off)
    gathered(off, 0, n0=0.5)
    off.reconcile()
    off.tick(600)
    off.reconcile()
    fail(off)
    restart_and_run(off)
    assert not off.status.get("failedNodes") and all(excluded_in(p) == [] for p in off.pods.values())

    spent = cluster(maxExcludedNodes=0)
    running(spent)
    gathered(spent, 0, n0=0.5)
    spent.reconcile()
    spent.tick(61)
    spent.reconcile()
    fail(spent)
    restart_and_run(spent)
    assert [(f["node"], f["excluded"]) for f in spent.status["failedNodes"]] == [("n0", False)]
    assert any(e.reason == "NodeNotExcluded" and "maxExcludedNodes=0" in e.message for e in spent.events)
