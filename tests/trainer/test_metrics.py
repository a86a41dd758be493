"""Prometheus names, the JSON line, and the MFU peak table."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from tetrad_trainer.checkpoint import Checkpointer
from tetrad_trainer.metrics import (
    ROUND_CAUSE_MAX,
    MfuPeak,
    RankMetrics,
    StepRecord,
    gpu_peak_tflops,
    measure_cpu_tflops,
    peak_tflops,
)

from tests.checkpoint import gang, toy
from tests.trainer.harness import free_port
from tetrad.api import contract

RECORD = StepRecord(step=3, loss=2.5, grad_norm=0.7, lr=1e-4, step_time_s=0.5, tokens_per_second=4096.0,
                    tokens_per_second_per_device=1024.0, tflops=0.2, mfu=0.31, peak_memory_bytes=123456789,
                    peak_memory_reserved_bytes=200000000)
JSON_KEYS = {"step", "loss", "tokens_per_second", "mfu", "tflops", "peak_memory_bytes", "step_time_s"}


def test_endpoint_serves_the_names_the_operator_reads(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    metrics = RankMetrics(port=port, rank=0, labels={"job": "j", "rank": "0", "mesh": "m"},
                          jsonl=tmp_path / "m.jsonl")
    try:
        metrics.log(RECORD)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    for line in ("tetrad_step 3.0", "tetrad_loss 2.5", "tetrad_tokens_per_second 4096.0", "tetrad_mfu 0.31",
                 "tetrad_peak_memory_bytes 1.23456789e+08", "tetrad_tflops 0.2",
                 "tetrad_step_time_seconds 0.5", "tetrad_grad_norm 0.7", "tetrad_learning_rate 0.0001",
                 "tetrad_tokens_per_second_per_device 1024.0",
                 'tetrad_info{job="j",mesh="m",rank="0"} 1.0'):
        assert f"\n{line}\n" in body, line
    printed = json.loads(capsys.readouterr().out.strip())
    written = json.loads((tmp_path / "m.jsonl").read_text())
    assert printed == written and printed.keys() >= JSON_KEYS and printed["step"] == 3


def test_the_round_of_restarts_in_place_is_exported_with_its_cause_cut_short() -> None:
    first = RankMetrics(port=None, rank=0, labels={}, jsonl=None)
    cause = "node 1 exited 1 " + "x" * 500
    later = RankMetrics(port=None, rank=0, labels={}, jsonl=None, round=2, round_cause=cause)
    try:
        assert first.registry.get_sample_value(contract.METRIC_ROUND, {contract.LABEL_ROUND_CAUSE: ""}) == 0
        (sample,) = [s for family in later.registry.collect() for s in family.samples
                     if s.name == contract.METRIC_ROUND]
        assert sample.value == 2 and sample.labels[contract.LABEL_ROUND_CAUSE].startswith("node 1 exited 1 x")
        assert len(sample.labels[contract.LABEL_ROUND_CAUSE]) == ROUND_CAUSE_MAX
    finally:
        first.close()
        later.close()


def test_heartbeat_is_the_time_of_the_last_step(tmp_path: Path) -> None:
    metrics = RankMetrics(port=None, rank=0, labels={}, jsonl=None)
    try:
        # no step yet: the operator leaves a 0 out
        assert metrics.registry.get_sample_value("tetrad_last_step_timestamp_seconds") == 0
        before = time.time()
        metrics.step_completed()
        assert (before <= metrics.registry.get_sample_value("tetrad_last_step_timestamp_seconds")
                <= time.time())
    finally:
        metrics.close()


def checkpointing_run(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, float | None]]:
    """The toy model trained with the real Checkpointer wired to RankMetrics as the trainer wires them:
    the checkpoint gauges after the resume and after every step."""
    cfg = toy.config({"dpShard": world}, spec["path"], steps=spec["steps"], interval=spec["interval"],
                     async_save=spec["async"])
    model, mesh = toy.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr)
    loader = toy.ToyLoader(cfg, mesh["dp_shard"].get_local_rank())
    metrics = RankMetrics(port=None, rank=rank, labels={}, jsonl=None)
    ckpt = Checkpointer(cfg, model_parts=[model], optimizers=[opt], data_loader=loader,
                        dp_rank=mesh["dp_shard"].get_local_rank(), logger=lambda _: None,
                        on_commit=metrics.checkpoint_committed)

    def gauges() -> dict[str, float | None]:
        return {name: metrics.registry.get_sample_value(name) for name in
                ("tetrad_checkpoint_step", "tetrad_checkpoint_timestamp_seconds", "tetrad_resumed_from_step")}

    seen = [gauges()]
    resumed = ckpt.resume()
    step = resumed.step if resumed else 0
    metrics.resumed(step)
    seen.append(gauges())
    while step < cfg.training.steps:
        step += 1
        x, y = loader.next_batch()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if ckpt.due(step):
            ckpt.save(step)
        ckpt.wait()  # an async save commits from its thread: read the gauges once it has
        seen.append(gauges())
    ckpt.close()
    metrics.close()
    return seen


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_checkpoint_gauges_follow_the_commits_and_the_resume(tmp_path: Path, async_save: bool) -> None:
    spec = {"path": str(tmp_path / "ckpt"), "steps": 7, "interval": 3, "async": async_save}
    before = time.time()
    first = gang.run(checkpointing_run, 2, spec)
    for seen in first:  # every rank exports them; the operator reads rank 0's
        # unset: the operator leaves NaN out
        assert all(math.isnan(v) for v in seen[0].values() if v is not None)
        assert seen[1]["tetrad_resumed_from_step"] == 0  # a fresh start
        steps = [s["tetrad_checkpoint_step"] for s in seen[2:]]
        assert ([None if math.isnan(v) else int(v) for v in steps]  # type: ignore[arg-type]
                == [None, None, 3, 3, 3, 6, 6])
        times = [s["tetrad_checkpoint_timestamp_seconds"] for s in seen[4:]]
        assert before <= times[0] == times[2] < times[3] <= time.time()  # each commit's own time
    second = gang.run(checkpointing_run, 2, {**spec, "steps": 9})  # resumes from step 6, commits 9
    for seen in second:
        assert seen[1]["tetrad_resumed_from_step"] == 6
        assert math.isnan(seen[1]["tetrad_checkpoint_step"])  # this process committed nothing yet
        assert ([s["tetrad_checkpoint_step"] for s in seen[2:]]
                == [pytest.approx(math.nan, nan_ok=True)] * 2 + [9])


def test_only_rank_0_writes_json_lines_and_a_busy_port_does_not_stop_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    first = RankMetrics(port=port, rank=0, labels={}, jsonl=None)
    second = RankMetrics(port=port, rank=1, labels={}, jsonl=tmp_path / "x.jsonl")
    try:
        assert first.port == port and second.port is None
        second.log(RECORD)
        assert capsys.readouterr().out == "" and not (tmp_path / "x.jsonl").exists()
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("h100", 989.0),
                                        ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("Tesla T4", None)])
def test_gpu_peak_table(name: str, peak: float | None) -> None:
    assert gpu_peak_tflops(name) == peak


def test_cpu_peak_is_measured_unless_configured() -> None:
    assert measure_cpu_tflops(seconds=0.05, n=128) > 0
    assert peak_tflops(torch.device("cpu"), 2.5, None) == MfuPeak(2.5, "metrics.peakTflops")
    assert peak_tflops(torch.device("cpu"), None, "H100").source == "measured fp32 matmul on the CPU"


def test_mfu_never_exceeds_one_and_says_why_once():
    measured = MfuPeak(0.05, "measured fp32 matmul on the CPU")
    assert measured.mfu(0.025) == pytest.approx(0.5) and measured.said is None
    assert measured.mfu(0.08) == 1.0  # the start-up measurement was low (its neighbours were busy)
    assert measured.tflops == 0.08 and "the peak is raised to what steps achieve" in (measured.said or "")
    assert measured.mfu(0.04) == pytest.approx(0.5)  # against the raised peak from now on
    given = MfuPeak(1.0, "metrics.peakTflops")
    assert given.mfu(2.0) == 1.0 and given.tflops == 1.0
    assert ("above the MFU peak of 1 (metrics.peakTflops); MFU is reported as at most 100%"
            in (given.said or ""))
    assert "set spec.metrics.peakTflops" in (given.said or "")
    assert math.isnan(given.mfu(math.nan))  # a script that gives no FLOPs: no figure, no claim


def test_the_gates_buffer_is_not_counted_in_the_cpu_peak_memory():
    """tetrad.node.gang resets the peak after the preflight all-reduce: the trainer reports what training
    used."""
    from tetrad_trainer.metrics import peak_memory_bytes

    from tetrad.node.gang import forget_peak_memory

    buffer = bytearray(256 << 20)
    buffer[:: 4096] = b"\1" * len(buffer[:: 4096])  # touched: resident
    del buffer
    before, _ = peak_memory_bytes(torch.device("cpu"))
    forget_peak_memory(False, 0)
    after, _ = peak_memory_bytes(torch.device("cpu"))
    assert after < before - (200 << 20), (before, after)
