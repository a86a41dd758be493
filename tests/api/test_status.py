"""`tetrad status` as a pure function of the job object, the model's name wherever a model is named,
and the example invocations under every command's --help. tests/cluster/test_cli_status.py reads a
job from the real apiserver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.api.helpers import manifest
from tetrad.api import parse
from tetrad.api.presets import model_name
from tetrad.cli import app
from tetrad.cli.examples import EXAMPLES, FIRST_STEPS
from tetrad.cli.status import duration, format_summary, summarize
from tetrad.resolve import resolve

ROOT = Path(__file__).parents[2]
NOW = datetime(2026, 1, 1, 2, 0, 0, tzinfo=UTC)


def stored(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """The job as the apiserver returns it: the spec with every default, the operator's status."""
    job, problems = parse(manifest(**spec))
    assert job is not None, problems
    obj = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    obj.pop("status", None)
    return obj | ({"status": status} if status is not None else {})


RUNNING = {"phase": "Running", "mesh": "pp2.dpr1.dps2.cp1.tp2", "restarts": 2, "disruptions": 1,
           "startTime": "2026-01-01T00:00:00Z",
           "training": {"step": 30, "loss": 3.25, "tokensPerSecond": 512.0, "mfu": 0.375,
                        "peakMemoryBytes": 3 * 2**30, "updated": "2026-01-01T01:59:50Z"}}


def test_summary_of_a_running_job():
    # globalBatch 8 x seqLen 128 = 1024 tokens a step at 512 tokens/s: 2 s a step; 70 steps left: 140 s.
    s = summarize(stored(RUNNING, model={"seqLen": 128}, training={"steps": 100}), NOW)
    assert (s["name"], s["namespace"], s["phase"], s["mesh"]) == ("t", "ns", "Running", "pp2.dpr1.dps2.cp1.tp2")
    assert (s["model"], s["step"], s["steps"], s["stepSeconds"], s["etaSeconds"]) == ("debug (seqLen 128)", 30, 100, 2.0, 140.0)
    assert (s["runningSeconds"], s["updatedSecondsAgo"]) == (7200.0, 10.0)
    text = format_summary(s)
    assert text.splitlines() == [
        "Job:          ns/t",
        "Phase:        Running",
        "Model:        debug (seqLen 128)",
        "Mesh:         pp2.dpr1.dps2.cp1.tp2 on 2 nodes x 4 processes",
        "Progress:     step 30 / 100 (30.0%), ETA 2m20s",
        "Step time:    2 s (global batch tokens / tokens per second)",
        "Tokens/s:     512",
        "MFU:          37.5%",
        "Loss:         3.2500",
        "Peak memory:  3.00 GiB (rank 0)",
        "Restarts:     2 (1 of them disruptions, not counted against maxRestarts)",
        "Running for:  2h00m",
        "Figures from: 10s ago",
    ]
    assert json.loads(json.dumps(s)) == s  # -o json prints this dict


def test_summary_shows_the_last_checkpoint_and_where_the_restart_resumed():
    status = RUNNING | {"checkpoint": {"step": 20, "time": "2026-01-01T01:55:00Z", "path": "/ckpt/step-00000020",
                                       "resumedFrom": 10, "resumedAtRestart": 2}}
    job = stored(status, checkpoint={"enabled": True, "path": "/ckpt"})
    lines = format_summary(summarize(job, NOW)).splitlines()
    assert "Checkpoint:   step 20 committed 5m00s ago at /ckpt/step-00000020; restart 2 resumed from step 10" in lines
    assert lines.index("Restarts:     2 (1 of them disruptions, not counted against maxRestarts)") == \
        lines.index("Checkpoint:   step 20 committed 5m00s ago at /ckpt/step-00000020; restart 2 resumed from step 10") + 1
    fresh = stored(RUNNING | {"checkpoint": {"resumedFrom": 0, "resumedAtRestart": 0}}, checkpoint={"enabled": True})
    assert "Checkpoint:   none committed yet; the first run started fresh" in format_summary(summarize(fresh, NOW))
    assert "Checkpoint:   none committed yet\n" in format_summary(summarize(stored(RUNNING, checkpoint={"enabled": True}), NOW))
    assert "Checkpoint" not in format_summary(summarize(stored(status), NOW))  # checkpointing off: no line


def test_summary_shows_the_preflight_bandwidth_the_slow_and_the_failed_nodes():
    status = RUNNING | {
        "preflight": {"restart": 2, "busBandwidthGBps": 38.0, "nodes": [
            {"node": "a", "nodeRank": 0, "busBandwidthGBps": 40.0}, {"node": "b", "nodeRank": 1, "busBandwidthGBps": 38.0},
            {"node": "c", "nodeRank": 2, "busBandwidthGBps": 9.0}]},
        "failedNodes": [{"node": "bad", "reason": "devices: 7 CUDA devices visible", "restart": 1, "excluded": True}]}
    text = format_summary(summarize(stored(status), NOW))
    assert "Preflight:    38 GB/s median bus bandwidth over 3 nodes (restart 2); slow: c 9 GB/s\n" in text
    assert "Failed nodes: bad in restart 1 (excluded): devices: 7 CUDA devices visible\n" in text
    relaxed = format_summary(summarize(stored(status, preflight={"slowNodeFraction": 0.2}), NOW))
    assert "(restart 2)\n" in relaxed, "no node below 0.2 of the median"
    assert "Preflight" not in format_summary(summarize(stored(RUNNING), NOW)) and "Failed nodes" not in text.split("Preflight")[0]


def test_eta_uses_the_presets_sequence_length():
    s = summarize(stored(RUNNING, training={"steps": 100, "globalBatch": 16}), NOW)
    assert s["stepSeconds"] == 16 * 256 / 512 and s["etaSeconds"] == 70 * 8.0  # debug: seqLen 256


def test_a_job_without_status_or_figures_yet():
    text = format_summary(summarize(stored(None), NOW))
    assert "Phase:    Pending" in text and "Mesh:     not resolved yet (2 nodes x 4 processes)" in text
    assert "Progress: no step reported yet, 100 to train" in text
    assert not any(word in text for word in ("ETA", "Tokens/s", "MFU", "Loss", "Running for", "Figures from"))


@pytest.mark.parametrize("phase", ["Succeeded", "Failed", "Suspended"])
def test_no_eta_unless_training(phase):
    s = summarize(stored(RUNNING | {"phase": phase, "message": "why", "completionTime": "2026-01-01T01:00:00Z"}), NOW)
    assert s["etaSeconds"] is None and s["runningSeconds"] == 3600.0
    assert "Message: why" in " ".join(format_summary(s).split())


def test_a_status_with_unexpected_values_still_shows():
    """The raw object is read field by field: a newer operator's fields or odd values do not crash it."""
    status = {"phase": "Running", "newField": {"x": 1}, "training": {"step": "7", "tokensPerSecond": True, "updated": "yesterday"}}
    s = summarize(stored(status), NOW)
    assert (s["tokensPerSecond"], s["etaSeconds"], s["updatedSecondsAgo"]) == (None, None, None)
    format_summary(s)


@pytest.mark.parametrize("seconds, shown", [(0, "0s"), (59.6, "1m00s"), (61, "1m01s"), (3600, "1h00m"), (90061, "1d1h")])
def test_duration(seconds, shown):
    assert duration(seconds) == shown


@pytest.mark.parametrize("preset, dims, name", [
    ("llama3-1b", {"seqLen": 8192}, "llama3-1b (seqLen 8192)"),
    ("llama3-1b", {"seqLen": 2048}, "llama3-1b"),  # the preset's own value
    ("debug", {"ropeTheta": 20000.0, "layers": 2}, "debug (layers 2, ropeTheta 20000)"),
    ("debug", {"normEps": 1e-6}, "debug (normEps 1e-06)"),
    (None, {"dim": 64}, "custom"),
    ("debug", {"dim": 64, "layers": 2, "heads": 4, "kvHeads": 2, "vocab": 64, "ffnDim": 128}, "custom"),
])
def test_model_name(preset, dims, name):
    assert model_name(preset, dims) == name


def test_the_model_is_named_the_same_in_the_plan_report_and_the_resolved_config(tmp_path):
    doc = manifest(model={"preset": "llama3-1b", "seqLen": 8192}, parallelism={"pp": 1, "dpShard": "auto", "tp": 2},
                   resources={"gpu": 4})
    job, _ = parse(doc)
    assert job is not None and resolve(job).model.name == "llama3-1b (seqLen 8192)"  # the trainer's log, `tetrad run`
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    shown = tetrad("plan", str(path), columns=200)
    assert "t: llama3-1b (seqLen 8192), 1.50B params, seqLen 8192, on 8 processes" in shown.stdout, shown.stdout
    report = json.loads(tetrad("plan", "--json", str(path)).stdout)
    assert report["model"]["name"] == "llama3-1b (seqLen 8192)"


def tetrad(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    return subprocess.run([sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env=env)


def test_status_without_the_kubernetes_client_says_what_to_install():
    code = ("import sys; sys.modules['kubernetes'] = None; sys.argv = ['tetrad', 'status', 'j'];"
            " from tetrad.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == ("error: `tetrad status` needs the kubernetes Python client:"
                                " pip install 'tetrad[operator]' (or pip install kubernetes)")


def test_status_rejects_an_unknown_output():
    r = tetrad("status", "j", "-o", "yaml")
    assert r.returncode == 1 and "--output 'yaml': use text or json" in r.stderr


def _examples(text: str) -> list[str]:
    return [line.strip().removeprefix("$ ") for line in text.splitlines() if line.strip().startswith("$ tetrad ")
            or line.strip().startswith("$ kubectl ")]


def test_tetrad_alone_shows_the_first_steps():
    r = tetrad()
    assert _examples(r.stdout + r.stderr) == FIRST_STEPS


def test_every_command_shows_examples_that_name_real_files():
    names = [c.name or c.callback.__name__ for c in app.registered_commands]  # type: ignore[union-attr]
    assert set(names) == set(EXAMPLES), "every command needs examples in tetrad/cli/examples.py"
    for name in names:
        r = tetrad(name, "--help", columns=200)
        assert r.returncode == 0, r.stderr
        assert _examples(r.stdout) == EXAMPLES[name], r.stdout
    for line in (line for lines in [*EXAMPLES.values(), FIRST_STEPS] for line in lines):
        for word in line.split():
            if word.startswith("examples/") and "*" not in word:
                assert (ROOT / word).is_file(), f"{line}: {word} does not exist"
