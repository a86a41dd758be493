"""Restarts in place, as the operator sees them, driven through the controller on the fake cluster: the
rounds rank 0 reports (or the pods' termination messages) count in status.restartsInPlace and against
maxRestarts, each is told in an Event, the goodput ledger cuts the incarnation's time running at each,
and a new incarnation's pods get the budget that is left."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from tetrad_operator.observed import format_time, parse_time

from tetrad.api import contract
from tetrad.node.environment import RoundSettings

from .fakes import T0, FakeCluster, job_body
from .test_goodput import KINDS, since
from .test_lifecycle import FAST, cond, running

CAUSE = "node 1 exited 1 (a worker ended without a word: killed by a signal, or crashed)"


def scraped_round(c: FakeCluster, round: int, step: int, previous: dict[str, float] | None = None,
                  **account: float) -> None:
    """What a scrape of rank 0 in `round` of incarnation 0 writes into status.trainerTime."""
    assert c.job is not None
    c.job["status"]["trainerTime"] = {
        "restart": 0, "round": round, "step": step, "updated": format_time(c.now), **account,
        **({"roundCause": CAUSE} if round else {}), **({"previousRound": previous} if previous else {})}


def since_creation(time: str) -> float:
    return (parse_time(time) - T0).total_seconds()


def rounds_of(pod: dict) -> RoundSettings:
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    return RoundSettings.parse(env[contract.ENV_ROUNDS])


def in_place_events(c: FakeCluster) -> list[str]:
    return [e.message for e in c.events if e.reason == "RestartedInPlace"]


def test_a_round_rank_0_reports_is_a_restart_in_place_counted_told_and_cut_in_the_goodput():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST, checkpoint={"enabled": True, "path": "/ckpt"}))
    running(c)
    pods = sorted(c.pods)
    assert [rounds_of(p).left for p in c.pods.values()] == [2, 2], "a new job's pods have all of maxRestarts"
    c.tick(65)
    first = {"startupSeconds": 12.0, "trainSeconds": 30.0, "resumedFrom": 0}
    scraped_round(c, 0, 50, **first)
    c.job["status"]["checkpoint"] = {"step": 40}
    c.reconcile()
    assert "restartsInPlace" not in c.status and not in_place_events(c)

    # A worker died; the supervisors restarted the gang in its pods, and rank 0 of round 1 answers
    c.tick(20)
    scraped_round(c, 1, 41, {"step": 50, **first}, startupSeconds=3.0, resumedFrom=40)
    c.reconcile()
    s = c.status
    assert (s["restartsInPlace"], s["round"], s["restarts"], s["phase"]) == (1, 1, 0, "Running")
    assert sorted(c.pods) == pods and not any(p["metadata"].get("deletionTimestamp") for p in c.pods.values())
    assert in_place_events(c) == [f"the gang of restart 0 restarted in its own pods (round 1) after {CAUSE};"
                                  " 1 of spec.runPolicy.maxRestarts=2 left"]
    # The ledger cut round 0 as a restart would: 10 steps after the checkpoint at 40 are trained again
    ledger = s["goodput"]
    ran = since_creation(ledger["since"]) - since(c, "Running")
    recomputed = 10 * 30.0 / 49
    assert ledger["round"] == 1 and ledger["runningSeconds"] == 0.0
    assert ledger["settled"] == pytest.approx({
        **dict.fromkeys(KINDS, 0.0), "queued": since(c, "Running"), "startup": 12.0, "recomputed": recomputed,
        "productive": 30.0 - recomputed, "restarts": ran - 42.0}, abs=1e-3)

    c.tick(30)
    c.reconcile()
    assert c.status["restartsInPlace"] == 1 and len(in_place_events(c)) == 1, "told once"
    assert c.controller.metrics.registry.get_sample_value("tetrad_operator_gang_restarts_total",
                                                          {"reason": "RestartedInPlace"}) == 1


def test_restarts_in_place_spend_max_restarts_and_the_next_gang_gets_what_is_left():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.tick(10)
    scraped_round(c, 1, 5)
    c.reconcile()
    assert c.status["restartsInPlace"] == 1
    # The rounds' budget ran out on a later failure: node 1 exits with it, and the gang restarts in new pods
    c.tick(10)
    c.finish(1, rank=1, message=json.dumps({contract.TERMINATION_ROUND: 1}))
    c.reconcile()
    assert c.phase == "Restarting" and c.status["restarts"] == 1 and c.status["restartsInPlace"] == 1
    c.settle(15)
    running(c)
    fresh = [p for p in c.pods.values() if p["metadata"]["labels"][contract.LABEL_RESTART] == "1"]
    assert [rounds_of(p).left for p in fresh] == [0, 0], "2 - 1 restart in new pods - 1 in place"
    assert c.status["round"] == 0, "a new incarnation's pods begin at round 0"
    c.tick(10)
    c.finish(1, rank=0)
    c.reconcile()
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "MaxRestartsExceeded"
    said = "already restarted 2 times after failures, 1 of them in place (maxRestarts=2"
    assert said in c.status["message"]


def test_rounds_only_a_termination_message_tells_count_too():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST))
    running(c)
    c.tick(65)
    scraped_round(c, 0, 20, startupSeconds=5.0, trainSeconds=19.0, resumedFrom=0)
    c.reconcile()
    c.tick(10)
    # Two rounds no scrape saw; the second's failure was past the budget, so node 1 exited with it
    c.finish(1, rank=1, message=json.dumps({contract.TERMINATION_ROUND: 2}))
    c.reconcile()
    assert c.status["restartsInPlace"] == 2
    # the ledger cut round 0 by its last account: no checkpoint, so its 19 steps after the first are lost
    settled = c.status["goodput"]["settled"]
    assert (settled["startup"], settled["recomputed"], settled["productive"]) == (5.0, 19.0, 0.0)
    assert in_place_events(c) == ["the gang of restart 0 restarted in its own pods (2 more rounds, up to"
                                  " round 2); 0 of spec.runPolicy.maxRestarts=2 left"]
    assert c.phase == "Failed" and "2 of them in place" in c.status["message"]


def test_a_rounds_start_up_is_no_stall_the_stall_timer_starts_over_at_the_round():
    c = FakeCluster(job_body(nodes=2, runPolicy={**FAST, "stallTimeoutSeconds": 30}))
    running(c)
    c.tick(65)
    c.job["status"]["training"] = {"updated": format_time(c.now), "step": 50,
                                   "lastStepTime": format_time(c.now)}
    c.reconcile()
    # a worker died; rank 0 of round 1 answers, importing and loading: its last step is round 0's
    c.tick(20)
    scraped_round(c, 1, 0)
    c.job["status"]["training"]["updated"] = format_time(c.now)
    c.reconcile()
    assert c.status["round"] == 1
    learned = c.now
    for seconds in (60, 200, 299):  # 30 s after the last step, but within the start-up's floor of 300 s
        c.now = learned + timedelta(seconds=seconds)
        c.job["status"]["training"]["updated"] = format_time(c.now)
        c.reconcile()
        assert c.phase == "Running", (seconds, c.status["message"])
    c.now = learned + timedelta(seconds=301)
    c.job["status"]["training"]["updated"] = format_time(c.now)
    c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    assert "before the first step" in c.status["message"]
