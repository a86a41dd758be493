"""Stragglers against a real API server: rank 0's straggler gauges, exported by the trainer's own
RankMetrics, reach status.stragglers; a rank whose lag reaches spec.metrics.slowRankLag makes condition
SlowRank and one Warning Event, and the condition turns False once the ranks are level again."""

from __future__ import annotations

import pytest
from tetrad_trainer.metrics import RankMetrics, StepRecord

from tetrad.api.stragglers import RankTime, slowest

from .conftest import free_port, operator_in_thread
from .helpers import condition, condition_true, events_when_succeeded, ptj, wait_for, wait_running

pytestmark = pytest.mark.cluster


def logged(metrics: RankMetrics, step: int, times: list[RankTime], step_s: float) -> None:
    """What rank 0's log step exports: the step's figures and the slowest ranks."""
    median, ranked = slowest(times, step_s)
    metrics.stragglers(median, ranked)
    metrics.log(StepRecord(step=step, loss=5.0, grad_norm=1.0, lr=1e-4, step_time_s=step_s,
                           tokens_per_second=100.0, tokens_per_second_per_device=50.0, tflops=0.1, mfu=0.1,
                           peak_memory_bytes=1, peak_memory_reserved_bytes=1, slowest_rank=ranked[0].rank,
                           slowest_rank_lag=ranked[0].lag))


def test_a_slow_rank_is_named_in_status_with_a_condition_and_an_event(api, operator_cluster, namespace):
    ns, port = namespace, free_port()
    metrics = RankMetrics(port=port, rank=0, labels={}, jsonl=None)
    try:
        with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}):
            api.create_job(ns, ptj("lag", nodes=2, metrics={"port": port, "slowRankLag": 0.25}))
            wait_running(api, ns, "lag", 2)
            logged(metrics, 7, [RankTime(0, "node-a", 1.0), RankTime(1, "node-b", 1.6)], step_s=1.6)
            st = wait_for(lambda: (lambda s: s if condition_true(s, "SlowRank") else None)(
                api.status(ns, "lag")), what="the SlowRank condition")
            assert st["stragglers"]["restart"] == 0 and st["stragglers"]["step"] == 7
            assert st["stragglers"]["medianOwnSeconds"] == pytest.approx(1.3)
            first = st["stragglers"]["ranks"][0]
            assert (first["rank"], first["node"], first["ownSeconds"]) == (1, "node-b", 1.6)
            assert first["lag"] == pytest.approx(0.375)
            slow = condition(st, "SlowRank")
            assert slow["status"] == "True" and slow["message"].startswith("rank 1 on node-b: the gang waits")
            assert st["phase"] == "Running", "reported, not acted on"
            wait_for(lambda: [e for e in api.events(ns, "lag") if e["reason"] == "SlowRank"],
                     what="the event")

            logged(metrics, 9, [RankTime(0, "node-a", 1.0), RankTime(1, "node-b", 1.05)], step_s=1.05)
            st = wait_for(lambda: (lambda s: s if s["stragglers"]["step"] == 9 and not condition_true(
                s, "SlowRank") else None)(api.status(ns, "lag")), what="the SlowRank condition turned False")
            assert condition(st, "SlowRank")["reason"] == "NoSlowRank" and st["stragglers"]["step"] == 9
            events = events_when_succeeded(api, ns, "lag", "SlowRank")
            assert len(events) == 1 and events[0]["type"] == "Warning" and "38%" in events[0]["message"]
    finally:
        metrics.close()
