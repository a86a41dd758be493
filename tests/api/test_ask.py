"""`tetrad checkpoint` and `tetrad restart`: the operator's answer read from a job's status (pure), and the
ask against a stand-in for the API server (the real one: tests/operator/test_cluster_suspend.py and
test_cluster_disruptions.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from copy import deepcopy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.api.test_status import kubeconfig, one_error_line
from tetrad.api.contract import ANNOTATION_CHECKPOINT_NOW, ANNOTATION_RESTART_IN_PLACE
from tetrad.cli import ask as asking
from tetrad.cli.ask import Answer, checkpoint_answer, new_token, restart_answer

ROOT = Path(__file__).resolve().parents[2]


def job(status: dict[str, Any] | None = None, checkpoint: bool = True,
        script: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodes": 2, "checkpoint": {"enabled": checkpoint}}
    if script:
        spec["script"] = {"path": "/work/train.py"}
    return {"metadata": {"name": "j", "annotations": {}}, "spec": spec,
            "status": {"phase": "Running", **(status or {})}}


def test_a_restart_is_answered_once_the_coordinator_took_or_refused_it():
    assert restart_answer(job(), "t") is None  # the operator has not seen the token yet
    asked = job({"restartRequested": "t", "inPlaceAsk": {"token": "t", "round": 2}})
    assert restart_answer(asked, "t") is None  # no answer from the coordinator yet
    took = restart_answer(job({"restartRequested": "t",
                               "inPlaceAsk": {"token": "t", "round": 2, "accepted": True}}), "t")
    assert took == Answer(True, "accepted: the gang restarts in its own pods (round 3); every worker saves a"
                                " checkpoint first, and the round spends no budget")
    refused = restart_answer(job({"restartRequested": "t",
                                  "inPlaceAsk": {"token": "t", "round": 0, "accepted": False}}), "t")
    assert refused is not None and not refused.done and refused.text.startswith("refused:")
    # an earlier token's answer is not this one's
    assert restart_answer(job({"restartRequested": "old",
                               "inPlaceAsk": {"token": "old", "accepted": True}}), "t") is None


def test_a_restart_the_operator_ignored_or_that_a_stall_replaced_or_the_job_ended():
    ignored = restart_answer(job({"restartRequested": "t"}, checkpoint=False), "t")
    assert ignored is not None and not ignored.done and "checkpointing is off" in ignored.text
    replaced = restart_answer(job({"restartRequested": "t", "inPlaceAsk": {"cause": "stalled"}}), "t")
    assert replaced is not None and not replaced.done and "a later ask (a stall)" in replaced.text
    # a script that saves on SIGTERM itself needs no spec.checkpoint
    replaced = restart_answer(job({"restartRequested": "t"}, checkpoint=False, script=True), "t")
    assert replaced is not None and "a later ask" in replaced.text
    for phase in ("Succeeded", "Failed"):
        ended = restart_answer(job({"phase": phase}), "t")
        assert ended == Answer(False, f"the job is {phase}: nothing to ask")


def test_a_checkpoint_is_answered_by_the_commit_of_its_token():
    assert checkpoint_answer(job({"checkpoint": {"requested": "t"}}), "t") is None
    earlier = {"requestCommitted": {"token": "old", "step": 3}}
    assert checkpoint_answer(job({"checkpoint": earlier}), "t") is None
    served = {"requestCommitted": {"token": "t", "step": 57, "time": "2030-01-01T00:00:00Z"}}
    saved = checkpoint_answer(job({"checkpoint": served}), "t")
    assert saved == Answer(True, "saved: rank 0 committed the checkpoint of step 57 (2030-01-01T00:00:00Z);"
                                 " training goes on")
    off = checkpoint_answer(job(checkpoint=False), "t")
    assert off is not None and not off.done and "checkpointing is off" in off.text
    ended = checkpoint_answer(job({"phase": "Failed"}), "t")
    assert ended == Answer(False, "the job is Failed: nothing to ask")


def test_tokens_differ_within_one_second():
    now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    tokens = {new_token(now) for _ in range(50)}
    assert len(tokens) == 50 and all(t.startswith("20300102T030405Z-") for t in tokens)


class FakeJobs:
    """The API server as `ask` sees it: `get` returns the job as the operator left it after `reads` reads."""

    def __init__(self, job: dict[str, Any], answer_after: int, answered: dict[str, Any]) -> None:
        self.job, self.reads, self.answer_after, self.answered = job, 0, answer_after, answered
        self.annotated: list[tuple[str, str]] = []

    def get(self, name: str) -> dict[str, Any]:
        assert name == "j"
        self.reads += 1
        doc = deepcopy(self.job)
        if self.annotated and self.reads > self.answer_after:
            token = self.annotated[-1][1]
            doc["status"].update(deepcopy(self.answered).items())
            doc["status"]["restartRequested"] = doc["status"]["inPlaceAsk"]["token"] = token
        return doc

    def annotate(self, name: str, key: str, value: str) -> dict[str, Any]:
        self.annotated.append((key, value))
        return self.job


def test_ask_sets_a_new_token_and_reads_until_the_answer(monkeypatch):
    jobs = FakeJobs(job(), answer_after=3, answered={"inPlaceAsk": {"round": 0, "accepted": True}})
    naps: list[float] = []
    asked = asking.ask(jobs, "j", ANNOTATION_RESTART_IN_PLACE, restart_answer, 60,  # type: ignore[arg-type]
                       sleep=naps.append)
    assert jobs.annotated == [(ANNOTATION_RESTART_IN_PLACE, asked.token)]
    assert asked.answer is not None and asked.answer.done and "(round 1)" in asked.answer.text
    assert jobs.reads == 4 and naps == [asking.POLL_S] * 2


def test_ask_gives_up_after_the_wait_and_asks_nothing_of_an_ended_job():
    jobs = FakeJobs(job(), answer_after=10**9, answered={})
    asked = asking.ask(jobs, "j", ANNOTATION_CHECKPOINT_NOW, checkpoint_answer, 0)  # type: ignore[arg-type]
    assert asked.answer is None and jobs.annotated == [(ANNOTATION_CHECKPOINT_NOW, asked.token)]
    ended = FakeJobs(job({"phase": "Succeeded"}), answer_after=0, answered={})
    asked = asking.ask(ended, "j", ANNOTATION_CHECKPOINT_NOW, checkpoint_answer, 60)  # type: ignore[arg-type]
    assert asked.token == "" and ended.annotated == []
    assert asked.answer == Answer(False, "the job is Succeeded: nothing to ask")


@pytest.mark.parametrize("verb", ["checkpoint", "restart"])
def test_an_api_server_that_refuses_is_one_line(tmp_path, verb):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "tetrad.cli", verb, "j"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120,
                       env={**os.environ, "KUBECONFIG": str(kubeconfig(tmp_path, f"http://127.0.0.1:{port}"))})
    assert "Connection refused" in one_error_line(r)
