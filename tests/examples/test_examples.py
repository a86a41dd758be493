"""Every manifest in examples/ is a job a user can apply as it is: `tetrad validate` passes it with
no warning, `tetrad plan` finds that it fits, and the real apiserver, with the CRD installed,
accepts it (`kubectl apply --dry-run=server` runs the schema and the CEL rules). Together the
examples cover every strategy the docs name."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tetrad.api.contract import KIND
from tetrad.api.spec import PPSchedule, Scheduler

ROOT = Path(__file__).resolve().parents[2]
DEGREES = ("pp", "dpReplicate", "dpShard", "cp", "tp")


def jobs_in(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict) and d.get("kind") == KIND]


EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if jobs_in(p)]
JOBS = [job for p in EXAMPLES for job in jobs_in(p)]


def tetrad(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def degrees(job: dict[str, Any]) -> dict[str, Any]:
    return {d: job["spec"].get("parallelism", {}).get(d) for d in DEGREES}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_validate_passes_without_warnings(example):
    r = tetrad("validate", str(example))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # a warning is a problem an example should not teach
    assert r.stdout.count("ok: ") == len(jobs_in(example))


@functools.cache
def plan(example: Path) -> dict[str, Any]:
    r = tetrad("plan", "--json", str(example))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_plan_fits_with_the_degrees_written(example):
    (job,) = jobs_in(example)
    report = plan(example)
    assert report["fits"], report
    # pp2.dpr1.dps2.cp1.tp2
    solved = {short: int(n) for short, n in re.findall(r"([a-z]+)(\d+)", report["mesh"])}
    short = {"pp": "pp", "dpReplicate": "dpr", "dpShard": "dps", "cp": "cp", "tp": "tp"}
    assert set(solved) == set(short.values()), report["mesh"]
    for degree, value in degrees(job).items():
        if isinstance(value, int):
            assert solved[short[degree]] == value, (degree, report["mesh"])


def test_the_examples_cover_every_strategy():
    def explicit(job: dict[str, Any], *more_than_one: str) -> bool:
        d = degrees(job)
        return all(isinstance(d[k], int) and d[k] > 1 for k in more_than_one)

    par = [j["spec"].get("parallelism", {}) for j in JOBS]
    assert any(explicit(j, "dpReplicate") and degrees(j)["dpShard"] == 1 for j in JOBS), "DDP"
    assert any(explicit(j, "dpShard") and degrees(j)["dpReplicate"] == 1 for j in JOBS), "FSDP"
    assert any(explicit(j, "dpReplicate", "dpShard") for j in JOBS), "HSDP"
    assert any(explicit(j, "tp") for j in JOBS) and any(explicit(j, "cp") for j in JOBS), "TP, CP"
    assert {p["ppSchedule"] for p in par if isinstance(p.get("pp"), int) and p["pp"] > 1} == {
        s.value for s in PPSchedule}
    assert any(explicit(j, "dpShard", "tp") and degrees(j)["pp"] == 1 for j in JOBS), "2D"
    assert any(explicit(j, "pp", "dpShard", "tp") and degrees(j)["cp"] == 1 for j in JOBS), "3D"
    four_d = [j for j in JOBS if explicit(j, "pp", "dpShard", "cp", "tp")]
    assert {j["spec"]["model"]["preset"] for j in four_d if j["spec"]["resources"].get("gpu")} >= {
        "llama3-8b", "llama3-70b"}
    assert any(not j["spec"]["resources"].get("gpu") for j in four_d), "a CPU/gloo 4D job"
    assert any(all(v == "auto" for v in degrees(j).values()) for j in JOBS), "auto everywhere"
    assert {j["spec"].get("gang", {}).get("scheduler", Scheduler.BUILTIN.value) for j in JOBS} >= \
        {Scheduler.BUILTIN.value, Scheduler.VOLCANO.value, Scheduler.KUEUE.value}
    assert any("persistentVolumeClaim" in (j["spec"].get("checkpoint", {}).get("volume") or {})
               for j in JOBS), "PVC"
    entries = {next(iter(j["spec"]["script"].keys() & {"path", "module", "command"}))
               for j in JOBS if "script" in j["spec"]}
    assert "path" in entries, "a script of one's own (level 1 and 2)"
    assert any(j["spec"].get("model", {}).get("module") for j in JOBS), "a model of one's own (level 3)"
    assert any(j["spec"].get("data", {}).get("source") == "jsonl" for j in JOBS), "fine-tuning data"


def gib(report: dict[str, Any]) -> str:
    return f"{report['estimate']['peak_bytes'] / 2**30:.1f}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_the_header_quotes_the_plan(example):
    header = "\n".join(line for line in example.read_text().splitlines() if line.startswith("#"))
    for quoted in re.findall(r"(\d+\.\d) GiB per GPU(?! per step)", header):
        assert quoted == gib(plan(example)), (f"{example.name}: the header says {quoted} GiB, "
                                              f"`tetrad plan` {gib(plan(example))}")


def test_the_guide_quotes_the_plan():
    """docs/parallelism.md's table of `tetrad plan` for the examples is what the planner says."""
    rows = re.findall(r"^\| \[([\w.-]+)\]\(\.\./examples/\1\.yaml\).*$",
                      (ROOT / "docs" / "parallelism.md").read_text(), re.M)
    assert len(rows) >= 15
    text = (ROOT / "docs" / "parallelism.md").read_text()
    for name in rows:
        report = plan(ROOT / "examples" / f"{name}.yaml")
        line = re.search(rf"^\| \[{re.escape(name)}\].*$", text, re.M).group()
        cells = [c.strip() for c in line.strip("|").split("|")]
        t = report["time"]
        assert cells[2:] == [str(report["world_size"]), f"`{report['mesh']}`", gib(report),
                             f"{t['compute_s']:.2f} s", f"{t['bubble_s']:.2f} s",
                             f"{t['exposed_comm_s']:.2f} s", f"{t['total_s']:.2f} s",
                             f"{t['tokens_per_second_per_device']:,.0f}", f"{t['mfu'] * 100:.1f}%"], name


def test_every_example_says_when_to_use_it():
    for example in EXAMPLES:
        header = [line for line in example.read_text().splitlines() if line.startswith("#")]
        assert len(header) >= 2, (f"{example.name}: start with a comment saying when to use it "
                                  f"and what it costs")


@pytest.mark.cluster
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_the_apiserver_accepts(tetrad_crd, namespace, example):
    out = tetrad_crd.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example))
    assert out.count("(server dry run)") == len(jobs_in(example)), out


@pytest.mark.cluster
def test_the_dry_run_reaches_the_cel_rules(tetrad_crd, namespace):
    """The control for the test above: the same path rejects a job the CEL rules forbid."""
    (job,) = jobs_in(ROOT / "examples" / "tp-sp.yaml")
    job["spec"]["parallelism"]["tp"] = 4  # 1 x 1 x 4 x 1 x 1 != 1 node x 8
    proc = tetrad_crd.run_kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                                  input=json.dumps(job))
    assert proc.returncode != 0
    assert "nodes" in proc.stderr and "nprocPerNode" in proc.stderr, proc.stderr
