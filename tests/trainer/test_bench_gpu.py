"""bench/gpu.py: imports without a GPU or transformers, plans every configuration, and runs end to end with
--smoke."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402

from tests.trainer.harness import free_port  # noqa: E402

GiB = 1024**3


def test_the_planner_predicts_every_configuration_for_an_h100() -> None:
    plans = {name: gpu.planned(cfg, 40, "bf16", "H100") for name, cfg in gpu.CONFIGS.items()}
    assert all(p["tokens_per_second"] > 0 and p["peak_bytes"] > 0 for p in plans.values()), plans
    # issue 11: full AC at microBatch 16 ran out of memory on the 80 GB H100; the chunked loss is the way out
    assert plans["1b-16x2048-fullAC-eager"]["peak_bytes"] > 72 * GiB
    assert plans["1b-16x2048-fullAC-lossChunks8-eager"]["peak_bytes"] < 72 * GiB
    assert gpu.planned(gpu.CONFIGS["1b-4x2048-eager"], 40, "bf16", None) == {"tokens_per_second": None,
                                                                             "peak_bytes": None}


@pytest.mark.distributed
@pytest.mark.slow
def test_smoke_runs_every_system_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"tetrad", "torchtitan", "hf", "hand"}
    for system in ("tetrad", "hand"):
        assert rows[system]["status"] == "ok", rows[system]
        assert (rows[system]["tokens_per_second"] > 0 and rows[system]["peak_bytes"] > 0
                and rows[system]["mfu"] > 0 and 0 < rows[system]["final_loss"] < 12)
    for system, package in (("hf", "transformers"), ("torchtitan", "torchtitan")):
        if importlib.util.find_spec(package) is None:
            assert rows[system]["status"] == f"skipped: {package} is not installed (pip install {package})"
            assert "vs_" + system not in rows["tetrad"]
        else:
            assert rows[system]["status"] == "ok" and rows["tetrad"]["vs_" + system] > 0
    assert "| debug-2x64-eager | tetrad | " in done.stdout


def test_torchtitan_is_given_tetrads_dims_batch_and_settings() -> None:
    """The torchtitan system's configuration, checked without torchtitan: its FFN sizing rule gives Tetrad's
    width, and each setting the comparison depends on is mapped."""
    import math

    from tetrad.api import parse
    from tetrad.resolve import resolve

    cfg = gpu.Config("llama3-1b", 2048, 4, ac="selective", compile=True, float8="rowwise")
    job, problems = parse(gpu.job_document(cfg, 40, "bf16", 1, None))
    assert job is not None, problems
    resolved = resolve(job)
    args, sections = gpu.torchtitan_settings(resolved)
    m = resolved.model
    hidden = int(2 * 4 * args["dim"] / 3)  # torchtitan's FeedForward sizing, with no multiplier
    assert args["multiple_of"] * math.ceil(hidden / args["multiple_of"]) == m.ffn_dim == 8192
    assert (args["dim"], args["n_layers"], args["n_heads"], args["n_kv_heads"], args["vocab_size"]) == (
        2048, 16, 32, 8, 128256)
    assert sections["training"] | {} == {"local_batch_size": 4, "global_batch_size": 4, "seq_len": 2048,
                                         "steps": 40, "max_norm": 1.0, "mixed_precision_param": "bfloat16"}
    assert sections["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert sections["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert sections["optimizer"]["implementation"] == "fused"
    assert sections["model"]["converters"] == ["quantize.linear.float8"]
    assert sections["float8"] == {"recipe_name": "rowwise", "filter_fqns": ["output"]}


def test_the_gpu_checks_refuse_to_run_without_a_gpu_and_their_preflight_check_holds_on_the_cpu() -> None:
    """hack/gpu_checks.py runs on the GPU machine only; its device-count check is plain logic."""
    done = subprocess.run([sys.executable, str(ROOT / "hack" / "gpu_checks.py")], capture_output=True,
                          text=True, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 1 and "no CUDA device: these checks need one" in done.stderr
    sys.path.insert(0, str(ROOT / "hack"))
    import gpu_checks

    assert gpu_checks.preflight_names_the_device_count(ROOT) is None  # 0 visible, nprocPerNode 1: named


def test_the_gpu_checks_restart_in_place_from_the_spare_passes_on_the_cpu(tmp_path: Path) -> None:
    """The GPU check that a killed worker's round forks from the spare and resumes, run on the CPU."""
    sys.path.insert(0, str(ROOT / "hack"))
    import gpu_checks

    assert gpu_checks.restarts_in_place_from_the_spare(tmp_path, gpus=0) is None


@pytest.mark.distributed
def test_op_bytes_counts_every_op_of_an_eager_step_and_ropes_eager_form() -> None:
    """bench/op_bytes.py on one block: each linear layer's matmuls (forward, input and weight gradients),
    the vocabulary's output projection among them, and RoPE as complex products, not the compiled form's."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import op_bytes; "
            "print(json.dumps(op_bytes.counted_step('tetrad', 1, 64, 1, 512)))")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    calls, written = json.loads(done.stdout.strip().splitlines()[-1])
    assert calls["aten.mm"] == 3 * 8  # wq, wk, wv, wo, w1, w2, w3 and the output projection
    logits = 64 * 512 * 2  # bf16 logits of the output projection's forward
    assert written["aten.mm"] > logits
    assert "aten.flip" not in calls and "aten.addcmul" not in calls
