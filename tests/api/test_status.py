"""`tetrad status` as a pure function of the job object, the model's name wherever a model is named,
and the example invocations under every command's --help. tests/cluster/test_cli_status.py reads a
job from the real apiserver."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    assert (s["name"], s["namespace"], s["phase"], s["mesh"]) == (
        "t", "ns", "Running", "pp2.dpr1.dps2.cp1.tp2")
    assert (s["model"], s["step"], s["steps"], s["stepSeconds"], s["etaSeconds"]) == (
        "debug (seqLen 128)", 30, 100, 2.0, 140.0)
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


def test_summary_counts_the_restarts_in_place_beside_the_restarts_in_new_pods():
    s = summarize(stored(RUNNING | {"restartsInPlace": 3}), NOW)
    assert s["restartsInPlace"] == 3
    lines = format_summary(s).splitlines()
    after = lines[lines.index("Restarts:     2 (1 of them disruptions, not counted against maxRestarts)") + 1]
    assert after == "In place:     3 (the gang restarted in its own pods; counted against maxRestarts)"
    assert not any(line.startswith("In place:") for line in format_summary(summarize(stored(RUNNING), NOW))
                   .splitlines())
    stalls = stored(RUNNING | {"restartsInPlace": 3, "disruptionsInPlace": 1})
    stalled = format_summary(summarize(stalls, NOW))
    assert ("In place:     3 (the gang restarted in its own pods; 1 after a stall (disruptions): not"
            " counted against maxRestarts)") in stalled
    asked = format_summary(summarize(stored(RUNNING | {"restartsInPlace": 3, "disruptionsInPlace": 1,
                                                       "askedInPlace": 1}), NOW))
    assert ("In place:     3 (the gang restarted in its own pods; 1 after a stall (disruptions) and 1 asked"
            " with tetrad.dev/restart-in-place: not counted against maxRestarts)") in asked


def test_summary_of_a_shrunken_elastic_job_shows_its_size_now_and_its_resizes():
    s = summarize(stored(RUNNING | {"elastic": {"nodes": 1, "resizes": 1, "room": 1}}), NOW)
    assert (s["nodes"], s["runningNodes"], s["resizes"]) == (2, 1, 1)
    lines = format_summary(s).splitlines()
    assert ("Mesh:         pp2.dpr1.dps2.cp1.tp2 on 1 of 2 nodes (elastic: shrunk until room returns) x 4 "
            "processes") in lines
    assert ("Restarts:     2 (1 of them disruptions, 1 elastic resizes, not counted against maxRestarts)"
            in lines)
    grown = format_summary(summarize(stored(RUNNING | {"elastic": {"nodes": 2, "resizes": 2}}), NOW))
    assert "on 2 nodes x 4 processes" in grown


def test_summary_shows_the_last_checkpoint_and_where_the_restart_resumed():
    status = RUNNING | {"checkpoint": {"step": 20, "time": "2026-01-01T01:55:00Z",
                                       "path": "/ckpt/step-00000020",
                                       "resumedFrom": 10, "resumedAtRestart": 2}}
    job = stored(status, checkpoint={"enabled": True, "path": "/ckpt"})
    lines = format_summary(summarize(job, NOW)).splitlines()
    assert ("Checkpoint:   step 20 committed 5m00s ago at /ckpt/step-00000020; restart 2 resumed "
            "from step 10") in lines
    assert lines.index("Restarts:     2 (1 of them disruptions, not counted against maxRestarts)") == \
        lines.index("Checkpoint:   step 20 committed 5m00s ago at /ckpt/step-00000020; restart 2 resumed "
                    "from step 10") + 1
    fresh = stored(RUNNING | {"checkpoint": {"resumedFrom": 0, "resumedAtRestart": 0}},
                   checkpoint={"enabled": True})
    assert "Checkpoint:   none committed yet; the first run started fresh" in format_summary(
        summarize(fresh, NOW))
    assert "Checkpoint:   none committed yet\n" in format_summary(
        summarize(stored(RUNNING, checkpoint={"enabled": True}), NOW))
    assert "Checkpoint" not in format_summary(summarize(stored(status), NOW))  # checkpointing off: no line


def test_summary_shows_the_preflight_bandwidth_the_slow_and_the_failed_nodes():
    status = RUNNING | {
        "preflight": {"restart": 2, "busBandwidthGBps": 38.0, "nodes": [
            {"node": "a", "nodeRank": 0, "busBandwidthGBps": 40.0},
            {"node": "b", "nodeRank": 1, "busBandwidthGBps": 38.0},
            {"node": "c", "nodeRank": 2, "busBandwidthGBps": 9.0}]},
        "failedNodes": [
            {"node": "bad", "reason": "devices: 7 CUDA devices visible", "restart": 1, "excluded": True}]}
    text = format_summary(summarize(stored(status), NOW))
    assert "Preflight:    38 GB/s median bus bandwidth over 3 nodes (restart 2); slow: c 9 GB/s\n" in text
    assert "Failed nodes: bad in restart 1 (excluded): devices: 7 CUDA devices visible\n" in text
    relaxed = format_summary(summarize(stored(status, preflight={"slowNodeFraction": 0.2}), NOW))
    assert "(restart 2)\n" in relaxed, "no node below 0.2 of the median"
    assert ("Preflight" not in format_summary(summarize(stored(RUNNING), NOW))
            and "Failed nodes" not in text.split("Preflight")[0])


def test_summary_names_the_slowest_ranks_and_marks_those_at_the_jobs_threshold():
    status = RUNNING | {"stragglers": {"restart": 1, "step": 30, "medianOwnSeconds": 1.0, "ranks": [
        {"rank": 5, "node": "b", "lag": 0.38, "ownSeconds": 1.6}, {"rank": 0, "node": "a", "lag": 0.0}]}}
    text = format_summary(summarize(stored(status), NOW))
    assert ("Slowest ranks: rank 5 on b 38% (slow), rank 0 on a 0% of each step waited for (step 30, "
            "restart 1)\n") in text
    relaxed = format_summary(summarize(stored(status, metrics={"slowRankLag": 0.5}), NOW))
    assert "rank 5 on b 38%, rank 0" in relaxed, "below the job's own threshold: not marked slow"
    assert "Slowest ranks" not in format_summary(summarize(stored(RUNNING), NOW))


def test_summary_says_how_much_of_the_wall_time_trained_and_where_the_rest_went():
    seconds = {"productive": 5400.0, "queued": 300.0, "startup": 120.0, "preflight": 0.0, "restarts": 900.0,
               "recomputed": 480.0, "checkpoint": 0.0, "suspended": 0.0}
    status = RUNNING | {"goodput": {"fraction": 0.7627, "wallSeconds": 7200.0, "seconds": seconds}}
    s = summarize(stored(status), NOW)
    assert s["goodput"]["lostSeconds"] == {"restarts": 900.0, "recomputed": 480.0, "queued": 300.0,
                                           "startup": 120.0}  # largest first, none of zero
    assert ("Goodput:      76.3% of 2h00m trained; lost: restarts 15m00s, recomputed 8m00s, queued 5m00s, "
            "startup 2m00s\n") in format_summary(s)
    assert "Goodput" not in format_summary(summarize(stored(RUNNING), NOW))
    assert "Goodput" not in format_summary(summarize(stored(RUNNING | {"goodput": {"wallSeconds": 0}}), NOW))


def test_eta_uses_the_presets_sequence_length():
    s = summarize(stored(RUNNING, training={"steps": 100, "globalBatch": 16}), NOW)
    assert s["stepSeconds"] == 16 * 256 / 512 and s["etaSeconds"] == 70 * 8.0  # debug: seqLen 256


def test_a_job_without_status_or_figures_yet():
    text = format_summary(summarize(stored(None), NOW))
    assert "Phase:    Pending" in text and "Mesh:     not resolved yet (2 nodes x 4 processes)" in text
    one = format_summary(
        summarize(stored(None, nodes=1, nprocPerNode=1, parallelism={"pp": 1, "dpShard": 1}), NOW))
    assert "(1 node x 1 process)" in one
    assert "Progress: no step reported yet, 100 to train" in text
    assert not any(word in text for word in ("ETA", "Tokens/s", "MFU", "Loss", "Running for", "Figures from"))


@pytest.mark.parametrize("phase", ["Succeeded", "Failed", "Suspended"])
def test_no_eta_unless_training(phase):
    s = summarize(
        stored(RUNNING | {"phase": phase, "message": "why", "completionTime": "2026-01-01T01:00:00Z"}), NOW)
    assert s["etaSeconds"] is None and s["runningSeconds"] == 3600.0
    assert "Message: why" in " ".join(format_summary(s).split())


def test_a_job_that_ended_before_its_layout_was_resolved():
    text = format_summary(summarize(stored({"phase": "Failed", "message": "pods refused"}), NOW))
    assert "Mesh:     never resolved (2 nodes x 4 processes)" in text and "yet" not in text
    assert "Progress: no step reported, 100 to train" in text


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: (st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                     max_leaves=12)
_keys = st.sampled_from(["spec", "status", "metadata", "model", "training", "script", "checkpoint",
                         "preflight", "failedNodes", "nodes", "phase", "mesh", "step", "steps", "preset",
                         "seqLen", "globalBatch", "enabled", "tokensPerSecond", "startTime", "completionTime",
                         "updated", "nprocPerNode"])
_objects = st.recursive(_json, lambda inner: st.dictionaries(_keys, inner, max_size=5), max_leaves=25)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _objects, max_size=5))
def test_any_object_the_api_server_returns_is_summarized_without_an_error(job):
    """A status of the wrong shape (a string, a list, a number where a mapping belongs) still shows."""
    format_summary(summarize(job, NOW))


def test_a_status_with_unexpected_values_still_shows():
    """The raw object is read field by field: a newer operator's fields or odd values do not crash it."""
    status = {"phase": "Running", "newField": {"x": 1},
              "training": {"step": "7", "tokensPerSecond": True, "updated": "yesterday"}}
    s = summarize(stored(status), NOW)
    assert (s["tokensPerSecond"], s["etaSeconds"], s["updatedSecondsAgo"]) == (None, None, None)
    format_summary(s)


@pytest.mark.parametrize("seconds, shown",
                         [(0, "0s"), (59.6, "1m00s"), (61, "1m01s"), (3600, "1h00m"), (90061, "1d1h")])
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
    doc = manifest(model={"preset": "llama3-1b", "seqLen": 8192},
                   parallelism={"pp": 1, "dpShard": "auto", "tp": 2}, resources={"gpu": 4})
    job, _ = parse(doc)
    # the trainer's log, `tetrad run`
    assert job is not None and resolve(job).model.name == "llama3-1b (seqLen 8192)"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    shown = tetrad("plan", str(path), columns=200)
    assert "t: llama3-1b (seqLen 8192), 1.5B params, seqLen 8192, on 8 processes" in shown.stdout, (
        shown.stdout)
    report = json.loads(tetrad("plan", "--json", str(path)).stdout)
    assert report["model"]["name"] == "llama3-1b (seqLen 8192)"


def tetrad(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    return subprocess.run([sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env=env)


@pytest.mark.parametrize("command", ["status", "checkpoint", "restart"])
def test_status_without_the_kubernetes_client_says_what_to_install(command):
    code = (f"import sys; sys.modules['kubernetes'] = None; sys.argv = ['tetrad', '{command}', 'j'];"
            " from tetrad.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: `tetrad {command}` needs the kubernetes Python client:"
                                " pip install 'tetrad[operator]' (or pip install kubernetes)")


def test_status_rejects_an_unknown_output():
    r = tetrad("status", "j", "-o", "yaml")
    assert r.returncode == 1 and "--output 'yaml': use text or json" in r.stderr


def _examples(text: str) -> list[str]:
    return [line.strip().removeprefix("$ ") for line in text.splitlines()
            if line.strip().startswith("$ tetrad ") or line.strip().startswith("$ kubectl ")]


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


# -- reading the job: every failure is one line, in bounded time ---------------------------------------

def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "c",
                                    "clusters": [{"name": "c", "cluster": {"server": server}}],
                                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                                    "users": [{"name": "u", "user": {}}]}))
    return path


def status_with(path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tetrad.cli", "status", "j", *args], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, env={**os.environ, "KUBECONFIG": str(path)})
    return r, time.monotonic() - start


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    return r.stderr


@pytest.fixture
def answering() -> Iterator[dict[str, Any]]:
    """An HTTP server that answers every GET with `reply["body"]` (bytes) as `reply["type"]`."""
    reply: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self.send_response(200)
            self.send_header("Content-Type", reply["type"])
            self.send_header("Content-Length", str(len(reply["body"])))
            self.end_headers()
            self.wfile.write(reply["body"])

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    reply["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield reply
    server.shutdown()
    server.server_close()


def test_status_with_a_kubeconfig_that_is_not_yaml(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nclusters: [unclosed\n")
    line = one_error_line(status_with(path)[0])
    assert f"the kubeconfig {path} is not valid YAML at line 3" in line
    path.write_text("[1, 2]\n")
    assert f"the kubeconfig {path} cannot be used" in one_error_line(status_with(path)[0])


def test_status_of_an_api_server_that_never_answers_ends_at_the_timeout(tmp_path):
    with socket.socket() as listener:  # connections complete in the backlog and are never answered
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        r, took = status_with(kubeconfig(tmp_path, f"http://127.0.0.1:{listener.getsockname()[1]}"),
                              "--request-timeout", "2")
    assert "did not answer within 2 s (--request-timeout)" in one_error_line(r)
    assert took < 20, f"{took:.0f} s: the request was retried"


def test_status_of_a_closed_port_says_the_connection_was_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "Connection refused" in one_error_line(
        status_with(kubeconfig(tmp_path, f"http://127.0.0.1:{port}"))[0])


def test_status_of_an_html_answer_from_a_proxy(tmp_path, answering):
    answering.update(type="text/html", body=b"<html><body>502 Bad Gateway</body></html>")
    line = one_error_line(status_with(kubeconfig(tmp_path, answering["url"]))[0])
    assert "answered with something other than a Kubernetes object (<html><body>502 Bad Gateway" in line


def test_status_of_a_job_with_a_malformed_status_shows_what_it_can(tmp_path, answering):
    job = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
           "metadata": {"name": "j", "namespace": "default"}, "spec": [], "status": "broken"}
    answering.update(type="application/json", body=json.dumps(job).encode())
    r, _ = status_with(kubeconfig(tmp_path, answering["url"]))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "Job:      default/j" in r.stdout and "Mesh:     not resolved yet (size unknown)" in r.stdout
