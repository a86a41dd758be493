"""Goodput against a real API server: rank 0's time account, exported by the trainer's own RankMetrics,
reaches status.trainerTime whole; the operator's ledger in status.goodput (which the CRD's schema must
keep, or the API server would drop it) splits the run by it, and its kinds add up to the wall time from
the job's creation to its end."""

from __future__ import annotations

import time
from datetime import datetime

import pytest
from tetrad_trainer.metrics import RankMetrics, StepRecord

from .conftest import free_port, operator_in_thread
from .helpers import (
    finish_all,
    ptj,
    running_pods,
    wait_events,
    wait_for,
    wait_phase,
    wait_running,
)

pytestmark = pytest.mark.cluster


def logged(metrics: RankMetrics, step: int, *, startup_s: float, train_s: float, stall_s: float) -> None:
    metrics.log(StepRecord(step=step, loss=5.0, grad_norm=1.0, lr=1e-4, step_time_s=0.5,
                           tokens_per_second=100.0, tokens_per_second_per_device=50.0, tflops=0.1, mfu=0.1,
                           peak_memory_bytes=1, peak_memory_reserved_bytes=1, startup_s=startup_s,
                           train_s=train_s, checkpoint_stall_s=stall_s))


def seconds_between(earlier: str, later: str) -> float:
    times = [datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ") for t in (earlier, later)]
    return (times[1] - times[0]).total_seconds()


def test_rank0s_account_splits_the_wall_time_in_status_goodput(api, operator_cluster, namespace):
    ns, port = namespace, free_port()
    metrics = RankMetrics(port=port, rank=0, labels={}, jsonl=None)
    try:
        with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}):
            api.create_job(ns, ptj("gp", nodes=2, metrics={"port": port}))
            wait_running(api, ns, "gp", 2)
            running = api.status(ns, "gp")
            assert running["goodput"]["settled"]["queued"] == seconds_between(
                api.job(ns, "gp")["metadata"]["creationTimestamp"], running["goodput"]["since"])
            logged(metrics, 7, startup_s=0.5, train_s=1.0, stall_s=0.25)
            st = wait_for(lambda: (lambda s: s if (s.get("trainerTime") or {}).get("step") == 7 else None)(
                api.status(ns, "gp")), what="rank 0's account in status.trainerTime")
            account = st["trainerTime"]
            assert (account["restart"], account["startupSeconds"], account["trainSeconds"],
                    account["checkpointStallSeconds"]) == (0, 0.5, 1.0, 0.25)
            time.sleep(2)  # the gang runs 2 s longer than rank 0's account
            finish_all(api, ns, "gp", 0)
            done = wait_phase(api, ns, "gp", "Succeeded")
    finally:
        metrics.close()
    g = done["goodput"]
    seconds = g["seconds"]
    assert sum(seconds.values()) == pytest.approx(g["wallSeconds"], abs=0.5)
    created = api.job(ns, "gp")["metadata"]["creationTimestamp"]
    assert g["wallSeconds"] == seconds_between(created, done["completionTime"]) and g["asOf"] == done[
        "completionTime"]
    ran = seconds_between(running["goodput"]["since"], done["completionTime"])
    # rank 0 said 0.5 s of start-up and 0.25 s of saves; the rest of the time the gang ran trained
    assert ran >= 2 and (seconds["startup"], seconds["checkpoint"]) == (0.5, 0.25)
    assert seconds["productive"] == pytest.approx(ran - 0.75, abs=0.01)
    assert g["fraction"] == pytest.approx(seconds["productive"] / g["wallSeconds"], abs=1e-3)


def test_a_restart_in_place_reaches_status_from_rank_0s_next_process(api, operator_cluster, namespace):
    """The trainer's own gauges of round 1 (a new rank 0 process in the same pod): the operator counts the
    restart in place, names its cause in an Event and cuts the ledger by round 0's last account."""
    ns, port = namespace, free_port()
    cause = "node 1 exited 1 (a worker ended without a word: killed by a signal, or crashed)"
    metrics = RankMetrics(port=port, rank=0, labels={}, jsonl=None)
    try:
        with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}):
            api.create_job(ns, ptj("ip", nodes=2, metrics={"port": port}, runPolicy={"maxRestarts": 3}))
            pods = sorted(p["metadata"]["name"] for p in wait_running(api, ns, "ip", 2))
            metrics.resumed(0)
            logged(metrics, 9, startup_s=0.5, train_s=1.0, stall_s=0.0)
            wait_for(lambda: (api.status(ns, "ip").get("trainerTime") or {}).get("step") == 9,
                     what="round 0's account in status.trainerTime")
            time.sleep(2)  # the gang has run longer than the 1.5 s rank 0 accounts for
            metrics.close()
            metrics = RankMetrics(port=port, rank=0, labels={}, jsonl=None, round=1, round_cause=cause)
            metrics.resumed(0)
            st = wait_for(lambda: (lambda s: s if s.get("restartsInPlace") == 1 else None)(
                api.status(ns, "ip")), timeout=60, what="status.restartsInPlace")
            assert st["round"] == 1 and st["restarts"] == 0 and st["phase"] == "Running"
            account = st["trainerTime"]
            assert account["previousRound"]["step"] == 9 and account["roundCause"] == cause
            (event,) = wait_events(api, ns, "ip", "RestartedInPlace")
            assert event["type"] == "Warning" and event["message"] == (
                f"the gang of restart 0 restarted in its own pods (round 1) after {cause};"
                " 2 of spec.runPolicy.maxRestarts=3 left")
            assert sorted(p["metadata"]["name"] for p in running_pods(api, ns, "ip")) == pods
            ledger = st["goodput"]
            assert ledger["round"] == 1 and ledger["settled"]["startup"] == 0.5
            # round 0 resumed from 0 and saved nothing: its 8 steps after the first are trained again
            assert ledger["settled"]["recomputed"] == 1.0 and ledger["settled"]["productive"] == 0.0
            finish_all(api, ns, "ip", 0)
            done = wait_phase(api, ns, "ip", "Succeeded")
    finally:
        metrics.close()
    g = done["goodput"]
    assert sum(g["seconds"].values()) == pytest.approx(g["wallSeconds"], abs=0.5)
    assert done["restartsInPlace"] == 1
