"""Preemption and resume through the real launchers: torchrun under the exit-code supervisor, and
`tetrad run --steps N` picking up the manifest's checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.trainer.harness import free_port, job
from tetrad.api.contract import EXIT_PREEMPTED

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAINING = {"steps": 500, "globalBatch": 4, "microBatch": 1, "precision": "fp32", "lr": 1e-3, "warmupSteps": 2}


def wait_for_steps(jsonl: Path, n: int, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        if jsonl.exists() and len(jsonl.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def torchrun(config: Path, jsonl: Path, supervised: bool) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tetrad_trainer.train", "--config", str(config), "--jsonl", str(jsonl)]
    return [sys.executable, "-m", "tetrad_trainer.preemption", *cmd] if supervised else cmd


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "bare-torchrun"])
def test_sigterm_to_the_node_saves_and_exits_75(tmp_path, supervised):
    """SIGTERM to the container's first process (as the kubelet sends it): the workers finish the
    step, save and exit 75; torchrun alone turns that into 1, the supervisor passes 75 on."""
    ckpt = tmp_path / "ckpt"
    cfg = job({"dpShard": 2}, nproc=2, model={"seqLen": 32}, training=TRAINING,
              checkpoint={"enabled": True, "path": str(ckpt), "interval": 1000, "async": True},
              metrics={"port": free_port()})
    config, jsonl, log = tmp_path / "config.json", tmp_path / "steps.jsonl", tmp_path / "node.log"
    config.write_text(cfg.to_json())
    with log.open("wb") as out:
        proc = subprocess.Popen(torchrun(config, jsonl, supervised), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for_steps(jsonl, 3, proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == (EXIT_PREEMPTED if supervised else 1), text[-3000:]
    stopped = [line for line in text.splitlines() if "on SIGTERM" in line]
    assert stopped, text[-3000:]
    step = int(stopped[0].split("stopped after step ")[1].split()[0])
    assert (ckpt / "latest").read_text() == f"step-{step:08d}\n"
    assert f"committed step {step}" in text


def test_tetrad_run_resumes_from_the_manifests_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    manifest = {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "resumable-local"},
        "spec": {"nodes": 1, "nprocPerNode": 2, "parallelism": {"dpShard": 2}, "model": {"preset": "debug", "seqLen": 32},
                 "training": {**TRAINING, "steps": 20}, "metrics": {"port": free_port()},
                 "checkpoint": {"enabled": True, "path": str(ckpt), "interval": 2}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))

    def tetrad_run(steps: int, name: str) -> list[dict]:
        work = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "tetrad.cli", "run", str(path), "--steps", str(steps),
                               "--workdir", str(work)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        logs = "".join(p.read_text() for p in sorted(work.glob("node-*.log")))
        assert done.returncode == 0, done.stderr[-3000:] + logs[-3000:]
        return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()], logs

    first, _ = tetrad_run(3, "first")
    assert [r["step"] for r in first] == [1, 2, 3]
    assert (ckpt / "latest").read_text() == "step-00000003\n"  # the last step is always saved
    second, logs = tetrad_run(5, "second")
    assert f"resumed step 3 from {ckpt}/step-00000003" in logs
    assert [r["step"] for r in second] == [4, 5]
