"""Issue 12's reproducers, one test each: hostile input gets one clear line naming the field, never a
traceback, never a silent default, never unbounded time or memory."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.api.helpers import manifest
from tetrad.api import contract
from tetrad.api.manifest import MAX_ALIAS_EXPANSION, MAX_MANIFEST_BYTES, ManifestError, load_manifests
from tetrad.api.podschema import definitions, generate, is_dns_label, is_dns_subdomain
from tetrad.api.spec import JOB_NAME_MAX, MAX_NODES
from tetrad.cli import app
from tetrad.cli.yamlout import dump_all
from tetrad.render import names, render
from tetrad.resolve import validate_document

ROOT = Path(__file__).parents[2]
runner = CliRunner()


def cli(*args: str, input: str | None = None) -> tuple[int, str]:
    """Exit code and stderr+stdout of `tetrad ARGS` in-process; an uncaught exception fails the test."""
    r = runner.invoke(app, list(args), input=input)
    assert r.exception is None or isinstance(r.exception, SystemExit), f"uncaught {r.exception!r}\n{r.output}"
    return r.exit_code, r.output


def write(tmp_path: Path, doc: Any, name: str = "job.yaml") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(p)


def errors_of(doc: dict[str, Any]) -> dict[str, str]:
    return {p.field: p.message for p in validate_document(doc) if p.severity == "error"}


def with_meta(**meta: Any) -> dict[str, Any]:
    doc = manifest()
    doc["metadata"] = meta
    return doc


# 5. Pass-through Kubernetes objects are checked against their schema.
@pytest.mark.parametrize(("template", "field"), [
    ({"env": [{"value": "x"}]}, "spec.template.env[0].name"),
    ({"env": [{"name": "A", "value": 5}]}, "spec.template.env[0].value"),
    ({"env": [{"name": "A", "valueFrom": {"fieldRef": {}}}]},
     "spec.template.env[0].valueFrom.fieldRef.fieldPath"),
    ({"env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]},
     "spec.template.env[0]"),
    ({"env": [{"name": "1=A", "value": "x"}]}, "spec.template.env[0].name"),
    ({"volumes": [{"name": "data"}]}, "spec.template.volumes[0]"),
    ({"volumes": [{"name": "Data", "emptyDir": {}}]}, "spec.template.volumes[0].name"),
    ({"volumes": [{"name": "d", "emptyDir": {}, "bogus": 1}]}, "spec.template.volumes[0].bogus"),
    ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.template.volumes[0].name"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/data"}]}, "spec.template.volumeMounts[0].name"),
    ({"volumeMounts": [{"mountPath": "/data"}]}, "spec.template.volumeMounts[0].name"),
    ({"volumes": [{"name": "d", "emptyDir": {}}],
      "volumeMounts": [{"name": "d", "mountPath": "/etc/tetrad"}]},
     "spec.template.volumeMounts[0].mountPath"),
    ({"tolerations": [{"key": "a", "operator": "Maybe"}]}, "spec.template.tolerations[0].operator"),
    ({"tolerations": [{"key": "a", "operator": "Exists", "value": "v"}]},
     "spec.template.tolerations[0].value"),
    ({"tolerations": [{"tolerationSeconds": "5"}]}, "spec.template.tolerations[0].tolerationSeconds"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}},
     "spec.template.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"),
    ({"affinity": {"podAffinity": 3}}, "spec.template.affinity.podAffinity"),
    ({"labels": {"Bad Key": "x"}}, "spec.template.labels['Bad Key']"),
    ({"labels": {"ok": "not ok!"}}, "spec.template.labels['ok']"),
    ({"labels": {contract.LABEL_JOB: "other"}}, f"spec.template.labels[{contract.LABEL_JOB!r}]"),
    ({"nodeSelector": {"a/b/c": "x"}}, "spec.template.nodeSelector['a/b/c']"),
])
def test_pass_through_objects_are_validated(tmp_path, template, field):
    doc = manifest(template=template)
    assert field in errors_of(doc), errors_of(doc)
    code, out = cli("render", write(tmp_path, doc))
    assert code == 1 and field in out


def test_checkpoint_volume_is_a_volume_source():
    assert "spec.checkpoint.volume.persistentVolumeClaim.claimName" in errors_of(
        manifest(checkpoint={"enabled": True, "volume": {"persistentVolumeClaim": {}}}))
    assert "spec.checkpoint.volume" in errors_of(manifest(checkpoint={"enabled": True, "volume": {}}))
    assert "spec.checkpoint.path" in errors_of(
        manifest(checkpoint={"enabled": True, "path": "/tmp", "volume": {"emptyDir": {}}}))


def test_valid_pass_through_objects_render():
    template = {"env": [{"name": "HF_HOME", "value": "/data/hf"},
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "labels": {"team": "llm"}, "annotations": {"example.com/owner": "me"}}
    doc = manifest(template=template)
    assert errors_of(doc) == {}
    from tetrad.api import ParallelTrainingJob
    pod = render(ParallelTrainingJob.model_validate(doc)).pods[0]
    assert {"name": "HF_HOME", "value": "/data/hf"} in pod["spec"]["containers"][0]["env"]


def test_podschema_json_matches_the_kubernetes_client():
    """The vendored schema is what `python -m tetrad.api.podschema` generates from the installed client."""
    assert generate() == definitions(), (
        "regenerate: python -m tetrad.api.podschema > tetrad/api/podschema.json")


# 6. plan does not run the solver after a degree check failed.
@pytest.mark.parametrize(("parallelism", "field"), [
    ({"dpShard": 0}, "spec.parallelism.dpShard"),
    ({"pp": -1, "dpShard": "auto"}, "spec.parallelism.pp"),
    ({"tp": 0, "dpShard": "auto"}, "spec.parallelism.tp"),
])
def test_plan_reports_bad_degrees(tmp_path, parallelism, field):
    doc = manifest(parallelism=parallelism)
    for command in (("plan",), ("plan", "--json"), ("validate",), ("render",)):
        code, out = cli(*command, write(tmp_path, doc))
        assert code == 1 and field in out, (command, out)


# 7. Names.
@pytest.mark.parametrize("name", ["MyJob", "my_job", "a" * (JOB_NAME_MAX + 1), "1job", "a.b", "", "jöb",
                                  "job-🚀", "adv/../../b", "-job", "job-", 7])
def test_bad_names_are_rejected(tmp_path, name):
    assert "metadata.name" in errors_of(with_meta(name=name))
    code, out = cli("render", write(tmp_path, with_meta(name=name)))
    assert code == 1 and "metadata.name" in out


def test_a_missing_name_is_an_error_not_a_default():
    assert "metadata.name" in errors_of(with_meta(namespace="ns"))
    doc = manifest()
    del doc["metadata"]
    assert "metadata" in errors_of(doc)


def test_the_longest_name_leaves_room_for_every_derived_name():
    """Every name tetrad/render/names.py derives from a JOB_NAME_MAX name is valid where Kubernetes uses
    it."""
    job, last = "a" * JOB_NAME_MAX, MAX_NODES - 1
    assert errors_of(with_meta(name=job)) == {}
    for label in (names.service(job), names.hostname(job, last), names.pod_group(job)):
        assert is_dns_label(label), label  # Service names, hostnames and the job-name label value
    for subdomain in (names.configmap(job), names.environment(job), names.pod(job, 10**9, last),
                      names.master_addr(job, "a" * 63), names.incarnation(job, 10**9)):
        assert is_dns_subdomain(subdomain) or len(subdomain) <= 253, subdomain
    assert not is_dns_label(names.hostname("a" * (JOB_NAME_MAX + 1), last))


def test_crd_limits_the_name_like_validation():
    from tetrad.api.crd import crd

    meta = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]
    assert meta["properties"]["name"]["maxLength"] == JOB_NAME_MAX
    import re
    pattern = re.compile(meta["properties"]["name"]["pattern"])
    for name in ("MyJob", "my_job", "1job", "a.b", "-a", "a-"):
        assert not pattern.search(name) and "metadata.name" in errors_of(with_meta(name=name))
    assert pattern.search("my-job-2") and errors_of(with_meta(name="my-job-2")) == {}


# 8. As strict as the CRD.
@pytest.mark.parametrize(("spec", "field"), [
    ({"nodes": "1"}, "spec.nodes"),
    ({"nodes": True}, "spec.nodes"),
    ({"nodes": 2.5}, "spec.nodes"),
    ({"parallelism": {"dpShard": "2"}}, "spec.parallelism.dpShard"),
    ({"training": {"compile": "yes"}}, "spec.training.compile"),
    ({"training": {"compile": 1}}, "spec.training.compile"),
    ({"checkpoint": {"path": ""}}, "spec.checkpoint.path"),
    ({"checkpoint": {"path": "/"}}, "spec.checkpoint.path"),
    ({"checkpoint": {"path": "/etc/tetrad"}}, "spec.checkpoint.path"),
    ({"checkpoint": {"path": "/etc"}}, "spec.checkpoint.path"),
    ({"checkpoint": {"path": "ckpt"}}, "spec.checkpoint.path"),
    ({"checkpoint": {"path": "/a/../etc/tetrad"}}, "spec.checkpoint.path"),
    ({"template": {"env": [{"name": "A", "value": 1}]}}, "spec.template.env[0].value"),
    ({"template": {"labels": {"a": 1}}}, "spec.template.labels.a"),
    ({"image": ""}, "spec.image"),
    ({"image": "a b"}, "spec.image"),
])
def test_strict_like_the_crd(spec, field):
    assert field in errors_of(manifest(**spec))


def test_checkpoint_path_rule_matches_its_cel_form():
    import celpy

    from tetrad.api.spec import CHECKPOINT_PATH_RULE

    env = celpy.Environment()
    program = env.program(env.compile(CHECKPOINT_PATH_RULE["rule"]))
    for path in ("/checkpoints", "/a/.b", "/etc/tetradx", "/", "", "/etc", "/etc/tetrad", "/etc/tetrad/x",
                 "/a/../b", "/a/./b", "/a//b", "/a/", "rel", "/..a"):
        python_ok = "spec.checkpoint.path" not in errors_of(manifest(checkpoint={"path": path}))
        assert bool(program.evaluate({"self": celpy.celtypes.StringType(path)})) == python_ok, path


# 9. Duplicate keys.
def test_duplicate_keys_name_both_lines(tmp_path):
    text = yaml.safe_dump(manifest(), sort_keys=False) + "spec:\n  nodes: 1\n"
    code, out = cli("validate", write(tmp_path, text))
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("spec:"))
    last = len(text.splitlines()) - 1
    assert code == 1 and f"line {last}: duplicate key 'spec' (first at line {first})" in out
    with pytest.raises(ManifestError, match="line 1: duplicate key 'a'"):
        load_manifests("{a: 1, a: 2}")


# 10. Finite numbers; --steps.
@pytest.mark.parametrize(("spec", "field"), [
    ({"training": {"lr": float("inf")}}, "spec.training.lr"),
    ({"training": {"gradClip": float("inf")}}, "spec.training.gradClip"),
    ({"training": {"weightDecay": float("nan")}}, "spec.training.weightDecay"),
    ({"resources": {"gpuMemoryGiB": float("inf")}}, "spec.resources.gpuMemoryGiB"),
])
def test_numbers_are_finite(spec, field):
    assert field in errors_of(manifest(**spec))


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_run_steps_must_be_positive(tmp_path, steps):
    code, out = cli("run", "--steps", steps, write(tmp_path, manifest()))
    assert code == 2 and "--steps" in out


def test_render_restart_must_not_be_negative(tmp_path):
    code, out = cli("render", "--restart", "-1", write(tmp_path, manifest()))
    assert code == 2 and "--restart" in out
    code, out = cli("render", "--restart", "1", write(tmp_path, manifest()))
    assert code == 0 and "tetrad.dev/restart: \"1\"" in out


# 11. Bounded input.
def test_alias_bombs_are_refused_before_expanding(tmp_path):
    """A 10^9-node "billion laughs" in well under a kilobyte, at spec.nodes and in a pass-through field."""
    levels = ["bomb:", "  a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [
        f"  {c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    head = "\n".join(levels) + "\n"
    at_nodes = head + yaml.safe_dump(manifest(), sort_keys=False).replace("nodes: 2", "nodes: *i")
    at_annotations = head + yaml.safe_dump(manifest(template={"annotations": {"x": "y"}}),
                                           sort_keys=False).replace("x: y", "x: *i")
    for text in (at_nodes, at_annotations):
        assert len(text) < 1000 and "*i" in text
        for command in ("validate", "render"):
            code, out = cli(command, write(tmp_path, text))
            assert code == 1 and "aliases expand" in out and len(out) < 1000, out


def test_aliases_within_the_limit_are_fine():
    text = "a: &a [1, 2, 3]\nb: *a\n"
    assert load_manifests(text) == [{"a": [1, 2, 3], "b": [1, 2, 3]}]
    with pytest.raises(ManifestError, match="refers to a node that contains it"):
        load_manifests("a: &a [*a]")
    assert MAX_ALIAS_EXPANSION >= 1000


def test_size_limit(tmp_path):
    big = "# " + "x" * MAX_MANIFEST_BYTES + "\n"
    code, out = cli("validate", write(tmp_path, big))
    assert code == 1 and "limit" in out and len(out) < 500


def test_long_values_are_truncated_in_messages(tmp_path):
    doc = manifest(nodes="9" * 100_000)
    doc["spec"]["x" * 100_000] = 1
    code, out = cli("validate", write(tmp_path, doc))
    assert code == 1 and "spec.nodes" in out and len(out) < 2000
    assert f"(got '{'9' * 80}'... (100000 characters))" in out, (
        "the value's own length, not its quoted form's")


def test_deep_nesting_is_one_line(tmp_path):
    for text in ("a: " + "[" * 600 + "]" * 600, "a:\n" + "".join(" " * i + "- \n" for i in range(1, 600))):
        code, out = cli("validate", write(tmp_path, text))
        assert code == 1 and "nested deeper than" in out and "Traceback" not in out


# 13. Operating-system errors are one line each.
def test_os_errors_are_one_line(tmp_path):
    base = Path(write(tmp_path, manifest(), "base.yaml"))
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    for path in (f"{base}/x", str(loop), str(tmp_path / ("n" * 300 + ".yaml")), str(tmp_path)):
        code, out = cli("validate", path)
        assert code == 1 and out.count("\n") == 1 and out.startswith("error: "), (path, out)


def test_run_refuses_bad_output_paths_before_starting(tmp_path):
    job = write(tmp_path, manifest())
    a_file = Path(write(tmp_path, "x", "file.txt"))
    for args in (("--jsonl", str(tmp_path)), ("--jsonl", "/proc"), ("--jsonl", "/proc/tetrad.jsonl"),
                 ("--workdir", str(a_file)), ("--workdir", f"{a_file}/sub")):
        code, out = cli("run", *args, job)
        assert code == 1 and args[0] in out and out.count("\n") == 1, (args, out)


# 16. Reserved env names.
@pytest.mark.parametrize("name",
                         ["PET_NNODES", "WORLD_SIZE", "MASTER_ADDR", "TETRAD_CONFIG", "RANK", "LOCAL_RANK"])
def test_reserved_env_names_are_rejected(name):
    errors = errors_of(manifest(template={"env": [{"name": name, "value": "1"}]}))
    assert "set by Tetrad or torchrun" in errors["spec.template.env[0].name"]


def test_every_rendered_env_name_is_reserved():
    from tetrad.api import ParallelTrainingJob

    pod = render(ParallelTrainingJob.model_validate(manifest()), restart=1).pods[1]
    rendered = {e["name"] for c in pod["spec"]["containers"] for e in c["env"]}
    assert rendered
    for name in rendered:
        assert name in contract.RESERVED_ENV or name.startswith(contract.RESERVED_ENV_PREFIXES), name


def test_own_volume_names_and_paths_are_the_contracts():
    from tetrad.api import ParallelTrainingJob

    pod = render(ParallelTrainingJob.model_validate(manifest())).pods[0]
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts == contract.POD_VOLUMES


# 17. `-` is stdin.
def test_dash_reads_stdin():
    text = yaml.safe_dump(manifest())
    code, out = cli("validate", "-", input=text)
    assert code == 0 and "ok: <stdin>: t" in out
    code, out = cli("render", "-", input=text)
    assert code == 0 and "kind: Pod" in out
    code, out = cli("validate", "-", input=text.replace("nodes: 2", "nodes: '2'"))
    assert code == 1 and "<stdin>: spec.nodes" in out


def test_stdin_in_a_real_process():
    r = subprocess.run([sys.executable, "-m", "tetrad.cli", "plan", "--json", "-"],
                       input=yaml.safe_dump(manifest()), capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["job"] == "t"


# The YAML writer of `tetrad render`.
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text
_data = st.recursive(_scalars,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
                     max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(_text, _data, max_size=5), min_size=1, max_size=3))
def test_yaml_writer_round_trips(objects):
    assert list(yaml.safe_load_all(dump_all(objects))) == [o or {} for o in objects]


def test_yaml_writer_quotes_what_go_yaml_reads_as_booleans():
    """kubectl's YAML 1.1 reader takes y and n for booleans, PyYAML does not: an env value "y" stays a
    string."""
    assert dump_all([{"value": "y", "other": "N"}]) == 'value: "y"\nother: "N"\n'


def test_yaml_writer_matches_pyyaml_on_rendered_objects():
    from tetrad.api import ParallelTrainingJob

    objects = render(
        ParallelTrainingJob.model_validate(manifest(template={"labels": {"on": "yes"}}))).objects()
    assert list(yaml.safe_load_all(dump_all(objects))) == copy.deepcopy(objects)
    assert "config.json: |" in dump_all(objects)  # the config stays readable
