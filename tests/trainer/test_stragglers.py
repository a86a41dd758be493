"""Stragglers: the rule that names a slow rank (tetrad.api.stragglers), and the trainer naming the rank a test
fault slows, on real processes (`tetrad run`, torchrun, gloo), without a false alarm on a healthy run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer.test_launch import make_job
from tetrad.api.contract import ENV_TEST_FAULT, ENV_TEST_FAULTS_ALLOWED
from tetrad.api.stragglers import RankTime, is_slow, slowest
from tetrad.launch import run_local


def test_the_lag_is_a_ranks_own_time_over_its_peers_median_as_a_share_of_the_step() -> None:
    times = [RankTime(r, f"node-{r // 2}", 1.0) for r in range(7)] + [RankTime(7, "node-3", 1.5)]
    median, ranked = slowest(times, step_s=2.0)
    assert median == 1.0
    assert [(s.rank, s.node, s.lag) for s in ranked] == [(7, "node-3", 0.25), (0, "node-0", 0.0),
                                                         (1, "node-0", 0.0)]
    # a gang of two: the slower rank is measured against the other
    assert slowest([RankTime(0, "a", 1.0), RankTime(1, "b", 1.4)], 1.4)[1][0].lag == pytest.approx(0.4 / 1.4)


def test_pipeline_stages_are_compared_within_themselves() -> None:
    """The last stage holds the output projection: its ranks are slower than the first's, and not slow."""
    times = [RankTime(r, "n", 1.0 if r < 4 else 1.6, stage=r // 4) for r in range(8)]
    assert all(s.lag == 0.0 for s in slowest(times, 1.6)[1])
    times[5] = RankTime(5, "n", 2.0, stage=1)
    assert slowest(times, 2.0)[1][0].rank == 5 and slowest(times, 2.0)[1][0].lag == pytest.approx(0.2)


def test_ranks_not_measured_and_a_rank_alone_have_no_lag_and_a_zero_threshold_names_none() -> None:
    assert slowest([RankTime(0, "a", math.nan), RankTime(1, "b", 1.0)], 1.0)[1][0].lag == 0.0
    alone = slowest([RankTime(0, "a", 1.0)], 1.0)
    assert alone[0] == 1.0 and [s.lag for s in alone[1]] == [0.0]
    assert math.isnan(slowest([], 1.0)[0])
    assert is_slow(0.3, 0.2) and not is_slow(0.1, 0.2) and not is_slow(0.9, 0.0)


def records(jsonl: Path) -> list[dict[str, object]]:
    return [r for r in (json.loads(line) for line in jsonl.read_text().splitlines()) if "step" in r]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_rank_a_fault_slows_is_named_with_its_lag_and_a_healthy_run_names_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    healthy = tmp_path / "healthy.jsonl"
    training = {"steps": 6, "globalBatch": 4, "precision": "fp32"}
    assert run_local(make_job("healthy", training=training), steps=None, jsonl=healthy,
                     workdir=tmp_path / "h") == 0
    calm = records(healthy)[1:]  # the first step builds caches unevenly
    assert len(calm) == 5 and all(r["slowest_rank_lag"] < 0.2 for r in calm), calm

    # 800 ms: on two loaded cores a step can take 3 s, where 400 ms were a lag of only 0.13
    monkeypatch.setenv(ENV_TEST_FAULT, "slow-rank:1:ms:800")
    monkeypatch.setenv(ENV_TEST_FAULTS_ALLOWED, "1")
    slow = tmp_path / "slow.jsonl"
    assert run_local(make_job("slow", training=training), steps=None, jsonl=slow, workdir=tmp_path / "s") == 0
    named = records(slow)[1:]
    assert all(r["slowest_rank"] == 1 and r["slowest_rank_lag"] >= 0.2 for r in named), named
    # rank 1's 800 ms are most of each step: the gang waits for it, and the step shows it
    assert all(r["step_time_s"] >= 0.8 for r in named), named


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_on_the_runtime_library_gets_the_slow_rank_named_too(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The library measures a rank's CPU time between its polls, and gathers at rank 0 in poll."""
    from tests.trainer.test_scripts import EXAMPLES, rows, script_job

    monkeypatch.setenv(ENV_TEST_FAULT, "slow-rank:1:ms:300")
    monkeypatch.setenv(ENV_TEST_FAULTS_ALLOWED, "1")
    job = script_job("rt-slow", {"path": str(EXAMPLES / "runtime" / "train.py"), "args": ["--steps", "6"]},
                     checkpoint={"path": str(tmp_path / "ckpt")})  # where the script saves (and resumes)
    assert run_local(job, workdir=tmp_path / "w") == 0
    named = [r for r in rows(tmp_path / "w") if "step" in r][2:]  # a report names the last poll's gather
    assert len(named) == 4, named
    assert all(r["slowest_rank"] == 1 and r["slowest_rank_lag"] >= 0.2 for r in named), named
