"""Distributed pieces on real gloo process groups: initial weights, CP attention, config errors, metrics."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from tetrad_trainer.model import Transformer, init_weights

from tests.trainer.harness import free_port_block, job, run_ranks, run_trainer
from tetrad.api import Layout
from tetrad.api.contract import EXIT_CONFIG_ERROR

pytestmark = pytest.mark.distributed


def single_process_init(cfg) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(cfg.model)
    init_weights(model, torch.device("cpu"), cfg.training.seed)
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("parallelism, nproc", [
    ({"dpShard": 2, "tp": 2}, 4),  # FSDP over TP: 2D DTensors with strided sharding
    ({"dpReplicate": 2, "dpShard": 2}, 4),  # HSDP
    ({"pp": 2, "ppSchedule": "Interleaved1F1B", "tp": 2}, 4),  # 2 stages per rank, TP inside
    ({"cp": 2, "dpShard": 2}, 4),  # FSDP over dp_shard x cp
], ids=["dpShard2-tp2", "dpReplicate2-dpShard2", "pp2-interleaved-tp2", "cp2-dpShard2"])
def test_initial_weights_do_not_depend_on_layout(parallelism: dict[str, object], nproc: int,
                                                 tmp_path: Path) -> None:
    cfg = job(parallelism, nproc=nproc, training={"seed": 3}, model={"seqLen": 64})
    (tmp_path / "config.json").write_text(cfg.to_json())
    out = tmp_path / "init.pt"
    run = run_ranks("tests.trainer.probes:initial_parameters",
                    ["--config", str(tmp_path / "config.json"), "--out", str(out)], 1, nproc, tmp_path)
    assert run.codes == [0] * nproc, run.logs()
    got, want = torch.load(out), single_process_init(cfg)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("fsdp, gathered, offload", [
    ({}, False, "OffloadPolicy"),  # ZeRO-3: each block frees its gathered parameters after its forward
    ({"reshardAfterForward": False}, True, "OffloadPolicy"),  # ZeRO-2 behaviour: they stay for the backward
    ({"offload": "cpu"}, False, "CPUOffloadPolicy"),
], ids=["default", "reshardAfterForward-false", "offload-cpu"])
def test_fsdp_settings_reach_every_unit(fsdp: dict[str, object], gathered: bool, offload: str,
                                        tmp_path: Path) -> None:
    """The equivalence tests show these settings change no numbers; this shows they are applied."""
    cfg = job({"dpShard": 2}, nproc=2, training={"fsdp": fsdp}, model={"seqLen": 64})
    (tmp_path / "config.json").write_text(cfg.to_json())
    out = tmp_path / "units.json"
    run = run_ranks("tests.trainer.probes:fsdp_units",
                    ["--config", str(tmp_path / "config.json"), "--out", str(out)], 1, 2, tmp_path)
    assert run.codes == [0, 0], run.logs()
    report = json.loads(out.read_text())
    assert report["gathered_after_forward"] == [gathered] * cfg.model.layers
    assert report["offload"] == [offload] * cfg.model.layers
    assert report["rope_device"] == "cpu"


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_causal_attention_forward_and_backward(cp: int, tmp_path: Path) -> None:
    run = run_ranks("tests.trainer.probes:cp_attention", [], 1, cp, tmp_path)
    assert run.codes == [0] * cp, run.logs()
    assert all("exact" in run.log(r) for r in range(cp))


def test_mesh_that_cannot_be_built_exits_78_naming_the_degrees(tmp_path: Path) -> None:
    cfg = job({"dpShard": 2}, nproc=2)
    bad = cfg.model_copy(update={"layout": Layout(tp=2, cp=2)})  # 4 ranks of mesh on a world of 2
    run = run_trainer(bad, tmp_path)
    assert run.codes == [EXIT_CONFIG_ERROR] * 2, run.logs()
    assert ("cannot build the device mesh pp=1 x dp_replicate=1 x dp_shard=1 x cp=2 x tp=2 = 4 ranks on a "
            "world of 2" in run.log(0))


def test_too_few_pipeline_microbatches_exit_78(tmp_path: Path) -> None:
    cfg = job({"pp": 2}, nproc=2, training={"globalBatch": 4})
    run = run_trainer(cfg.model_copy(update={"pp_microbatches": 1}), tmp_path)
    assert run.codes == [EXIT_CONFIG_ERROR] * 2, run.logs()
    for rank in (0, 1):  # checked before any collective, so no rank is left waiting on the other
        assert "ppMicrobatches=1 is below the 2 pipeline stages" in run.log(rank)


def gauge(body: str, name: str) -> float | None:
    match = re.search(rf"^{name} (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_every_rank_serves_prometheus_metrics_while_training(tmp_path: Path) -> None:
    cfg = job({"dpShard": 2}, nproc=2, model={"seqLen": 32},
              training={"steps": 100, "globalBatch": 2,
                        "precision": "fp32"})  # ample time to scrape on a fast machine
    port = free_port_block(2)
    seen: dict[int, str] = {}

    def scrape() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(seen) < 2:
            for rank in {0, 1} - set(seen):
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics",
                                                  timeout=2).read().decode()
                except OSError:
                    continue
                if (gauge(body, "tetrad_step") or 0) >= 1:
                    seen[rank] = body
            time.sleep(0.05)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    run = run_trainer(cfg, tmp_path, env={"TETRAD_METRICS_PORT": str(port)})
    scraper.join()
    assert run.codes == [0, 0], run.logs()
    assert set(seen) == {0, 1}, "a rank's endpoint never served a completed step"
    for name in ("tetrad_step", "tetrad_loss", "tetrad_tokens_per_second", "tetrad_mfu",
                 "tetrad_peak_memory_bytes", "tetrad_last_step_timestamp_seconds"):
        value = gauge(seen[0], name)
        assert value is not None and value > 0, name
    assert 'tetrad_info{job="test",mesh="pp1.dpr1.dps2.cp1.tp1",rank="1"} 1.0' in seen[1]


@pytest.mark.parametrize("parallelism", [{"dpShard": 2}, {"dpReplicate": 2}, {"pp": 2, "tp": 2}],
                         ids=["fsdp-mixed-precision", "replicate-mixed-precision", "pp-tp-autocast"])
def test_bf16_trains_close_to_fp32(parallelism: dict[str, object], tmp_path: Path) -> None:
    losses = {}
    for precision in ("fp32", "bf16"):
        nproc = 2 * (2 if "tp" in parallelism else 1)
        cfg = job(parallelism, nproc=nproc, model={"seqLen": 32},
                  training={"steps": 3, "globalBatch": 4, "microBatch": 2, "precision": precision})
        run = run_trainer(cfg, tmp_path / precision)
        assert run.codes == [0] * nproc, run.logs()
        losses[precision] = [r["loss"] for r in run.records]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["bf16"] != losses["fp32"]  # bf16 compute did happen
