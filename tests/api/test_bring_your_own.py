"""What runs, as the API sees it: a script job (spec.script) and a model of one's own (spec.model.module)
validate with field-named messages, resolve `auto` without a model, render the launcher's command and
environment, and plan their layout and placement."""

from __future__ import annotations

import base64
import zipfile
from io import BytesIO
from typing import Any

import pytest

from tests.api.helpers import manifest, rendered_env
from tetrad.api import parse
from tetrad.api.resolved import Layout
from tetrad.cli.report import plan_job
from tetrad.node.bundle import launcher
from tetrad.plan.placement import ACROSS, INSIDE, placement
from tetrad.render import render
from tetrad.resolve import resolve, validate_document

PYZ = "/etc/tetrad/tetrad-node.pyz"


def script_doc(script: dict[str, Any], **spec: Any) -> dict[str, Any]:
    doc = manifest(**spec)
    if "training" not in spec:
        del doc["spec"]["training"]
    doc["spec"]["script"] = script
    return doc


def errors(doc: dict[str, Any]) -> list[str]:
    return [str(p) for p in validate_document(doc) if p.severity == "error"]


def test_a_script_names_one_entry_point() -> None:
    assert errors(script_doc({"path": "/app/train.py"})) == []
    for wrong in ({}, {"path": "/a.py", "module": "m"}, {"module": "m", "command": ["x"]}):
        (problem,) = errors(script_doc(wrong))
        assert problem.startswith("spec.script: give exactly one entry point of path, module or command")
    assert errors(script_doc({"module": "my-pkg.train"})) == [
        "spec.script.module: must be a dotted Python module name, e.g. mypkg.train (got 'my-pkg.train')"]
    assert errors(script_doc({"command": []}))[0].startswith(
        "spec.script.command: script.command must be a non-empty")
    assert errors(script_doc({"path": "t.py", "workingDir": "app"}))[0].startswith(
        "spec.script.workingDir: script.workingDir must be an absolute")


def test_a_script_job_gives_none_of_the_trainers_settings() -> None:
    doc = script_doc({"path": "/app/train.py"}, model={"preset": "debug"}, training={"steps": 3},
                     data={"source": "synthetic"}, checkpoint={"enabled": True, "volume": {"emptyDir": {}}},
                     parallelism={"ppMicrobatches": 4})
    assert [e.split(":")[0] for e in errors(doc)] == [
        "spec.model", "spec.training", "spec.data", "spec.checkpoint.enabled",
        "spec.parallelism.ppMicrobatches"]
    assert "pass your settings in spec.script.args" in errors(doc)[0]


def test_a_script_job_solves_auto_without_a_model() -> None:
    job, _ = parse(script_doc({"path": "/a.py"}, nodes=2, nprocPerNode=4,
                              parallelism={"pp": "auto", "dpShard": "auto", "tp": 2, "cp": "auto"}))
    assert job is not None
    cfg = resolve(job)
    assert cfg.layout == Layout(pp=1, dp_shard=4, tp=2) and cfg.model is None and cfg.script is not None
    (problem,) = errors(script_doc({"path": "/a.py"}, nodes=1, nprocPerNode=6,
                                   parallelism={"pp": 1, "dpShard": "auto", "tp": 4}))
    assert problem.startswith(
        "spec.parallelism: dpShard: auto takes what the other degrees leave of nodes*nprocPerNode = 6")


@pytest.mark.parametrize(("script", "worker"), [
    ({"path": "/app/train.py", "args": ["--lr", "3e-4"]}, ["--path", "/app/train.py", "--", "--lr", "3e-4"]),
    ({"module": "pkg.train", "workingDir": "/app"}, ["--module", "pkg.train", "--workdir", "/app", "--"]),
    ({"command": ["bash", "-c", "exec python3 t.py"], "args": ["x"]},
     ["--command", "--", "bash", "-c", "exec python3 t.py", "x"]),
], ids=["path", "module", "command"])
def test_a_script_pod_runs_the_launcher_around_torchrun_around_the_entry_point(script: dict[str, Any],
                                                                               worker: list[str]) -> None:
    job, problems = parse(script_doc(script, image="me/train:1"))
    assert job is not None, problems
    r = render(job)
    (container,) = r.pods[1]["spec"]["containers"]
    assert container["image"] == "me/train:1"
    assert container["command"] == ["python3", PYZ, "supervise", "--", "python3", "-m",
                                    "torch.distributed.run", PYZ, "worker", *worker]
    env = rendered_env(r, 1)
    assert env["TETRAD_MESH"] == "pp=2,dp_replicate=1,dp_shard=2,cp=1,tp=2" and env["TETRAD_CONTRACT"] == "1"
    assert env["TETRAD_CHECKPOINT_DIR"] == "/checkpoints" and env["TETRAD_GPUS"] == "0"
    pyz = base64.b64decode(r.configmap["binaryData"]["tetrad-node.pyz"])
    assert pyz == launcher() and "tetrad/node/worker.py" in zipfile.ZipFile(BytesIO(pyz)).namelist()


def test_a_model_of_ones_own_gives_its_dims_not_a_preset() -> None:
    dims = {"dim": 64, "layers": 2, "heads": 4, "vocab": 256, "seqLen": 64}
    job, _ = parse(manifest(model={"module": "gpt2_model:definition", **dims}))
    assert job is not None
    model = resolve(job).model
    assert model is not None and (model.name, model.module, model.kv_heads, model.ffn_dim) == (
        "gpt2_model:definition", "gpt2_model:definition", 4, 256)
    assert errors(manifest(model={"module": "gpt2_model:definition", "preset": "debug", **dims})) == [
        "spec.model.preset: a model definition of your own (module) takes its dims from spec.model, not a "
        "preset; remove preset"]
    assert errors(manifest(model={"module": "gpt2_model:definition", "dim": 64})) == [
        "spec.model: module needs its dims in spec.model: layers, heads, vocab, seqLen missing (kvHeads "
        "defaults to heads, ffnDim to 4 x dim)"]
    assert errors(manifest(model={"module": "gpt2_model", **dims}))[0].startswith(
        "spec.model.module: must be MODULE:NAME")
    plan = plan_job(job)
    assert plan["fits"] and "a Llama decoder of the same dims" in plan["note"]


def test_the_plan_of_a_script_job_states_the_layout_and_placement_and_no_prediction() -> None:
    job, _ = parse(script_doc({"path": "/app/train.py"}))
    assert job is not None
    plan = plan_job(job)
    assert plan["fits"] and plan["mesh"] == "pp2.dpr1.dps2.cp1.tp2" and "estimate" not in plan
    assert plan["placement"] == {"pp": ACROSS, "dp_shard": INSIDE, "tp": INSIDE}
    assert plan["note"].startswith(
        "spec.script runs your own code: Tetrad cannot predict its memory or step time")


def test_placement_says_which_dims_cross_nodes() -> None:
    assert placement(Layout(tp=8), 8) == {"tp": INSIDE}
    assert placement(Layout(dp_shard=2, tp=8), 8) == {"dp_shard": ACROSS, "tp": INSIDE}
    assert placement(Layout(dp_shard=4, tp=2), 8) == {"dp_shard": INSIDE, "tp": INSIDE}
    assert placement(Layout(tp=3, dp_shard=2), 4) == {"dp_shard": ACROSS, "tp": ACROSS}
    assert placement(Layout(), 8) == {}
