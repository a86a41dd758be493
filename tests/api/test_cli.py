"""The `tetrad` CLI as a user runs it: exit codes and one clear line per problem, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.api.helpers import manifest
from tetrad.plan.timing import MATMUL_EFFICIENCY

ROOT = Path(__file__).parents[2]


def tetrad(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def write(tmp_path: Path, name: str, doc) -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(p)


def test_validate_examples_pass():
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    r = tetrad("validate", *examples)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok: ") == len(examples)


def test_validate_reports_each_problem_on_one_line(tmp_path):
    bad = write(tmp_path, "bad.yaml", manifest(parallelism={"tp": 3}, training={"globalBatch": 7}))
    r = tetrad("validate", bad)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert any("spec.parallelism: the product of the degrees" in line for line in lines)
    assert any("spec.parallelism.tp: tp=3 must divide heads=8" in line for line in lines)
    assert all(line.startswith(("error: ", "warning: ")) for line in lines)
    assert "Traceback" not in r.stderr


def test_validate_bad_files_without_traceback(tmp_path):
    cases = {
        "syntax.yaml": ("spec: [unclosed\n", "invalid YAML at line"),
        "kind.yaml": ({"apiVersion": "v1", "kind": "Pod"}, "kind='Pod' is not ParallelTrainingJob"),
        "empty.yaml": ("", "empty file"),
    }
    for name, (doc, expected) in cases.items():
        r = tetrad("validate", write(tmp_path, name, doc))
        assert r.returncode == 1 and expected in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)
    r = tetrad("validate", str(tmp_path / "missing.yaml"))
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_validate_multi_document_file(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([manifest(), manifest(nodes=3)]))
    r = tetrad("validate", str(path))
    assert r.returncode == 1
    assert "two.yaml[0]: t" in r.stdout and "two.yaml[1]: spec.parallelism" in r.stderr


def test_render_prints_objects(tmp_path):
    r = tetrad("render", write(tmp_path, "j.yaml", manifest()))
    assert r.returncode == 0, r.stderr
    objs = list(yaml.safe_load_all(r.stdout))
    assert [o["kind"] for o in objs] == ["Service", "ConfigMap", "ConfigMap", "Pod", "Pod"]
    assert "&id" not in r.stdout


def test_render_invalid_job_fails_cleanly(tmp_path):
    r = tetrad("render", write(tmp_path, "j.yaml", manifest(nodes=3)))
    assert r.returncode == 1 and "spec.parallelism" in r.stderr and "Traceback" not in r.stderr


def test_plan_json_and_table():
    r = tetrad("plan", "--json", "examples/llama3-8b-2x8.yaml")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["fits"] and report["mesh"].startswith("pp1.")
    est = report["estimate"]
    assert est["peak_bytes"] <= report["usable_bytes"]
    assert set(est["comm_bytes"]) >= {"dp_shard*cp (FSDP)"}
    t = report["time"]
    assert (t["accelerator"] == "H100" and t["total_s"] >= t["compute_s"] > 0
            and 0 < t["mfu"] < MATMUL_EFFICIENCY)
    table = tetrad("plan", "examples/llama3-70b-8x8.yaml")
    assert table.returncode == 0 and "activations" in table.stdout and "chosen layout" in table.stdout
    assert "Predicted step on H100" in table.stdout and "tokens/s/device" in table.stdout


def test_plan_says_when_nothing_fits(tmp_path):
    doc = manifest(nodes=1, nprocPerNode=2, parallelism={"pp": "auto", "tp": "auto", "dpShard": "auto"},
                   model={"preset": "llama3-70b"}, resources={"gpu": 2, "gpuMemoryGiB": 40},
                   training={"globalBatch": 2})
    r = tetrad("plan", write(tmp_path, "j.yaml", doc))
    assert r.returncode == 1
    assert "no layout fits 40 GiB" in r.stdout and "the closest is" in r.stdout


def test_crd_command_matches_file():
    r = tetrad("crd")
    assert r.returncode == 0 and r.stdout == (
        ROOT / "crds" / "tetrad.dev_paralleltrainingjobs.yaml").read_text()


def test_every_single_job_command_rejects_a_multi_document_file(tmp_path):
    """One loader: plan, render and run all refuse to pick one document of several."""
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([manifest(), manifest(nodes=3)]))
    for command in ("plan", "render", "run"):
        r = tetrad(command, str(path))
        assert r.returncode == 1, (command, r.stdout)
        assert ("expected one ParallelTrainingJob, found 2 documents" in r.stderr
                and "Traceback" not in r.stderr), (command, r.stderr)


def test_every_command_reports_unreadable_files_alike(tmp_path):
    for command in ("validate", "plan", "render", "run"):
        r = tetrad(command, write(tmp_path, "syntax.yaml", "spec: [unclosed\n"))
        assert r.returncode == 1 and "invalid YAML at line" in r.stderr and "Traceback" not in r.stderr, (
            command, r.stderr)


def test_operator_command_comes_from_the_entry_point_group():
    """`tetrad operator` is registered by the operator package (pyproject.toml), not imported by the core."""
    from importlib.metadata import entry_points

    from tetrad.cli import COMMANDS_GROUP

    assert [e.value for e in entry_points(group=COMMANDS_GROUP, name="operator")] == [
        "tetrad_operator.command:operator"]
    r = tetrad("operator", "--help")
    assert r.returncode == 0 and "--all-namespaces" in r.stdout, r.stderr
    r = tetrad("operator")
    assert r.returncode == 1 and "give --namespace NAME (repeatable) or --all-namespaces" in r.stderr
