"""Restarts in place, as the operator sees them, driven through the controller on the fake cluster: the
rounds rank 0 reports (or the pods' termination messages) count in status.restartsInPlace and against
maxRestarts, each is told in an Event, the goodput ledger cuts the incarnation's time running at each,
and a new incarnation's pods get the budget that is left."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from tetrad_operator.observed import format_time, parse_time

from tetrad.api import contract, parse
from tetrad.api.termination import TerminationMessage
from tetrad.node import rounds, supervisor
from tetrad.node.environment import RoundSettings
from tetrad.render.objects import rounds_gang

from .fakes import T0, FakeCluster, job_body
from .test_goodput import KINDS, since
from .test_lifecycle import FAST, cond, running

CAUSE = "node 1 exited 1 (a worker ended without a word: killed by a signal, or crashed)"


def scraped_round(c: FakeCluster, round: int, step: int, previous: dict[str, float] | None = None,
                  cause: str = CAUSE, **account: float) -> None:
    """What a scrape of rank 0 in `round` of incarnation 0 writes into status.trainerTime."""
    assert c.job is not None
    c.job["status"]["trainerTime"] = {
        "restart": 0, "round": round, "step": step, "updated": format_time(c.now), **account,
        **({"roundCause": cause} if round else {}), **({"previousRound": previous} if previous else {})}


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
    c.reconcile()  # asks pod 0's coordinator (there is none here), then recreates the gang
    c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    assert "before the first step" in c.status["message"]


# ---------------------------------------------------------------------- a stall, restarted in place

STALLING = {**FAST, "maxRestarts": 0, "maxDisruptions": 2, "stallTimeoutSeconds": 30}


def free_rendezvous_port() -> int:
    """A rendezvous port whose next port (the coordinator's) is free on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1]) - contract.ROUNDS_PORT_OFFSET


@contextmanager
def coordinator(c: FakeCluster, nodes: int = 2) -> Iterator[rounds.Coordinator]:
    """Pod 0's coordinator of incarnation 0, as its supervisor runs it, every node joined; the fake
    cluster's operator reaches pods on loopback."""
    job, _ = parse(c.job)
    assert job is not None
    port = job.spec.rendezvous.port + contract.ROUNDS_PORT_OFFSET
    served = rounds.Coordinator(rounds.Rounds(nodes, 0), rounds_gang(job, 0), "127.0.0.1", port)
    for node in range(nodes):
        served.rounds.join(node)
    try:
        yield served
    finally:
        served.close()


def stalled_job() -> FakeCluster:
    c = FakeCluster(job_body(nodes=2, runPolicy=STALLING, rendezvous={"port": free_rendezvous_port()}))
    running(c)
    c.tick(65)
    c.job["status"]["training"] = {"updated": format_time(c.now), "step": 50,
                                   "lastStepTime": format_time(c.now)}
    c.reconcile()
    return c


def stall(c: FakeCluster, seconds: float = 31) -> None:
    c.now += timedelta(seconds=seconds)
    c.job["status"]["training"]["updated"] = format_time(c.now)
    c.reconcile()


def test_a_stalled_gang_is_restarted_in_its_own_pods_as_a_disruption():
    c = stalled_job()
    with coordinator(c) as served:
        stall(c)
        asked = c.status["inPlaceAsk"]
        assert (asked["restart"], asked["round"], asked["accepted"]) == (0, 0, True)
        assert asked["cause"].startswith("rank 0 (job-r0-0) completed no step since")
        assert served.rounds.cause is not None and served.rounds.cause.node == rounds.OPERATOR
        (event,) = [e for e in c.events if e.reason == "Stalled"]
        assert "asked pod 0's coordinator to restart the gang in its own pods (round 1)" in event.message
        # while the round comes, the gang is neither recreated nor asked again
        c.tick(60)
        c.job["status"]["training"]["updated"] = format_time(c.now)
        c.reconcile()
        assert (c.phase, c.status["restarts"]) == ("Running", 0)
        assert [e.reason for e in c.events].count("Stalled") == 1
    # rank 0 of round 1 answers: a restart in place that spent no maxRestarts (0 here), only a disruption
    scraped_round(c, 1, 41, cause=asked["cause"])
    c.reconcile()
    assert (c.status["restartsInPlace"], c.status["disruptionsInPlace"], c.status["restarts"]) == (1, 1, 0)
    assert in_place_events(c) == [
        f"the gang of restart 0 restarted in its own pods (round 1) after {asked['cause']}; round 1 the"
        " operator asked for after a stall, a disruption; 0 of spec.runPolicy.maxRestarts=0 left"]
    # the next stall spends the second and last disruption; a third fails the job
    c.job["status"]["training"] = {"updated": format_time(c.now), "step": 45,
                                   "lastStepTime": format_time(c.now)}
    c.reconcile()
    stall(c)
    c.reconcile()
    assert c.phase == "Restarting" and c.status["disruptions"] == 1, c.status["message"]
    assert "pod 0's coordinator did not restart it in place" in c.status["message"]


def test_an_accepted_ask_whose_round_does_not_come_recreates_the_gang():
    c = stalled_job()
    with coordinator(c):
        stall(c)
        assert c.status["inPlaceAsk"]["accepted"] is True
    c.tick(c.settings.in_place_ask_seconds)
    c.job["status"]["training"]["updated"] = format_time(c.now)
    c.reconcile()
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    waited = c.settings.in_place_ask_seconds
    assert f"no round 1 in place came within {waited:g}s of asking" in c.status["message"]
    assert (c.status["disruptions"], c.status.get("restartsInPlace", 0)) == (1, 0)


def node_0_ends_as_the_asked_round_did_not_come(c: FakeCluster) -> None:
    """Pod 0 exits as its supervisor does when the coordinator ends the rounds of the operator's ask."""
    asked = c.status["inPlaceAsk"]
    word = rounds.Word(rounds.END, 0, rounds.OPERATOR, None, asked["cause"], save="token" in asked)
    code, said = supervisor.last_word(supervisor.RoundEnd(None, TerminationMessage()), word, None)
    c.finish(code, rank=0, message=json.dumps(said.to_json()))
    c.reconcile()


def test_nodes_that_ended_because_the_asked_round_did_not_come_are_the_stalls_disruption():
    c = stalled_job()
    with coordinator(c):
        stall(c)
    node_0_ends_as_the_asked_round_did_not_come(c)
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled", c.status["message"]
    assert c.status["message"].startswith("pod job-r0-0 ended: rank 0 (job-r0-0) completed no step since")
    assert (c.status["restarts"], c.status["disruptions"]) == (1, 1), "maxRestarts is 0: no budget spent"


def test_no_ask_once_the_disruption_budget_is_spent():
    c = stalled_job()
    c.job["status"]["disruptionsInPlace"] = 2  # maxDisruptions, spent by earlier stalls
    stall(c)
    assert "inPlaceAsk" not in c.status
    assert c.phase == "Failed" and cond(c, "Failed")["reason"] == "DisruptionBudgetExceeded"


# ----------------------------------------------------- a restart a user asked for, saving first

ASKING = {**FAST, "maxRestarts": 1, "stallTimeoutSeconds": 30}


def asking_job(**spec: object) -> FakeCluster:
    c = FakeCluster(job_body(nodes=2, runPolicy=ASKING, rendezvous={"port": free_rendezvous_port()},
                             **{"checkpoint": {"enabled": True, "path": "/ckpt"}, **spec}))
    running(c)
    c.tick(30)
    return c


def ask_restart(c: FakeCluster, token: str) -> None:
    assert c.job is not None
    c.job["metadata"].setdefault("annotations", {})[contract.ANNOTATION_RESTART_IN_PLACE] = token
    c.reconcile()


ASKED = "a restart asked (tetrad.dev/restart-in-place='t1')"


def test_a_restart_asked_with_a_token_restarts_the_gang_in_place_saving_first_and_spends_nothing():
    c = asking_job()
    pods = sorted(c.pods)
    with coordinator(c) as served:
        ask_restart(c, "t1")
        asked = c.status["inPlaceAsk"]
        assert (asked["restart"], asked["round"], asked["token"], asked["cause"], asked["accepted"]) == (
            0, 0, "t1", ASKED, True)
        assert c.status["restartRequested"] == "t1"
        assert served.rounds.cause is not None and served.rounds.save  # the workers save first
        (event,) = [e for e in c.events if e.reason == "RestartAsked"]
        assert event.message == (
            "tetrad.dev/restart-in-place='t1': asked pod 0's coordinator to restart the gang in its own pods"
            " (round 1); every worker saves a checkpoint first, and the round spends no budget")
        c.tick(5)
        c.reconcile()  # the same token is asked once
        assert [e.reason for e in c.events].count("RestartAsked") == 1
        # both nodes stopped (their workers saved): round 1 begins, and its rank 0 answers
        assert served.rounds.report(rounds.Report(0, 0, None)) == []
        assert served.rounds.report(rounds.Report(1, 0, None))[0].kind == rounds.GO
        scraped_round(c, 1, 41, cause=ASKED)
        c.reconcile()
        s = c.status
        assert (s["restartsInPlace"], s["askedInPlace"], s.get("disruptionsInPlace", 0), s["restarts"]) == (
            1, 1, 0, 0)
        assert sorted(c.pods) == pods and c.phase == "Running"
        assert in_place_events(c) == [
            f"the gang of restart 0 restarted in its own pods (round 1) after {ASKED}; round 1 the operator"
            " asked for as tetrad.dev/restart-in-place asked, after every worker saved; 1 of"
            " spec.runPolicy.maxRestarts=1 left"]
        # a new token asks for the next round
        ask_restart(c, "t2")
        assert (c.status["inPlaceAsk"]["round"], c.status["inPlaceAsk"]["accepted"]) == (1, True)
        assert served.rounds.cause is not None and served.rounds.cause.why == ASKED.replace("t1", "t2")


def test_a_restart_the_coordinator_refuses_is_told_and_the_gang_runs_on():
    c = asking_job()
    ask_restart(c, "t1")  # nobody listens on pod 0's rounds port
    assert c.status["inPlaceAsk"]["accepted"] is False
    (refused,) = [e.message for e in c.events if e.reason == "RestartNotInPlace"]
    assert refused.startswith(f"{ASKED}: pod 0's coordinator did not take it")
    assert refused.endswith("set a new token to ask again")
    c.tick(5)
    c.reconcile()
    assert (c.phase, c.status["restarts"]) == ("Running", 0)  # a refused restart recreates nothing
    assert [e.reason for e in c.events].count("RestartAsked") == 1
    # a stall in the same round makes its own ask (refused too), and only then is the gang recreated
    now = format_time(c.now)
    c.job["status"]["training"] = {"updated": now, "step": 50, "lastStepTime": now}
    c.reconcile()
    stall(c)
    c.reconcile()
    stalled = c.status["inPlaceAsk"]
    assert "token" not in stalled and stalled["accepted"] is False and stalled["cause"].startswith("rank 0")
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Stalled"
    assert "pod 0's coordinator did not restart it in place" in c.status["message"]


def test_a_restart_without_checkpoints_is_ignored_with_the_reason():
    c = asking_job(checkpoint={"enabled": False})
    ask_restart(c, "t1")
    assert "inPlaceAsk" not in c.status and c.status["restartRequested"] == "t1"
    (ignored,) = [e.message for e in c.events if e.reason == "RestartNotInPlace"]
    assert ignored == ("tetrad.dev/restart-in-place='t1' ignored: checkpointing is off (spec.checkpoint."
                       "enabled=false), so the restarted gang would begin again from step 0")


def test_nodes_that_ended_because_the_asked_restart_did_not_come_are_a_disruption():
    c = asking_job()
    with coordinator(c):
        ask_restart(c, "t1")
    node_0_ends_as_the_asked_round_did_not_come(c)
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "RestartAsked", c.status["message"]
    assert (c.status["restarts"], c.status["disruptions"]) == (1, 1)
