"""`tetrad run` end to end: real torchrun agents with the pods' environment, on this machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tetrad_trainer.train import write_whole_lines

from tests.processes import processes_mentioning
from tests.trainer.harness import free_port_block
from tetrad.api import ParallelTrainingJob, parse
from tetrad.api.contract import ENV_TEST_FAULT, ENV_TEST_FAULTS_ALLOWED, EXIT_CONFIG_ERROR
from tetrad.launch import run_local
from tetrad.launch.local import (
    EXIT_DEADLINE,
    EXIT_REFUSED,
    kill_rank_at,
    local_command,
    logged_steps,
)
from tetrad.launch.workdir import DirectoryLock, Refused
from tetrad.render import render
from tetrad.render.objects import CONFIG_PATH, LAUNCHER_PATH
from tetrad.resolve import resolve

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

JSON_KEYS = {"step", "loss", "tokens_per_second", "mfu", "tflops", "peak_memory_bytes", "step_time_s"}


def make_job(name: str, **spec: object) -> ParallelTrainingJob:
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
           "spec": {"nodes": 2, "nprocPerNode": 1, "parallelism": {"dpShard": 2},
                    "model": {"preset": "debug", "seqLen": 64},
                    # fp32: a CPU without native bf16 matmuls runs the debug model's bf16 steps ~10x slower
                    "training": {"steps": 50, "globalBatch": 4, "precision": "fp32"},
                    "metrics": {"port": free_port_block(2)}, **spec}}
    job, problems = parse(doc)
    assert job is not None, problems
    return job


def test_a_free_port_is_below_the_ephemeral_range_where_no_outgoing_connection_takes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tetrad.launch import local

    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(local, "EPHEMERAL_PORTS", ranges)
    ranges.write_text("40000\t60999\n")
    ports = {local.free_port() for _ in range(50)}
    assert all(20000 <= p < 40000 for p in ports) and len(ports) > 40, sorted(ports)
    with socket.socket() as taken:  # a port in use is not given
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert local.free_port() != taken.getsockname()[1]
    ranges.write_text("1500 60999\n")  # no room below: any free port, as the kernel picks
    assert local.free_port() >= 1500
    ranges.unlink()  # not Linux: the default range
    assert 16384 <= local.free_port() < 32768


def test_local_command_is_the_pods_command() -> None:
    cfg = resolve(make_job("cmd"))
    pod = render(make_job("cmd")).pods[0]["spec"]["containers"][0]["command"]
    here = [sys.executable, "/w/tetrad-node.pyz", "/w/config.json"]
    assert local_command(cfg, Path("/w")) == [{"python3": here[0], LAUNCHER_PATH: here[1],
                                               CONFIG_PATH: here[2]}.get(a, a)
                                              for a in pod]


class Writes(io.RawIOBase):
    """A file that records each write it gets (each one a write(2) on the node's shared log)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        data = bytes(b)
        self.writes.append(data)
        return len(data)


def test_a_worker_writes_each_line_in_one_write_so_ranks_sharing_a_log_do_not_split_each_others_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What PYTHONUNBUFFERED gives a worker: write-through text over the raw file.
    out, err = Writes(), Writes()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, write_through=True))  # type: ignore[type-var]
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, write_through=True))  # type: ignore[type-var]
    write_whole_lines()
    print(json.dumps({"event": "collective_timeout", "rank": 2}), flush=True)
    print("[tetrad rank 3]", "a warning", file=sys.stderr)
    print(json.dumps({"step": 1}))
    assert out.writes == [b'{"event": "collective_timeout", "rank": 2}\n', b'{"step": 1}\n']
    assert err.writes == [b"[tetrad rank 3] a warning\n"]


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
    # torchrun's log tree is in the work directory, nothing of the run is left in the temp directory
    assert (tmp_path / "work" / "torchelastic" / "node-0").is_dir()
    assert not list(Path(tempfile.gettempdir()).glob("torchelastic_*/smoke-*"))
    assert rows[0]["startup_s"] > 0 and all(r["startup_s"] == rows[0]["startup_s"] for r in rows)
    # the account for the goodput: training from the end of step 1 on, no checkpoint saved
    trained = [r["train_s"] for r in rows]
    assert trained == sorted(trained) and trained[-1] > 0
    assert max(r["checkpoint_stall_s"] for r in rows) < 0.01
    # the flight recorder is sized through the variable this torch reads, without its warning
    for node in (0, 1):
        assert "is deprecated" not in (tmp_path / "work" / f"node-{node}.log").read_text()


def test_logged_steps_are_the_step_records_written_so_far_and_a_kill_waits_for_its_step(
        tmp_path: Path) -> None:
    jsonl = tmp_path / "out.jsonl"
    assert logged_steps(jsonl) == []
    jsonl.write_text('{"step": 1, "loss": 2.0}\n{"event": "collective_timeout", "rank": 2}\n'
                     '{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # the last line still being written
    assert logged_steps(jsonl) == [1, 2]
    with pytest.raises(TimeoutError, match="did not log step 3 within 0 s"):
        kill_rank_at(tmp_path / "work", jsonl, rank=1, step=3, timeout_s=0.2)


def test_a_failing_rank_fails_the_run_and_leaves_no_process(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 fails at step 1 while rank 0 waits for it in a collective; the launcher must stop node 0 too.
    # (A test fault: a token id beyond the vocab, which once did this, now stops every rank at start-up.)
    monkeypatch.setenv(ENV_TEST_FAULT, "fail-rank:1:step:1")
    monkeypatch.setenv(ENV_TEST_FAULTS_ALLOWED, "1")
    job = make_job("broken")
    start = time.monotonic()
    code = run_local(job, steps=None, jsonl=None, workdir=tmp_path / "work")
    assert code == EXIT_CONFIG_ERROR  # the rank's own code, through the node's exit-code supervisor
    assert (f"{ENV_TEST_FAULT}: failing at the start of step 1"
            in (tmp_path / "work" / "node-1.log").read_text())
    assert not processes_mentioning(str(tmp_path / "work"))
    assert time.monotonic() - start < 240


def test_an_invalid_job_is_refused_before_anything_starts(tmp_path: Path) -> None:
    job = make_job("invalid", parallelism={"tp": 3})
    assert run_local(job, steps=None, jsonl=None, workdir=tmp_path / "work") == EXIT_REFUSED
    assert not (tmp_path / "work").exists()


# -- stopping: every signal, and the parent's death, stop every process of the run ------------------

def run_processes(work: Path) -> dict[int, str]:
    """pid -> command line of every live process of the run in `work` (each names its config or workdir)."""
    found = {}
    for line in processes_mentioning(str(work)):
        pid, _, args = line.partition(": ")
        if _state(int(pid)) not in ("Z", "X", ""):
            found[int(pid)] = args
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def workers(work: Path) -> list[int]:
    return [pid for pid, args in run_processes(work).items()
            if "tetrad-node.pyz worker" in args and "torch.distributed.run" not in args
            and "supervise" not in args]


def frozen(work: Path) -> list[int]:
    """The workers and torchrun agents of the run (the processes a test freezes with SIGSTOP)."""
    return [pid for pid, args in run_processes(work).items()
            if "tetrad-node.pyz worker" in args and "supervise" not in args]


def wait_until_gone(work: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (left := run_processes(work)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running after {timeout} s: {left}"


class LocalRun:
    """`tetrad run JOB --workdir WORK` in a subprocess (optionally under a parent process of its own)."""

    def __init__(self, tmp_path: Path, name: str, *, grace: int, under_parent: bool = False,
                 job: ParallelTrainingJob | None = None):
        job = job or make_job(name, training={"steps": 100000, "globalBatch": 4, "precision": "fp32"},
                              runPolicy={"terminationGracePeriodSeconds": grace})
        self.job_file, self.work = tmp_path / "job.json", tmp_path / "work"
        # as the user wrote it
        self.job_file.write_text(job.model_dump_json(by_alias=True, exclude_unset=True))
        self.output = tmp_path / "tetrad-run.out"
        command = [sys.executable, "-m", "tetrad.cli", "run", str(self.job_file), "--workdir", str(self.work)]
        if under_parent:  # a parent that waits for `tetrad run`, as a shell would
            command = [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])", *command]
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})

    def wait_for_first_step(self) -> None:
        jsonl, deadline = self.work / "metrics.jsonl", time.monotonic() + 240
        while not (jsonl.exists() and jsonl.read_text()):
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, "no step within 240 s"
            time.sleep(0.5)
        assert len(workers(self.work)) == 2, run_processes(self.work)

    def wait_for_markers(self, directory: Path, count: int, timeout: float = 240) -> None:
        """Until `count` files are in `directory` (a script's ranks leave one each once their SIGTERM handler
        is set)."""
        deadline = time.monotonic() + timeout
        while len(list(directory.iterdir())) < count:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()
            time.sleep(0.2)

    def text(self) -> str:
        logs = "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.work.glob("node-*.log")))
        return self.output.read_text()[-3000:] + logs

    def cleanup(self) -> None:
        for pid in run_processes(self.work):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_stops_every_process_of_the_run_gracefully(tmp_path: Path, sig: signal.Signals) -> None:
    # The workers get SIGTERM through the supervisor and torchrun, finish their step and exit 75.
    run = LocalRun(tmp_path, f"stop-{sig.name.lower()}", grace=60)
    try:
        run.wait_for_first_step()
        start = time.monotonic()
        run.proc.send_signal(sig)
        assert run.proc.wait(timeout=90) == 128 + sig, run.text()
        assert time.monotonic() - start < 60, "the stop took the whole grace period"
        wait_until_gone(run.work, 5)
        assert "stopped: every node exited 75 (stopped on SIGTERM" in run.output.read_text(), run.text()
        for node in (0, 1):
            assert "on SIGTERM" in (run.work / f"node-{node}.log").read_text(), run.text()
    finally:
        run.cleanup()


def test_a_second_ctrl_c_kills_the_run_at_once(tmp_path: Path) -> None:
    # Frozen nodes cannot stop gracefully: without the escalation the stop would wait the 300 s grace.
    run = LocalRun(tmp_path, "stop-twice", grace=300)
    try:
        run.wait_for_first_step()
        for pid in frozen(run.work):
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        run.proc.send_signal(signal.SIGINT)
        time.sleep(2)
        assert run.proc.poll() is None, run.text()  # still inside the grace period
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(timeout=30) == 130, run.text()
        wait_until_gone(run.work, 5)
        assert time.monotonic() - start < 30
        out = " ".join(run.output.read_text().split())
        assert "Signal again (Ctrl-C) to kill them at once, losing what is not saved" in out, run.text()
        assert "SIGINT again: killed every node without waiting" in out, run.text()
        assert "SIGKILLed: not every node stopped within the grace" in out, run.text()
    finally:
        run.cleanup()


def test_the_grace_period_ends_in_sigkill_of_every_process(tmp_path: Path) -> None:
    # torchrun's shutdown timeout (grace - 10 s) SIGKILLs frozen workers; a frozen torchrun is left
    # to the launcher's own limit, the grace period.
    run = LocalRun(tmp_path, "stop-grace", grace=15)
    try:
        run.wait_for_first_step()
        for pid in frozen(run.work):
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=60) == 128 + signal.SIGTERM, run.text()
        wait_until_gone(run.work, 5)
        assert 14 < time.monotonic() - start < 45, "the stop did not wait for the grace period"
        assert "SIGKILLed: not every node stopped within the grace" in run.output.read_text(), run.text()
    finally:
        run.cleanup()


def test_the_death_of_the_parent_stops_every_process(tmp_path: Path) -> None:
    run = LocalRun(tmp_path, "orphaned", grace=60, under_parent=True)
    try:
        run.wait_for_first_step()
        launcher = [pid for pid, args in run_processes(run.work).items()
                    if args.split()[1:3] == ["-m", "tetrad.cli"]]
        assert len(launcher) == 1, run_processes(run.work)
        run.proc.kill()  # SIGKILL to the parent of `tetrad run`
        run.proc.wait()
        wait_until_gone(run.work, 60)
        assert "SIGHUP: stopping every node" in run.output.read_text(), run.text()
        assert "stopped: every node exited 75 (stopped on SIGTERM" in run.output.read_text(), run.text()
    finally:
        run.cleanup()


# -- what the terminal says, and the files a run may touch (a script stands in for the trainer) -------

STEPS = Path(__file__).parent / "scripts" / "steps.py"


def steps_job(name: str, *args: str, **spec: object) -> ParallelTrainingJob:
    """Two nodes running tests/trainer/scripts/steps.py: no torch in the workers, no preflight gang check."""
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
           "spec": {"nodes": 2, "nprocPerNode": 1, "script": {"path": str(STEPS), "args": list(args)},
                    "preflight": {"enabled": False}, "metrics": {"port": free_port_block(2)}, **spec}}
    job, problems = parse(doc)
    assert job is not None, problems
    return job


def tetrad_run(job_file: Path, *args: str,
               stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrad.cli", "run", str(job_file), *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})


def write_job(path: Path, job: ParallelTrainingJob) -> Path:
    path.write_text(job.model_dump_json(by_alias=True, exclude_unset=True))
    return path


def test_json_lines_stream_to_stdout(tmp_path: Path) -> None:
    """--jsonl /dev/stdout (a pipe here): a stream, written as the lines come, never seeked or truncated."""
    job = write_job(tmp_path / "job.json", steps_job("stdout", "--steps", "3"))
    r = tetrad_run(job, "--workdir", str(tmp_path / "work"), "--jsonl", "/dev/stdout")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert [json.loads(line)["step"] for line in r.stdout.splitlines()] == [1, 2, 3]
    assert "metrics: rank 0's JSON lines go to /dev/stdout" in r.stderr


def test_a_second_run_on_a_work_directory_in_use_is_refused_and_the_lock_outlives_a_sigkilled_run(
        tmp_path: Path) -> None:
    run = LocalRun(tmp_path, "first", grace=10, job=steps_job("first"))
    try:
        run.wait_for_first_step()
        log, metrics = (run.work / "node-0.log").stat().st_size, (run.work / "metrics.jsonl").read_text()
        second = tetrad_run(write_job(tmp_path / "second.json", steps_job("second", "--steps", "1")),
                            "--workdir", str(run.work))
        assert second.returncode == EXIT_REFUSED, second.stderr
        launcher = run.proc.pid
        assert second.stderr == (f"error: --workdir {run.work} is in use by another tetrad run (PID "
                                 f"{launcher}); wait for it to end, stop it, or choose another\n")
        assert (run.work / "node-0.log").stat().st_size >= log, "the first run's log was not truncated"
        assert (run.work / "metrics.jsonl").read_text().startswith(metrics), "nor its JSON lines"
        run.proc.kill()  # SIGKILL: no chance to release anything; its nodes go on and keep the lock
        run.proc.wait()
        with pytest.raises(Exception, match="in use by another tetrad run"):
            DirectoryLock(run.work, "--workdir").acquire()
    finally:
        run.cleanup()
    wait_until_gone(run.work, 10)
    lock, deadline = DirectoryLock(run.work, "--workdir"), time.monotonic() + 30
    while True:  # every process of the run is gone: so is the lock (once the kernel has closed their files)
        try:
            lock.acquire()
            break
        except Refused:
            assert time.monotonic() < deadline, "the lock outlived every process of the run"
            time.sleep(0.5)
    lock.release()


def test_after_ctrl_c_the_progress_shows_the_last_step_and_the_stop_is_explained(tmp_path: Path) -> None:
    started = tmp_path / "started"
    started.mkdir()
    job = steps_job("late", "--report-at-sigterm", "7", "--started-dir", str(started))
    run = LocalRun(tmp_path, "late", grace=30, job=job)
    try:
        run.wait_for_markers(started, 2)
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(timeout=60) == 130, run.text()
        wait_until_gone(run.work, 5)
    finally:
        run.cleanup()
    out = run.output.read_text()
    bars = [line for line in out.splitlines() if line.startswith("train")]
    # the step rank 0 reported while stopping
    assert bars and "7/?" in bars[-1] and "starting" not in bars[-1], out
    text = " ".join(out.split())
    assert ("SIGINT: stopping every node: SIGTERM now, so each finishes its step, saves if checkpointing is "
            "on" in text)
    assert ("stopped: every node exited 75 (stopped on SIGTERM, after saving if checkpointing is on)"
            in text), out


@pytest.mark.parametrize("deadline", [1, 5], ids=["while-starting", "while-training"])
def test_active_deadline_seconds_stops_the_run_as_the_operator_fails_the_job(tmp_path: Path,
                                                                             deadline: int) -> None:
    """Every node stops on the SIGTERM within the grace, and none restarts in place: a node told to stop
    ends its rounds, also when its workers were still starting (they die without a word)."""
    job = write_job(tmp_path / "job.json",
                    steps_job("deadline", runPolicy={"activeDeadlineSeconds": deadline,
                                                     "terminationGracePeriodSeconds": 30}))
    start = time.monotonic()
    r = tetrad_run(job, "--workdir", str(tmp_path / "work"))
    assert r.returncode == EXIT_DEADLINE, r.stderr
    text = " ".join(r.stderr.split())
    assert f"spec.runPolicy.activeDeadlineSeconds: {deadline} s passed: stopping every node" in text, r.stderr
    # A node exits 75 once its script runs, 143 if its workers were starting, -15 if it was: on a loaded
    # machine one deadline can find the nodes in different places.
    stopped = re.search(r"stopped: (?:every node exited (-?\d+)|node 0 (-?\d+)\b.*, node 1 (-?\d+))", text)
    assert stopped, r.stderr
    assert {int(c) for c in stopped.groups() if c} <= {75, 143, -15}, r.stderr
    assert "SIGKILLed" not in text and "restarting the gang in place" not in text, r.stderr
    assert time.monotonic() - start < 60
    assert not processes_mentioning(str(tmp_path / "work"))


def test_the_terminal_says_where_training_starts_and_when_there_is_nothing_to_do(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job = write_job(tmp_path / "job.json", make_job("resume", checkpoint={"enabled": True, "path": str(ckpt),
                                                                          "interval": 1, "keepLast": 2}))
    work = str(tmp_path / "work")
    first = tetrad_run(job, "--workdir", work, "--steps", "2")
    assert first.returncode == 0, first.stderr
    assert f"start: step 0 (no checkpoint in {ckpt} yet)" in " ".join(first.stderr.split()), first.stderr
    again = tetrad_run(job, "--workdir", work, "--steps", "2")
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stderr.split())
    assert (f"start: nothing to do: the checkpoint in {ckpt} is at step 2, at or past the 2 steps to train"
            in said)
    assert ("│ start " in again.stderr
            and "nothing to do" in again.stderr.split("│ start ")[1].splitlines()[0])
    more = tetrad_run(job, "--workdir", work, "--steps", "3")
    assert more.returncode == 0, more.stderr
    assert (f"start: resumed from step 2 (the checkpoint in {ckpt})"
            in " ".join(more.stderr.split())), more.stderr
    assert [json.loads(line)["step"]
            for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()] == [3]
