"""`tetrad run` end to end: real torchrun agents with the pods' environment, on this machine."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.harness import free_port_block
from tetrad.api import ParallelTrainingJob, parse
from tetrad.api.contract import EXIT_CONFIG_ERROR
from tetrad.launch import run_local
from tetrad.launch.local import local_command

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

JSON_KEYS = {"step", "loss", "tokens_per_second", "mfu", "tflops", "peak_memory_bytes", "step_time_s"}


def make_job(name: str, **spec: object) -> ParallelTrainingJob:
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
           "spec": {"nodes": 2, "nprocPerNode": 1, "parallelism": {"dpShard": 2},
                    "model": {"preset": "debug", "seqLen": 64}, "training": {"steps": 50, "globalBatch": 4},
                    "metrics": {"port": free_port_block(2)}, **spec}}
    job, problems = parse(doc)
    assert job is not None, problems
    return job


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(f"{cmdline.parent.name}: {args}")
    return found


def test_local_command_is_the_pods_command() -> None:
    assert local_command(Path("/w/config.json")) == [sys.executable, "-m", "tetrad_trainer.preemption",
                                                     sys.executable, "-m", "torch.distributed.run", "-m",
                                                     "tetrad_trainer.train", "--config", "/w/config.json"]


def test_run_trains_on_two_local_nodes_and_writes_json_lines(tmp_path: Path) -> None:
    jsonl = tmp_path / "out" / "metrics.jsonl"
    code = run_local(make_job("smoke"), steps=3, jsonl=jsonl, workdir=tmp_path / "work")
    assert code == 0, (tmp_path / "work" / "node-0.log").read_text()[-3000:]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r.keys() >= JSON_KEYS for r in rows)
    config = json.loads((tmp_path / "work" / "config.json").read_text())
    assert config["training"]["steps"] == 3  # --steps is written into the resolved config
    assert not processes_mentioning(str(tmp_path / "work"))


def test_a_failing_rank_fails_the_run_and_leaves_no_process(tmp_path: Path) -> None:
    # Token ids beyond the vocab only in the samples of data-parallel rank 1: that rank fails at step 1
    # while rank 0 waits for it in a collective; the launcher must stop node 0 too.
    tokens = np.zeros(64 * 8 + 1, dtype=np.uint16)
    tokens[64 * 3 + 10] = 4000
    tokens.tofile(tmp_path / "tokens.bin")
    job = make_job("broken", data={"source": "tokens", "path": str(tmp_path / "tokens.bin")})
    start = time.monotonic()
    code = run_local(job, steps=None, jsonl=None, workdir=tmp_path / "work")
    assert code == EXIT_CONFIG_ERROR  # the rank's own code, through the node's exit-code supervisor
    assert "token id 4000, outside the model's vocab of 2048" in (tmp_path / "work" / "node-1.log").read_text()
    assert not processes_mentioning(str(tmp_path / "work"))
    assert time.monotonic() - start < 240


def test_an_invalid_job_is_a_config_error_before_anything_starts(tmp_path: Path) -> None:
    job = make_job("invalid", parallelism={"tp": 3})
    assert run_local(job, steps=None, jsonl=None, workdir=tmp_path / "work") == EXIT_CONFIG_ERROR
    assert not (tmp_path / "work").exists()


def test_ctrl_c_stops_every_agent_and_worker(tmp_path: Path) -> None:
    import signal
    import subprocess

    job = make_job("interrupted", training={"steps": 100000, "globalBatch": 4})
    (tmp_path / "job.json").write_text(job.model_dump_json(by_alias=True))
    script = ("import sys; from pathlib import Path; from tetrad.api import ParallelTrainingJob; "
              "from tetrad.launch import run_local; "
              "job = ParallelTrainingJob.model_validate_json(Path(sys.argv[1]).read_text()); "
              "sys.exit(run_local(job, steps=None, jsonl=None, workdir=Path(sys.argv[2])))")
    work = tmp_path / "work"
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "job.json"), str(work)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    jsonl, deadline = work / "metrics.jsonl", time.monotonic() + 180
    while not (jsonl.exists() and jsonl.read_text()):  # wait for the first step
        assert launcher.poll() is None, launcher.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "no step within 180 s"
        time.sleep(0.5)
    assert len(processes_mentioning(str(work))) >= 4  # 2 agents and their 2 workers are training
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) == 130
    assert not processes_mentioning(str(work))
