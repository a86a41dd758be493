"""Scripts of one's own under the launcher, with real processes (`tetrad run`: the pods' launcher zip,
torchrun, gloo): a plain DDP script (level 1), the runtime library and the Hugging Face callback
(level 2), and scripts that misbehave: each gets its exit code, its cause in the termination message,
and nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.harness import free_port, free_port_block
from tests.trainer.test_launch import LocalRun, wait_until_gone
from tetrad.api import ParallelTrainingJob, parse
from tetrad.api.contract import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_REQUEST_FILE,
    ENV_CONTRACT,
    ENV_EXIT_DIR,
    ENV_JSONL,
    ENV_METRICS_PORT,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    METRIC_CHECKPOINT_STEP,
    METRIC_REQUEST_STEP,
    REASON_CONTRACT,
    REASON_ENTRY_POINT,
    REASON_OUT_OF_MEMORY,
)
from tetrad.api.termination import TerminationMessage
from tetrad.launch import run_local

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples" / "bring-your-own"
MISBEHAVE = Path(__file__).parent / "scripts" / "misbehave.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def script_job(name: str, script: dict[str, Any], **spec: Any) -> ParallelTrainingJob:
    # maxRestarts 0: these tests watch one run end; a failing script would restart in place otherwise
    spec["runPolicy"] = {"maxRestarts": 0, **spec.get("runPolicy", {})}
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
           "spec": {"nodes": 2, "nprocPerNode": 1, "script": script, "preflight": {"allReduceMiB": 1},
                    "metrics": {"port": free_port_block(2)}, **spec}}
    job, problems = parse(doc)
    assert job is not None, problems
    return job


def logs(work: Path) -> str:
    return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(work.glob("node-*.log")))


def rows(work: Path) -> list[dict[str, Any]]:
    """Rank 0's JSON lines."""
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


def preempt(run: LocalRun) -> None:
    """SIGTERM to `tetrad run`, as a pod's deletion: every node saves and exits 75, nothing is left."""
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=90) == 128 + signal.SIGTERM, run.text()
    assert (f"stopped: every node exited {EXIT_PREEMPTED} (stopped on SIGTERM"
            in run.output.read_text()), run.text()
    wait_until_gone(run.work, 5)


def said(path: Path) -> TerminationMessage:
    return TerminationMessage.parse(path.read_text() if path.exists() else None)


def test_a_plain_ddp_script_trains_saves_and_resumes_under_the_launcher(tmp_path: Path) -> None:
    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    job = script_job("ddp", {"path": str(EXAMPLES / "script" / "train.py"),
                             "args": ["--steps", "4", "--save-every", "2"]},
                     checkpoint={"path": str(ckpt)})
    assert run_local(job, workdir=work) == 0, logs(work)
    text = logs(work)
    assert "[train] step 4 loss" in text and '{"preflight": {"passed": true, "world_size": 2' in text, text
    assert (ckpt / "ddp.pt").exists(), "the script saves where spec.checkpoint mounts: $TETRAD_CHECKPOINT_DIR"
    job = script_job("ddp", {"path": str(EXAMPLES / "script" / "train.py"), "args": ["--steps", "6"]},
                     checkpoint={"path": str(ckpt)})
    assert run_local(job, workdir=tmp_path / "again") == 0
    again = logs(tmp_path / "again")
    assert ("rank 0: resumed from step 4" in again and "[train] step 5 loss" in again
            and "step 1 loss" not in again)


def test_each_node_exits_with_its_own_workers_code_and_sees_the_mesh(tmp_path: Path) -> None:
    work = tmp_path / "work"
    job = script_job("codes", {"path": str(MISBEHAVE), "args": ["--exit", "1:3"]},
                     parallelism={"dpShard": "auto"})
    assert run_local(job, workdir=work) == 3, logs(work)
    text = logs(work)
    assert "[script] rank 0 of 2, mesh pp=1,dp_replicate=1,dp_shard=2,cp=1,tp=1" in text, text
    assert "the workers reported [3]: exiting 3" in (work / "node-1.log").read_text()


@pytest.mark.parametrize(("entry", "message"), [
    ({"path": "/no/such/train.py"}, "spec.script.path: /no/such/train.py is not a file in the image"),
    ({"module": "no_such_package.train"},
     "spec.script.module: no module no_such_package.train in the image's Python"),
    ({"command": ["no-such-command", "--flag"]}, "spec.script.command: no-such-command is not in the image"),
], ids=["path", "module", "command"])
def test_an_entry_point_not_in_the_image_is_a_config_error_naming_the_field(
        tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    work = tmp_path / "work"
    assert run_local(script_job("missing", entry), workdir=work) == EXIT_CONFIG_ERROR, logs(work)
    # `tetrad run` gives each node its own; the first node to fail stops the other, which may not have
    # reached its entry point yet (so it has no cause to name)
    causes = [m for m in map(said, sorted(work.glob("node-*.termination"))) if m.reason is not None]
    assert causes and all(m.reason == REASON_ENTRY_POINT and m.message is not None
                          and m.message.startswith(message) for m in causes), causes
    assert '"preflight"' not in logs(work), "nothing else runs: the gang check comes after the entry point's"


def test_an_out_of_memory_error_of_a_script_exits_77_with_its_message(tmp_path: Path) -> None:
    work = tmp_path / "work"
    termination = work / "node-0.termination"  # `tetrad run` gives each node its own
    job = script_job("oom", {"path": str(MISBEHAVE), "args": ["--oom-on-rank", "0"]})
    assert run_local(job, workdir=work) == EXIT_OOM, logs(work)
    left = said(termination)
    assert (left.reason == REASON_OUT_OF_MEMORY
            and "Tried to allocate 20.00 GiB (a test's)" in (left.message or ""))


def test_a_collective_of_a_script_that_times_out_exits_79_naming_the_peer(tmp_path: Path) -> None:
    work = tmp_path / "work"
    termination = work / "node-0.termination"  # `tetrad run` gives each node its own
    job = script_job("hang", {"path": str(MISBEHAVE), "args": ["--hang-rank", "1"]},
                     runPolicy={"collectiveTimeoutSeconds": 10})
    assert run_local(job, workdir=work) == EXIT_COLLECTIVE_TIMEOUT, logs(work)
    summary = said(termination).collective_timeout or ""
    assert (summary.startswith("rank 0: gloo:all_reduce")
            and summary.endswith("timed out after 10s; not answering: rank 1")), summary


def test_a_command_entry_point_runs_as_the_workers_child_and_passes_its_code_on(tmp_path: Path) -> None:
    work = tmp_path / "work"
    job = script_job("command", {"command": [sys.executable, str(MISBEHAVE)], "args": ["--exit", "0:4"]})
    assert run_local(job, workdir=work) == 4, logs(work)
    assert "[script] rank 1 of 2" in logs(work)


def test_a_script_that_ignores_sigterm_is_killed_at_the_end_of_the_grace_period(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = tmp_path / "started"
    started.mkdir()
    monkeypatch.setenv("SCRIPT_STARTED_DIR", str(started))
    job = script_job("deaf", {"path": str(MISBEHAVE), "args": ["--ignore-sigterm"]},
                     runPolicy={"terminationGracePeriodSeconds": 15})
    run = LocalRun(tmp_path, "deaf", grace=15, job=job)
    try:
        run.wait_for_markers(started, 2)
        start = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=90) == 128 + signal.SIGTERM, run.text()
        assert 4 < time.monotonic() - start < 45, ("torchrun's shutdown timeout (grace - 10 s) ends the deaf "
                                                   "workers")
        wait_until_gone(run.work, 5)
    finally:
        run.cleanup()


def test_the_runtime_library_saves_on_sigterm_exits_75_and_the_script_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    train = str(EXAMPLES / "runtime" / "train.py")
    job = script_job("runtime", {"path": train, "args": ["--steps", "100000", "--step-seconds", "0.2"]},
                     checkpoint={"path": str(ckpt)}, runPolicy={"terminationGracePeriodSeconds": 60})
    run = LocalRun(tmp_path, "runtime", grace=60, job=job)
    try:
        run.wait_for_first_step()
        first = rows(run.work)[0]
        assert first["loss"] > 0 and first["step"] == 1 and first["mfu"] is None, first  # MFU: from step 2
        preempt(run)
    finally:
        run.cleanup()
    saved = int(logs(run.work).rsplit("[train] saved step ", 1)[1].split()[0])
    last = rows(run.work)[-1]
    assert last["step"] == saved and last["tokens_per_second"] > 0 and last["mfu"] > 0, last
    work = tmp_path / "again"
    again = script_job("runtime", {"path": train, "args": ["--steps", str(saved + 2)]},
                       checkpoint={"path": str(ckpt)})
    assert run_local(again, workdir=work) == 0, logs(work)
    assert f"[train] resumed from step {saved}" in logs(work)
    assert [r["step"] for r in rows(work)] == [saved + 1, saved + 2]


def test_the_runtime_library_refuses_a_pod_of_a_contract_it_does_not_speak(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tetrad.node", "worker", "--path", str(EXAMPLES / "runtime" / "train.py"),
         "--", "--steps", "1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port()), ENV_CONTRACT: "99", ENV_EXIT_DIR: str(tmp_path)})
    assert r.returncode == EXIT_CONFIG_ERROR, r.stderr
    left = said(tmp_path / "message-rank-0.json")
    assert (left.reason == REASON_CONTRACT
            and "rendered for Tetrad's contract 99" in (left.message or "")), left
    assert "install the tetrad version of the operator in the image (spec.image)" in (left.message or "")


def test_a_hugging_face_trainer_script_reports_and_saves_on_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = script_job("hf", {"path": str(EXAMPLES / "hf-trainer" / "train.py"),
                            "args": ["--max-steps", "100000", "--output-dir", str(out)]},
                     runPolicy={"terminationGracePeriodSeconds": 60})
    run = LocalRun(tmp_path, "hf", grace=60, job=job)
    try:
        run.wait_for_first_step()
        deadline = time.monotonic() + 120
        while len(rows(run.work)) < 3:
            assert run.proc.poll() is None and time.monotonic() < deadline, run.text()
            time.sleep(0.5)
        preempt(run)
    finally:
        run.cleanup()
    last = rows(run.work)[-1]
    assert last["loss"] > 0 and last["tokens_per_second"] > 0 and last["mfu"] > 0, last
    saved = sorted(int(p.name.removeprefix("checkpoint-")) for p in out.glob("checkpoint-*"))
    assert saved and saved[-1] == last["step"], (saved, last)  # saved at the step it stopped after


def test_a_checkpoint_now_request_makes_a_runtime_library_script_save_and_go_on(tmp_path: Path) -> None:
    """The request file as a pod's downward-API projection writes it; supervised torchrun, two gloo ranks."""
    request, ckpt, jsonl, log, port = (tmp_path / "checkpoint-now", tmp_path / "ckpt",
                                       tmp_path / "steps.jsonl", tmp_path / "node.log", free_port())
    request.write_text("")
    command = [sys.executable, "-m", "tetrad.node", "supervise", "--", sys.executable, "-m",
               "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tetrad.node", "worker",
               "--path", str(EXAMPLES / "runtime" / "train.py"), "--", "--steps", "100000",
               "--step-seconds", "0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", ENV_CHECKPOINT_REQUEST_FILE: str(request),
           ENV_CHECKPOINT_DIR: str(ckpt), ENV_JSONL: str(jsonl), ENV_METRICS_PORT: str(port)}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        def steps() -> int:
            assert proc.poll() is None, log.read_text()[-3000:]
            return len(jsonl.read_text().splitlines()) if jsonl.exists() else 0

        deadline = time.monotonic() + 240
        while steps() < 3:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        request.write_text("2030-01-01T00:00:00Z\n")  # what the kubelet writes when the annotation appears
        while "[train] saved step" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        saved = int(log.read_text().split("[train] saved step ", 1)[1].split()[0])
        while steps() < saved + 3:  # training goes on
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert (f'{METRIC_REQUEST_STEP}{{token="2030-01-01T00:00:00Z"}} {float(saved)}'
                in exposition), exposition
        assert f"{METRIC_CHECKPOINT_STEP} {float(saved)}" in exposition
        assert log.read_text().count("[train] saved step") == 1, "the same token asks once"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_runtime_library_imports_none_of_the_trainers_weight() -> None:
    code = ("import sys, tetrad_trainer.runtime; heavy = {'tetrad_trainer.train', "
            "'tetrad_trainer.parallelize', 'tokenizers', 'safetensors', 'kopf', 'kubernetes', "
            "'pydantic_settings'}; print(sorted(heavy & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
