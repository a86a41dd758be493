"""status.goodput, driven through the controller on the fake cluster: the ledger settles each phase's
time at its change, splits an incarnation's time running by rank 0's account of it, counts the steps a
restart trains again, adds up to the wall time, and writes nothing between phase changes for a minute."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from tetrad_operator.lifecycle import goodput
from tetrad_operator.observed import format_time, parse_time

from tetrad.api import contract
from tetrad.api.spec import CheckpointStatus, GoodputSeconds, TrainerTimeStatus

from .fakes import T0, FakeCluster, job_body
from .test_lifecycle import FAST, cond, running

KINDS = tuple(GoodputSeconds.model_fields)


def since(c: FakeCluster, phase: str) -> float:
    """Seconds from the job's creation to the phase's last transition."""
    return (parse_time(cond(c, phase)["lastTransitionTime"]) - T0).total_seconds()


def shown(c: FakeCluster) -> dict[str, float]:
    g = c.status["goodput"]
    assert sum(g["seconds"].values()) == pytest.approx(g["wallSeconds"], abs=0.5), g
    assert g["fraction"] == pytest.approx(g["seconds"]["productive"] / g["wallSeconds"], abs=1e-3)
    return g["seconds"]


def scraped(c: FakeCluster, restart: int, step: int, **seconds: float) -> None:
    """What a scrape of rank 0 writes into status.trainerTime."""
    assert c.job is not None
    c.job["status"]["trainerTime"] = {"restart": restart, "step": step, "updated": format_time(c.now),
                                      **seconds}


def left(step: int, startup: float, train: float, stall: float) -> str:
    """Rank 0's termination message when it finished: its gauges, its time account among them."""
    registry = CollectorRegistry()
    for name, value in ((contract.METRIC_STEP, step), (contract.METRIC_STARTUP, startup),
                        (contract.METRIC_TRAIN_SECONDS, train), (contract.METRIC_CHECKPOINT_STALL, stall)):
        Gauge(name, "", registry=registry).set(value)
    return json.dumps({contract.TERMINATION_FIGURES: generate_latest(registry).decode()})


def test_a_restarted_job_accounts_for_every_second():
    c = FakeCluster(job_body(nodes=2, runPolicy=FAST, checkpoint={"enabled": True, "path": "/ckpt"}))
    running(c)
    queued = since(c, "Running")  # created, gated, released, scheduled, started
    assert queued > 0 and shown(c)["queued"] == queued and c.status["goodput"]["settled"]["queued"] == queued

    # Running: rank 0 says 12 s of start-up (2 of them the preflight), 30 s of steps, 3 s of saves
    c.tick(65)  # the figures shown are refreshed at most once a minute
    account = {"startupSeconds": 12.0, "preflightSeconds": 2.0, "trainSeconds": 30.0,
               "checkpointStallSeconds": 3.0}
    scraped(c, 0, 50, **account)
    c.job["status"]["checkpoint"] = {"step": 40, "resumedFrom": 0, "resumedAtRestart": 0}
    c.reconcile()
    ran = (c.now - T0).total_seconds() - queued
    assert shown(c) == {**dict.fromkeys(KINDS, 0.0), "queued": queued, "startup": 10.0, "preflight": 2.0,
                        "checkpoint": 3.0, "productive": ran - 15.0}
    assert c.status["goodput"]["asOf"] == format_time(c.now)  # the scrape's time

    # A worker fails 5 s later: 10 of the 50 steps came after the last checkpoint (step 40)
    c.tick(5)
    c.finish(1, rank=1)
    c.reconcile()
    assert c.phase == "Restarting"
    failed = since(c, "Restarting")
    ran = failed - queued
    settled = c.status["goodput"]["settled"]
    recomputed = 10 * 30.0 / 49  # the 49 steps after the first took 30 s
    assert settled == pytest.approx({
        **dict.fromkeys(KINDS, 0.0), "queued": queued, "startup": 10.0, "preflight": 2.0, "checkpoint": 3.0,
        "recomputed": recomputed, "productive": 30.0 - recomputed,
        "restarts": ran - 45.0}, abs=1e-3)  # from the last log to the failure
    assert c.status["goodput"]["runningSeconds"] == 0.0

    # The backoff, the new gang; rank 0's account of restart 0 says nothing of restart 1
    c.settle(15)
    running(c)
    assert c.status["restarts"] == 1 and c.status["goodput"]["restart"] == 1
    restarting = since(c, "Restarting") - failed  # a condition's time moves when it turns False, too
    started = since(c, "Running")
    queued_again = started - since(c, "Restarting")
    c.tick(61)
    c.reconcile()
    seconds = shown(c)
    assert seconds["restarts"] == pytest.approx(ran - 45.0 + restarting, abs=1e-3)
    assert seconds["queued"] == pytest.approx(queued + queued_again)
    assert seconds["startup"] == 10.0 + (c.now - T0).total_seconds() - started

    # It finishes; its termination message carries the last account (its final save included)
    c.tick(10)
    c.finish(0, rank=1)
    c.finish(0, rank=0, message=left(100, startup=8.0, train=25.0, stall=1.0))
    c.reconcile()
    assert c.phase == "Succeeded"
    last = since(c, "Succeeded") - started
    seconds = shown(c)
    assert seconds["startup"] == pytest.approx(18.0, abs=0.1) and seconds["checkpoint"] == 4.0
    assert seconds["productive"] == pytest.approx(30.0 - recomputed + 25.0 + (last - 34.0), abs=0.1)
    assert c.status["goodput"]["wallSeconds"] == since(c, "Succeeded")  # creation to completion
    final = dict(c.status["goodput"])
    c.tick(600)
    c.reconcile()
    assert c.status["goodput"] == final  # an ended job's figures stay


def test_between_phase_changes_the_figures_are_written_at_most_once_a_minute():
    c = FakeCluster(job_body(nodes=2))
    running(c)
    c.reconcile()
    version = c.job["metadata"]["resourceVersion"]
    for _ in range(5):
        c.tick(10)
        c.reconcile()
    assert c.job["metadata"]["resourceVersion"] == version  # 50 s: nothing new to write
    c.tick(10)
    c.reconcile()
    assert c.job["metadata"]["resourceVersion"] != version
    assert c.status["goodput"]["asOf"] == format_time(c.now)  # no figures from rank 0 yet: start-up
    assert shown(c)["startup"] == (c.now - T0).total_seconds() - since(c, "Running")


def test_an_incarnation_cut_before_its_first_step_was_all_start_up():
    seconds = goodput.split(40.0, None, goodput.Ending.CUT, None)
    assert seconds == GoodputSeconds(startup=40.0)
    answered = TrainerTimeStatus(restart=0, updated="2030-01-01T00:00:00Z")  # no step yet
    assert goodput.split(40.0, answered, goodput.Ending.CUT, None, script=True) == seconds
    # a script that never reports (no runtime library): its time running is all it can be said to train
    silent = goodput.split(40.0, None, goodput.Ending.DONE, None, script=True)
    assert silent == GoodputSeconds(productive=40.0)
    started = TrainerTimeStatus(startupSeconds=5)
    assert goodput.split(0.0, started, goodput.Ending.DONE, None) == GoodputSeconds()


def test_rank0s_account_longer_than_the_gang_ran_comes_off_its_start_up():
    """Rank 0 started before the last pod ran and waited for it: the gang ran 20 s, rank 0 says 25."""
    time = TrainerTimeStatus(restart=0, step=11, startupSeconds=15.0, preflightSeconds=1.0, trainSeconds=10.0)
    assert goodput.split(20.0, time, goodput.Ending.DONE, None) == GoodputSeconds(
        startup=9.0, preflight=1.0, productive=10.0)
    assert goodput.split(5.0, time, goodput.Ending.DONE, None) == GoodputSeconds(productive=5.0)


def test_a_restart_recomputes_from_the_checkpoint_it_resumes_from():
    """Restart 2 resumed from step 100, trained to 130 (10 s for steps 102..130), and had committed
    step 120: 10 steps are trained again. Without a checkpoint since its resume, all 30 are."""
    time = TrainerTimeStatus(restart=2, step=130, startupSeconds=5.0, trainSeconds=29.0)
    resumed = CheckpointStatus(step=120, resumed_from=100, resumed_at_restart=2)
    cut = goodput.split(40.0, time, goodput.Ending.CUT, resumed)
    assert cut.recomputed == pytest.approx(10.0) and cut.productive == pytest.approx(19.0)
    assert cut.restarts == pytest.approx(6.0)
    older = CheckpointStatus(step=100, resumed_from=100, resumed_at_restart=2)
    assert goodput.split(40.0, time, goodput.Ending.CUT, older).recomputed == pytest.approx(29.0)


def test_a_ledger_settles_to_the_second():
    """The ledger's times are stored to the second; its intervals count from them, so nothing drifts."""
    ledger = goodput.opened(T0, 0)
    t = T0
    for _ in range(10):
        t += timedelta(seconds=2.7)
        goodput.settle(ledger, None, t, None, None, None)
    assert ledger.settled.queued == (t.replace(microsecond=0) - T0).total_seconds() == 27.0
