"""`tetrad run` before anything starts, and its bookkeeping, without starting a node: the work directory
is Tetrad's or refused, two runs never share one, --jsonl appends and never destroys, I/O errors are one
line, the exit codes are documented, and where training starts is said. The runs themselves:
tests/trainer/test_launch.py."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.api.helpers import manifest
from tetrad.api import parse
from tetrad.api.contract import METRIC_RESUMED_FROM
from tetrad.api.termination import TerminationMessage
from tetrad.cli import app
from tetrad.launch.local import (
    EXIT_DEADLINE,
    EXIT_REFUSED,
    Records,
    ResumedFrom,
    describe_exit,
    host_memory_shortfall,
    where_it_started,
)
from tetrad.launch.workdir import LOCK, MARKER, DirectoryLock, Refused, claim_workdir
from tetrad.resolve import resolve

ROOT = Path(__file__).parents[2]


def cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["run", *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), f"uncaught {r.exception!r}\n{r.output}"
    return r.exit_code, r.output


def job_file(tmp_path: Path, name: str = "job.yaml", **spec: Any) -> Path:
    """A small CPU job (nothing here starts it)."""
    doc = manifest(**{"nodes": 1, "nprocPerNode": 1, "parallelism": {"pp": 1, "tp": 1, "dpShard": 1}, **spec})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def nothing_started(work: Path) -> bool:
    return not list(work.glob("node-*.log"))


def test_a_foreign_directory_is_not_a_work_directory(tmp_path):
    """A Hugging Face directory given as --workdir keeps its config.json."""
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    code, out = cli(str(job_file(tmp_path)), "--workdir", str(hf))
    assert code == EXIT_REFUSED and out.count("\n") == 1
    assert (out.startswith(f"error: --workdir {hf}: holds files that are not a tetrad run's")
            and "new or empty" in out)
    assert ((hf / "config.json").read_text() == '{"model_type": "llama"}'
            and sorted(p.name for p in hf.iterdir()) == ["config.json"])


def test_a_work_directory_is_marked_and_taken_again(tmp_path):
    new, empty, earlier = tmp_path / "new", tmp_path / "empty", tmp_path / "earlier"
    assert claim_workdir(new, "j") == new and (new / MARKER).is_file()
    empty.mkdir()
    assert claim_workdir(empty, "j") == empty and (empty / MARKER).is_file()
    (new / "node-0.log").write_text("an earlier run's log")
    assert claim_workdir(new, "j") == new, "a directory an earlier run made is taken again"
    temporary = claim_workdir(None, "j")
    assert temporary.name.startswith("tetrad-j-") and (temporary / MARKER).is_file()
    temporary.joinpath(MARKER).unlink()
    temporary.rmdir()
    earlier.mkdir()
    (earlier / "notes.txt").write_text("mine")
    with pytest.raises(Refused, match="holds files that are not a tetrad run's"):
        claim_workdir(earlier, "j")
    assert sorted(p.name for p in earlier.iterdir()) == ["notes.txt"]


def test_a_suspended_job_is_refused_as_a_cluster_would_hold_it(tmp_path):
    code, out = cli(str(job_file(tmp_path, runPolicy={"suspend": True})), "--workdir", str(tmp_path / "w"))
    assert code == EXIT_REFUSED
    assert out == ("error: spec.runPolicy.suspend: true keeps the job from running (in a cluster its pods "
                   "are not created); set suspend: false to run it here\n")
    assert not (tmp_path / "w").exists()


def test_a_cpu_job_that_cannot_fit_this_machines_memory_is_refused(tmp_path):
    """llama3-8b on one CPU process: about 16 bytes a parameter before activations, far above any laptop."""
    job = job_file(tmp_path, model={"preset": "llama3-8b", "seqLen": 256})
    code, out = cli(str(job), "--workdir", str(tmp_path / "w"))
    assert code == EXIT_REFUSED and out.count("\n") == 1, out
    assert (out.startswith("error: spec.resources.memory: the job keeps") and "(1 process x" in out
            and "OOM killer" in out), out
    assert nothing_started(tmp_path / "w")
    job, _ = parse(yaml.safe_load(job.read_text()))
    cfg = resolve(job)
    need = cfg.predicted_peak_bytes
    assert need is not None and need > 16 * 8e9
    assert host_memory_shortfall(cfg, int(need) + 1) is None  # it fits a machine just big enough
    assert host_memory_shortfall(cfg, None) is None  # a machine that cannot tell is not refused


def test_refusals_share_one_format_and_exit_code(tmp_path, monkeypatch):
    """The GPU refusal is `error: ...` and exit 1, as an invalid spec is."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, out = cli(str(job_file(tmp_path, resources={"gpu": 1})), "--workdir", str(tmp_path / "w"))
    assert code == EXIT_REFUSED and out.startswith(
        "error: spec.resources.gpu: the job needs 1 GPUs here (1 node x 1)")
    code, out = cli(str(job_file(tmp_path, nodes=3)))
    assert code == EXIT_REFUSED and out.startswith("error: ")


@pytest.mark.parametrize("case", ["manifest", "yaml", "binary", "directory", "inside the work directory"])
def test_jsonl_never_destroys_a_file(tmp_path, case):
    job, work = job_file(tmp_path), tmp_path / "work"
    target = {"manifest": job, "yaml": tmp_path / "notes.yaml", "binary": tmp_path / "data.bin",
              "directory": tmp_path, "inside the work directory": work / "config.json"}[case]
    if case == "yaml":
        target.write_text("a: 1\n")
    elif case == "binary":
        target.write_bytes(b"\x00\x01\x02")
    before = target.read_bytes() if target.is_file() else None
    code, out = cli(str(job), "--jsonl", str(target), "--workdir", str(work))
    assert code == EXIT_REFUSED and out.startswith(f"error: --jsonl {target}: ") and out.count("\n") == 1, out
    if before is not None:
        assert target.read_bytes() == before
    assert not work.exists(), "refused before the work directory is made"


def test_jsonl_appends_to_a_json_lines_file(tmp_path):
    earlier = tmp_path / "metrics.jsonl"
    earlier.write_text('{"step": 1, "loss": 2.0}\n')
    records = Records(tmp_path / "run.jsonl", copy=earlier.open("ab"))
    (tmp_path / "run.jsonl").write_text(
        '{"step": 1, "loss": 1.5}\nnot json\n{"step": 2, "loss": 1.25}\n{"step": 3')
    assert [r["step"] for r in records.poll()] == [1, 2], "a broken line is skipped, a partial one waits"
    assert earlier.read_text().splitlines() == ['{"step": 1, "loss": 2.0}', '{"step": 1, "loss": 1.5}',
                                                "not json", '{"step": 2, "loss": 1.25}']


def test_a_jsonl_copy_that_fails_mid_run_is_a_warning_not_a_traceback(tmp_path):
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    # closed by the run
    records = Records(tmp_path / "run.jsonl", copy=open("/dev/full", "ab"))  # noqa: SIM115
    (tmp_path / "run.jsonl").write_text('{"step": 1}\n')
    assert [r["step"] for r in records.poll()] == [1]
    assert records.copy_failed == "No space left on device"


def test_a_work_directory_in_use_is_refused_naming_the_runs_pid(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / MARKER).write_text("")
    (work / "node-0.log").write_text("the first run's log\n")
    held = DirectoryLock(work, "held")
    held.acquire()
    try:
        code, out = cli(str(job_file(tmp_path)), "--workdir", str(work))
        assert code == EXIT_REFUSED
        assert out == (f"error: --workdir {work} is in use by another tetrad run (PID {os.getpid()}); wait "
                       "for it to end, stop it, or choose another\n")
        assert (work / "node-0.log").read_text() == "the first run's log\n", (
            "nothing of the first run is touched")
    finally:
        held.release()


def test_a_checkpoint_path_in_use_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    held = DirectoryLock(ckpt, "held")
    held.acquire()
    try:
        job = job_file(tmp_path, checkpoint={"enabled": True, "path": str(ckpt)})
        code, out = cli(str(job), "--workdir", str(tmp_path / "work"))
        assert (code == EXIT_REFUSED
                and f"error: spec.checkpoint.path {ckpt} is in use by another tetrad run" in out)
        assert nothing_started(tmp_path / "work")
    finally:
        held.release()


def test_a_lock_dies_with_the_processes_that_hold_it(tmp_path):
    """flock: a holder killed with SIGKILL leaves nothing stuck."""
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR"
                               " | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True);"
                               " time.sleep(600)",
                               str(tmp_path / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(Refused, match="is in use by another tetrad run"):
            DirectoryLock(tmp_path, "dir").acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = DirectoryLock(tmp_path, "dir")
    lock.acquire()
    lock.release()


def test_an_io_error_writing_the_work_directory_is_one_line(tmp_path):
    """A file-size limit makes the launcher's write fail (EFBIG) as a full disk would (ENOSPC)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

    r = subprocess.run([sys.executable, "-m", "tetrad.cli", "run", str(job_file(tmp_path)), "--workdir",
                        str(tmp_path / "work")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       preexec_fn=limit, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == EXIT_REFUSED and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"error: the work directory {tmp_path / 'work'}: cannot write tetrad-node.pyz: File "
                        "too large; free some space or give another --workdir\n")


def test_run_help_documents_every_exit_code():
    r = CliRunner().invoke(app, ["run", "--help"], terminal_width=200)
    text = " ".join(r.output.split())
    for words in ("Exit codes: 0 trained", "1 refused before anything started", "2 a bad command line",
                  "69, 75, 77, 78, 79 or a script's own code",
                  f"{EXIT_DEADLINE} runPolicy.activeDeadlineSeconds", "128+N stopped by signal N"):
        assert words in text, words


# -- where training starts ------------------------------------------------------------------------

def config(**spec: Any) -> Any:
    job, problems = parse(manifest(nodes=1, nprocPerNode=1, parallelism={"pp": 1, "tp": 1, "dpShard": 1},
                                   training={"globalBatch": 8, "steps": 20}, **spec))
    assert job is not None, problems
    return resolve(job)


def test_where_training_starts_is_said():
    off, on = config(), config(checkpoint={"enabled": True, "path": "/ckpt"})
    assert where_it_started(off, None) == "step 0 (checkpointing is off)"
    assert where_it_started(on, None) is None, "known once rank 0 says it"
    assert where_it_started(on, 0) == "step 0 (no checkpoint in /ckpt yet)"
    assert where_it_started(on, 12) == "resumed from step 12 (the checkpoint in /ckpt)"
    assert where_it_started(on, 20) == (
        "nothing to do: the checkpoint in /ckpt is at step 20, at or past the 20 steps to train; raise"
        " --steps (or training.steps) to train on")
    assert where_it_started(config(checkpoint={"enabled": True, "resume": False}), None) == \
        "step 0 (checkpoint.resume is false)"


def test_rank_0_says_where_it_started_in_its_termination_message(tmp_path):
    path = tmp_path / "node-0.termination"
    path.write_text(TerminationMessage(figures=f"tetrad_step 0.0\n{METRIC_RESUMED_FROM} 40.0\n").encode())
    assert ResumedFrom(port=None).read_termination(path) == 40
    path.write_text(TerminationMessage(figures=f"{METRIC_RESUMED_FROM} NaN\n").encode())
    assert ResumedFrom(port=None).read_termination(path) is None, "NaN: not decided yet"
    assert ResumedFrom(port=None).read_termination(tmp_path / "missing") is None


def test_rank_0_says_where_it_started_on_its_metrics_endpoint():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            body = f"# TYPE {METRIC_RESUMED_FROM} gauge\n{METRIC_RESUMED_FROM} 7.0\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        resumed = ResumedFrom(port=server.server_address[1])
        assert resumed.poll() == 7 and resumed.step == 7
        assert resumed.poll() is None, "said once"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("code", "said"), [(0, "0 (finished)"),
                                            (75, "75 (stopped on SIGTERM, after saving if"
                                                 " checkpointing is on)"), (-15, "-15 (killed by SIGTERM)"),
                                            (-9, "-9 (killed by SIGKILL)"), (3, "3")])
def test_a_nodes_exit_is_said_in_words(code, said):
    assert describe_exit(code) == said


def test_the_summary_counts_nodes_and_readable_parameters():
    from rich.console import Console

    from tetrad.launch.local import _summary

    console = Console(record=True, width=200)
    records = Records(Path("/nonexistent/metrics.jsonl"))
    console.print(_summary(config(), [], 1.0, records, Path("/w"), "step 0 (checkpointing is off)", None,
                           []))
    text = console.export_text()
    assert "(1 node x 1 process)" in text and "debug, 4.2M parameters" in text
    assert "│ start     │ step 0 (checkpointing is off)" in text


NODE_WITH_CAUSE = """[script] rank 1 of 2
Traceback (most recent call last):
  File "/app/train.py", line 7, in <module>
    raise ValueError("spec.data.path: /data/x.txt is not UTF-8 at byte 7")
ValueError: spec.data.path: /data/x.txt is not UTF-8 at byte 7
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : 1 (pid: 15939)
"""
NODE_THAT_LOST_ITS_PEER = """[rank0]: Traceback (most recent call last):
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242
torch.distributed.elastic.multiprocessing.api.SignalException: Process 15845 got signal: 15
  exitcode  : 1 (pid: 15940)
"""  # noqa: E501


def test_the_terminal_shows_the_node_that_states_a_cause_not_its_peers_noise(tmp_path):
    from tetrad.launch.local import Agent, failure_causes, failure_excerpt, origin_of_failure

    innocent, culprit = tmp_path / "node-0.log", tmp_path / "node-1.log"
    innocent.write_text(NODE_THAT_LOST_ITS_PEER)
    culprit.write_text(NODE_WITH_CAUSE)
    assert failure_causes(culprit)[0] == ["ValueError: spec.data.path: /data/x.txt is not UTF-8 at byte 7"]
    assert failure_causes(innocent)[0] == []  # gloo's lost connection, torchrun's wrapping: consequences only
    assert "Connection closed by peer" in failure_excerpt(innocent)  # shown when a log has nothing else
    agents = [Agent(0, None, innocent), Agent(1, None, culprit)]  # type: ignore[arg-type]
    assert origin_of_failure(agents[0], agents) is agents[1]  # node 0 exited first, node 1 says why
    assert origin_of_failure(agents[1], agents) is agents[1]
