"""checkpoint-now and a suspend's save through the real launcher: supervised torchrun, two gloo ranks.

A token written into the request file (the pod's downward-API projection of the
`tetrad.dev/checkpoint-now` annotation) makes every rank save the same step while training goes on,
and rank 0 exports the token with that step once committed; SIGTERM then saves, leaves the committed
step in the termination log, and the next run resumes with the step after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tetrad_operator import scrape
from tetrad_trainer.checkpoint.store import read_manifest

from tests.checkpoint.test_torchrun import TRAINING, wait_for_steps
from tests.trainer.harness import free_port, job
from tetrad.api import contract
from tetrad.launch.local import logged_steps

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_checkpoint_now_saves_one_step_on_every_rank_and_sigterm_then_resume_loses_no_step(tmp_path):
    ckpt, request, termination = tmp_path / "ckpt", tmp_path / "checkpoint-now", tmp_path / "termination-log"
    port = free_port()
    cfg = job({"dpShard": 2}, nproc=2, model={"seqLen": 32}, training=TRAINING,
              checkpoint={"enabled": True, "path": str(ckpt), "interval": 1000, "async": True},
              metrics={"port": port})
    config = tmp_path / "config.json"
    config.write_text(cfg.to_json())
    request.write_text("")  # as the projection of a pod without the annotation
    env = {**os.environ, "OMP_NUM_THREADS": "1", contract.ENV_CHECKPOINT_REQUEST_FILE: str(request),
           contract.ENV_TERMINATION_LOG: str(termination)}

    def node(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        jsonl, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tetrad.node", "supervise", "--", sys.executable, "-m",
                 "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tetrad.node", "worker",
                 "--trainer", "--",
                 "--config", str(config), "--jsonl", str(jsonl), *args], stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True)
        return proc, jsonl, log

    proc, jsonl, log = node("first")
    try:
        wait_for_steps(jsonl, 3, proc)
        request.write_text("2030-01-01T00:00:00Z\n")  # what the kubelet writes when the annotation appears
        deadline = time.monotonic() + 120
        while not (ckpt / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        saved = int((ckpt / "latest").read_text().strip().removeprefix("step-"))
        text = log.read_text()
        assert f"checkpoint-now '2030-01-01T00:00:00Z': saving step {saved}" in text, text[-3000:]
        files = read_manifest(ckpt / contract.step_dir_name(saved))["files"]
        assert {name for name in files if "rank" in name} and len(files) > 1, files  # written by every rank
        wait_for_steps(jsonl, saved + 3, proc)  # training went on
        assert proc.poll() is None
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        token = 'token="2030-01-01T00:00:00Z"'
        assert f"{contract.METRIC_REQUEST_STEP}{{{token}}} {float(saved)}" in exposition, exposition
        assert f"{contract.METRIC_REQUEST_TIME}{{{token}}}" in exposition
        assert text.count("checkpoint-now") == 1, "the same token asks once"

        proc.send_signal(signal.SIGTERM)  # what a suspend does: the kubelet's SIGTERM to the pod
        assert proc.wait(timeout=120) == contract.EXIT_PREEMPTED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    stopped = int(text.split("[tetrad rank 0] stopped after step ")[1].split()[0])
    assert (f"stopped after step {stopped} on SIGTERM; checkpoint step {stopped} committed"
            in text), text[-3000:]
    assert logged_steps(jsonl)[-1] >= stopped - 1  # the stopping step itself is saved, not logged
    left = json.loads(termination.read_text())
    assert left[contract.TERMINATION_CHECKPOINT_STEP] == stopped
    assert abs(left[contract.TERMINATION_CHECKPOINT_TIME] - time.time()) < 120
    # ... with its last figures, which the operator reads as it reads a scrape
    training, saved = scrape.parse_each(left[contract.TERMINATION_FIGURES], contract.SCRAPED,
                                        contract.SCRAPED_CHECKPOINT)
    assert training["step"] == logged_steps(jsonl)[-1] and saved["step"] == stopped

    request.write_text("")
    proc, jsonl, log = node("resumed", "--steps", str(stopped + 2))
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"resumed step {stopped} from" in log.read_text()
    assert logged_steps(jsonl) == [stopped + 1, stopped + 2]
    # A finished run leaves its last step's figures, the final save's among them.
    finished = json.loads(termination.read_text())
    assert contract.TERMINATION_CHECKPOINT_STEP not in finished and len(termination.read_bytes()) <= 4096
    training, saved = scrape.parse_each(finished[contract.TERMINATION_FIGURES], contract.SCRAPED,
                                        contract.SCRAPED_CHECKPOINT)
    last = json.loads(jsonl.read_text().splitlines()[-1])
    assert training["step"] == stopped + 2 and training["loss"] == last["loss"]
    assert saved["step"] == stopped + 2 and saved["resumedFrom"] == stopped
