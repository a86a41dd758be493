"""A hung rank: its peers time out in their collective within runPolicy.collectiveTimeoutSeconds,
name the collective and the peer that did not answer (a JSON line each, the pod's termination
message), and exit 79 through the node's supervisor. Real processes: `tetrad run`, torchrun, gloo."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tetrad_trainer import faults
from tetrad_trainer.config import ConfigError

from tests.processes import processes_mentioning
from tests.trainer.test_launch import make_job
from tetrad.api.contract import (
    ENV_TEST_FAULT,
    ENV_TEST_FAULTS_ALLOWED,
    EXIT_COLLECTIVE_TIMEOUT,
)
from tetrad.api.termination import TerminationMessage
from tetrad.launch import run_local
from tetrad.node import collective


def test_the_flight_recorder_is_sized_through_the_variable_the_torch_in_use_reads() -> None:
    assert collective.flight_recorder_variable("2.15.0+cu132") == "TORCH_FR_BUFFER_SIZE"
    assert collective.flight_recorder_variable("2.8.0") == "TORCH_FR_BUFFER_SIZE"
    assert collective.flight_recorder_variable("2.7.1+cpu") == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    assert collective.flight_recorder_variable("2.10.0a0+git1234") == "TORCH_FR_BUFFER_SIZE"


def test_a_fault_acts_only_when_tests_allow_faults(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV_TEST_FAULT, "hang-rank:1:step:3")
    monkeypatch.delenv(ENV_TEST_FAULTS_ALLOWED, raising=False)
    assert faults.configured() is None
    assert f"ignoring {ENV_TEST_FAULT}=hang-rank:1:step:3" in capsys.readouterr().err
    monkeypatch.setenv(ENV_TEST_FAULTS_ALLOWED, "1")
    assert faults.configured() == faults.Hang(rank=1, step=3)
    faults.inject(faults.configured(), rank=0, step=3)  # another rank, or another step: returns at once
    faults.inject(faults.configured(), rank=1, step=2)
    monkeypatch.setenv(ENV_TEST_FAULT, "hang:1")
    with pytest.raises(ConfigError, match="use hang-rank:RANK:step:STEP"):
        faults.configured()


def test_the_timed_out_collective_is_the_newest_one_not_completed() -> None:
    entries = [{"record_id": i, "state": s, "profiling_name": f"op{i}", "process_group": ["0", "default_pg"],
                "collective_seq_id": i} for i, s in enumerate(("completed", "scheduled", "completed"))]
    assert collective.last_collective({"entries": entries}) == entries[1]
    assert collective.last_collective({"entries": entries[:1]}) == entries[0]  # gloo never says completed
    assert collective.last_collective({"entries": []}) is None
    line = collective.summary({"rank": 2, "collective": "gloo:all_reduce", "sequence": 7, "group": "mesh_tp",
                               "group_ranks": [2, 3], "timeout_s": 20, "not_answering": [3]})
    assert line == ("rank 2: gloo:all_reduce #7 in process group mesh_tp (ranks 2,3) timed out after 20s; "
                    "not answering: rank 3")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hung_rank_makes_its_peers_time_out_name_it_and_exit_79(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    timeout = 20
    monkeypatch.setenv(ENV_TEST_FAULT, "hang-rank:1:step:3")
    monkeypatch.setenv(ENV_TEST_FAULTS_ALLOWED, "1")
    # maxRestarts 0: a collective timeout restarts the gang in place otherwise, and the fault hangs again
    job = make_job("hang", nodes=2, nprocPerNode=2, parallelism={"dpShard": 4},
                   runPolicy={"collectiveTimeoutSeconds": timeout, "maxRestarts": 0})
    work = tmp_path / "work"
    start = time.monotonic()
    code = run_local(job, steps=None, jsonl=tmp_path / "metrics.jsonl", workdir=work)
    took = time.monotonic() - start
    logs = {n: (work / f"node-{n}.log").read_text() for n in (0, 1)}
    assert code == EXIT_COLLECTIVE_TIMEOUT, logs
    reports = {}
    for text in logs.values():
        for line in text.splitlines():
            if line.startswith("{") and '"collective_timeout"' in line:
                r = json.loads(line)
                reports[r["rank"]] = r
    assert sorted(reports) == [0, 2, 3], logs  # every rank but the hung one says it timed out
    for rank, r in reports.items():
        assert r["not_answering"] == [1], r
        assert r["collective"].startswith("gloo:") and r["group_ranks"] == [0, 1, 2, 3], r
        assert sorted(r["waiting_too"]) == sorted({0, 2, 3} - {rank}), r
        assert timeout - 1 <= r["waited_s"] < timeout + 30, r
    same = {(r["collective"], r["sequence"], r["group"]) for r in reports.values()}
    assert len(same) == 1, same  # the one collective every waiting rank is in
    assert "hanging at the start of step 3 (test fault)" in logs[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    summaries = [TerminationMessage.parse(p.read_text()).collective_timeout
                 for p in work.glob("node-*.termination")]
    assert any(s is not None and s.endswith("timed out after 20s; not answering: rank 1")
               for s in summaries), summaries
    # the failed node's summary in the terminal, not only its log
    terminal = " ".join(capsys.readouterr().err.split())
    assert "collective timeout: rank " in terminal and "not answering: rank 1" in terminal, terminal
    assert took < 240, took  # start-up, two steps, the timeout, the peers' exchange, the stop
    assert not processes_mentioning(str(work))
