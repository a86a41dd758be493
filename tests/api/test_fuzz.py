"""Hostile manifests, generated: load, validate, plan and render in-process never raise, every
rejection names a field, every call stays under a time and memory bound; and (marker `cluster`)
the objects rendered for a sample of admitted specs are accepted by the real apiserver.

A case is a valid base manifest with mutations at paths of the model (wrong types, huge and tiny
numbers, non-finite floats, nulls, unicode, long strings, unknown fields, deletions), pass-through
pod objects from a grammar that mixes valid and invalid shapes, and YAML text with duplicate keys
and aliases.
"""

from __future__ import annotations

import copy
import json
import time
import tracemalloc
import uuid
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.api.helpers import manifest
from tetrad.api import ParallelTrainingJob
from tetrad.api.manifest import ManifestError, load_manifests, parse
from tetrad.api.spec import ParallelTrainingJobSpec
from tetrad.cli.report import plan_job
from tetrad.cli.yamlout import dump_all
from tetrad.render import render
from tetrad.resolve import check_spec

FIELD_ROOTS = ("spec", "metadata", "kind", "apiVersion", "<document>")
TIME_S = 5.0  # CPU seconds for a case of at most MAX_PODS pods, all steps together
PEAK_BYTES = 256 * 1024 * 1024
MAX_PODS = 64


def names_a_field(problem: Any, doc: Any) -> bool:
    """The problem's field is a path into the model or the document (an unknown top-level key)."""
    root = problem.field.split(".")[0].split("[")[0]
    return root in FIELD_ROOTS or (isinstance(doc, dict) and root in map(str, doc))


def model_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field path of the spec model, by its wire (camelCase) name."""
    out = []
    for name, field in model.model_fields.items():
        path = (*prefix, field.alias or name)
        out.append(path)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += model_paths(ann, path)
    return out


PATHS = [("spec", *p) for p in model_paths(ParallelTrainingJobSpec)] + [
    ("metadata", "name"), ("metadata", "namespace"), ("metadata",), ("kind",), ("apiVersion",), ("spec",)]

hostile = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, -1, 1, 2, 3, 7, 64, 2**31, 2**63, -(2**63), 10**100]),
    st.integers(),
    st.sampled_from([0.0, -0.0, 0.5, 1e-300, 1e308, float("inf"), float("-inf"), float("nan")]),
    st.floats(),
    st.sampled_from(["", "auto", "2", "1e3", "true", "null", "x" * 10_000, "ü🚀", "a\x00b", "../../etc", "/",
                     "/etc/tetrad"]),
    st.text(max_size=30),
    st.lists(st.integers() | st.text(max_size=5) | st.none(), max_size=3),
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=5) | st.none(), max_size=3),
)

ENV_NAMES = ["HF_HOME", "A", "a.b-c", "1X", "X=Y", "", "PET_NNODES", "WORLD_SIZE", "TETRAD_JOB", "RANK", "ü"]
VOLUME_NAMES = ["data", "cache", "tmp", "config", "checkpoints", "Data", "a" * 64, "x_y", ""]
MOUNT_PATHS = ["/data", "/data/", "/tmp", "/etc/tetrad", "/dev/shm", "rel", "/x:y", "/", ""]


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return value | hostile


env_var = st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(ENV_NAMES))},
    optional={"value": maybe(st.text(max_size=10)),
              "valueFrom": maybe(
                  st.just({"fieldRef": {"fieldPath": "spec.nodeName"}}) | st.just({"fieldRef": {}})),
              "bogus": hostile})
source = st.sampled_from([{"emptyDir": {}}, {"persistentVolumeClaim": {"claimName": "pvc"}},
                          {"configMap": {"name": "cm"}}, {"persistentVolumeClaim": {}},
                          {"emptyDir": {"medium": 3}}, {}, {"emptyDir": {}, "configMap": {"name": "cm"}}])
volume = st.builds(lambda name, src: {"name": name, **src}, maybe(st.sampled_from(VOLUME_NAMES)), source)
mount = st.fixed_dictionaries({"name": maybe(st.sampled_from(VOLUME_NAMES)),
                               "mountPath": maybe(st.sampled_from(MOUNT_PATHS))},
                              optional={"readOnly": maybe(st.booleans()), "subPath": maybe(st.just("sub"))})
TOLERATION = {
    "key": st.sampled_from(["nvidia.com/gpu", "a", "Bad Key", ""]),
    "operator": st.sampled_from(["Exists", "Equal", "Maybe", ""]),
    "value": st.sampled_from(["", "v", "not ok!"]),
    "effect": st.sampled_from(["NoSchedule", "NoExecute", "Later", ""]),
    "tolerationSeconds": st.integers(-5, 100)}
toleration = st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in TOLERATION.items()})
well_typed_toleration = st.fixed_dictionaries({}, optional=TOLERATION)
affinity = st.sampled_from([
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}},
    {"podAffinity": 3}, {"bogus": {}},
])
LABEL_KEYS = st.sampled_from(
    ["team", "example.com/x", "Bad Key", "tetrad.dev/job-name", "a/b/c", "", "A.b_c-1"])
LABEL_VALUES = st.sampled_from(["llm", "", "not ok!", "x" * 64, "x" * 63, "-x", "a.b_c-1"])
# Valid, some at the edge (63 characters, empty values, '.', '_' and '-' inside, a prefix).
valid_labels = st.dictionaries(st.sampled_from(["team", "example.com/x", "A.b_c-1", "x" * 63]),
                               st.sampled_from(["llm", "", "x" * 63, "a.b_c-1"]), max_size=3)
labels = st.dictionaries(LABEL_KEYS, maybe(LABEL_VALUES), max_size=3)
template = st.fixed_dictionaries({}, optional={
    "env": maybe(st.lists(env_var, max_size=3)), "volumes": maybe(st.lists(volume, max_size=3)),
    "volumeMounts": maybe(st.lists(mount, max_size=3)),
    "tolerations": maybe(st.lists(toleration, max_size=2)),
    "affinity": maybe(affinity), "labels": maybe(labels), "nodeSelector": maybe(labels),
    "annotations": maybe(labels)})


def set_path(doc: dict[str, Any], path: tuple[str, ...], value: Any, delete: bool) -> None:
    node = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc = manifest(nodes=draw(st.sampled_from([1, 2, 4])), nprocPerNode=2,
                   parallelism={"pp": 1, "tp": "auto", "dpShard": "auto"})
    doc["spec"]["template"] = draw(template)
    if draw(st.booleans()):
        doc["spec"]["checkpoint"] = {"enabled": True,
                                     "path": draw(maybe(st.sampled_from(MOUNT_PATHS + ["/ckpt"]))),
                                     "volume": draw(maybe(source))}
    for _ in range(draw(st.integers(0, 3))):
        set_path(doc, draw(st.sampled_from(PATHS)), draw(hostile), draw(st.booleans()))
    if draw(st.booleans()):
        set_path(doc, ("spec", draw(st.sampled_from(["bogus", "Nodes", "ü"]))), draw(hostile), False)
    return doc


@st.composite
def yaml_texts(draw: st.DrawFn) -> str:
    """A document as YAML text, sometimes with a duplicate key or an alias woven in."""
    doc = draw(documents())
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=draw(st.booleans()))
    trick = draw(st.sampled_from(["none", "duplicate", "alias", "bomb"]))
    if trick == "duplicate":
        text += draw(st.sampled_from(["spec:\n  nodes: 1\n", "kind: ParallelTrainingJob\n"]))
    elif trick == "alias":
        text = "x: &x " + json.dumps(draw(hostile), allow_nan=True).replace("NaN", ".nan").replace(
            "Infinity", ".inf") + "\n" + text.replace("nodes: ", "nodes: *x #", 1)
    elif trick == "bomb":
        levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"] + [
            f"{c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefg", "bcdefgh", strict=True)]
        text = "\n".join(levels) + "\n" + text.replace("nodes: ", "nodes: *h #", 1)
    return text


def run_case(text: str) -> tuple[ParallelTrainingJob | None, list[Any]]:
    """What `tetrad validate`, `plan` and `render` do with `text`, in-process, with the bounds asserted."""
    tracemalloc.start()
    started = time.process_time()
    job: ParallelTrainingJob | None = None
    objects: list[Any] = []
    try:
        try:
            docs = load_manifests(text)
        except ManifestError as e:
            assert str(e), "a refused file says why"
            return None, []
        for doc in docs:
            job, problems = parse(doc)
            if job is not None:
                problems = check_spec(job.spec).problems
                assume(job.spec.nodes <= MAX_PODS)
                report = plan_job(job)
                assert isinstance(report["fits"], bool)
                json.dumps(report)
            for p in problems:
                assert names_a_field(p, doc), p
                assert p.message and len(str(p)) < 2000, p
            if job is not None and not [p for p in problems if p.severity == "error"]:
                objects = render(job).objects()
                assert yaml.safe_load_all(dump_all(objects))
            elif job is not None:
                job = None
        return job, objects
    finally:
        elapsed = time.process_time() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < TIME_S, f"{elapsed:.1f} s of CPU"
        assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB"


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(yaml_texts())
def test_hostile_manifests(text):
    run_case(text)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(documents())
def test_hostile_documents_in_process(doc):
    """The same without YAML: values YAML cannot carry (nan keys, huge ints) reach the model directly."""
    job, problems = parse(copy.deepcopy(doc))
    for p in problems:
        assert names_a_field(p, doc), p
    if job is not None:
        assume(job.spec.nodes <= MAX_PODS)
        checked = check_spec(job.spec)
        plan_job(job)
        if checked.ok:
            render(job)


@st.composite
def admissible(draw: st.DrawFn) -> dict[str, Any]:
    """Documents that are mostly valid: the pass-through grammar without hostile values, and no
    fields whose objects the test cluster lacks (ServiceAccounts, PriorityClasses, PodGroups)."""
    doc = manifest(nodes=draw(st.sampled_from([1, 2])), nprocPerNode=2,
                   parallelism={"pp": 1, "tp": "auto", "dpShard": "auto"})
    vols = draw(st.lists(st.builds(lambda n, s: {"name": n, **s},
                                   st.sampled_from(["data", "scratch", "models"]),
                                   st.sampled_from([{"emptyDir": {}},
                                                    {"persistentVolumeClaim": {"claimName": "pvc"}},
                                                    {"configMap": {"name": "cm"}}])),
                         max_size=3, unique_by=lambda v: v["name"]))
    doc["spec"]["template"] = {
        "env": draw(st.lists(st.fixed_dictionaries({"name": st.sampled_from(["HF_HOME", "A", "a.b-c", "X_1"]),
                                                    "value": st.text(max_size=10)}), max_size=3)),
        "volumes": vols,
        "volumeMounts": [
            {"name": v["name"], "mountPath": f"/mnt/{v['name']}"} for v in vols[:draw(st.integers(0, 3))]],
        "tolerations": draw(st.lists(well_typed_toleration, max_size=2)),
        "affinity": draw(st.none() | affinity),
        "labels": draw(valid_labels), "nodeSelector": draw(valid_labels), "annotations": draw(valid_labels),
    }
    if draw(st.booleans()):
        doc["spec"]["checkpoint"] = {"enabled": True,
                                     "path": draw(st.sampled_from(["/ckpt", "/data/c", "/tmp"])),
                                     "volume": draw(source), "interval": draw(st.integers(1, 1000)),
                                     "keepLast": draw(st.integers(1, 5)), "async": draw(st.booleans())}
    # The newer fields, each present or not, with values of their range.
    newer = {
        ("preflight",): st.fixed_dictionaries({}, optional={
            "enabled": st.booleans(), "timeoutSeconds": st.integers(1, 3600),
            "allReduceMiB": st.integers(1, 512),
            "slowNodeFraction": st.floats(0, 1), "excludeFailedNodes": st.booleans(),
            "maxExcludedNodes": st.integers(0, 5)}),
        ("runPolicy",): st.fixed_dictionaries({}, optional={
            "maxRestarts": st.integers(0, 10), "maxDisruptions": st.integers(0, 30),
            "backoffSeconds": st.integers(0, 60),
            "backoffMaxSeconds": st.integers(60, 600), "activeDeadlineSeconds": st.integers(1, 10**6),
            "stallTimeoutSeconds": st.sampled_from([0, 300, 900]),
            "collectiveTimeoutSeconds": st.integers(5, 600),
            "permanentExitCodes": st.lists(st.sampled_from([1, 3, 77, 78, 79]), unique=True, max_size=3),
            "suspend": st.booleans(), "ttlSecondsAfterFinished": st.integers(0, 10**5)}),
        ("training", "fsdp"): st.fixed_dictionaries({}, optional={
            "reshardAfterForward": st.booleans(), "offload": st.sampled_from(["none", "cpu"])}),
        ("training", "lossChunks"): st.integers(1, 8),
        ("training", "initFrom"): st.sampled_from(["/models/llama-hf", "/data/hf"]),
        ("gang", "topologyKey"): st.sampled_from(["tetrad.dev/rack", "topology.kubernetes.io/zone"]),
        ("elastic",): st.fixed_dictionaries({"minNodes": st.integers(1, 4)}, optional={
            "shrinkAfterSeconds": st.integers(0, 3600), "growAfterSeconds": st.integers(0, 3600)}),
        ("data",): st.sampled_from([{"source": "tokens", "path": "/data/t.bin", "tokenDtype": "uint32"},
                                    {"source": "text", "path": "/data/t.txt"}]),
    }
    for path, values in newer.items():
        if draw(st.booleans()):
            *parents, leaf = path
            target = doc["spec"]
            for key in parents:
                target = target.setdefault(key, {})
            target[leaf] = draw(values)
    return doc




@pytest.mark.cluster
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(admissible())
def test_admitted_specs_render_what_the_apiserver_accepts(tetrad_crd, namespace, doc):
    """Each admitted spec's objects pass `kubectl apply --dry-run=server` (schema, defaults, pod
    validation)."""
    doc["metadata"] = {"name": f"f{uuid.uuid4().hex[:8]}", "namespace": namespace}
    job, problems = parse(doc)
    assume(job is not None and check_spec(job.spec).ok)
    assert job is not None
    text = dump_all(render(job).objects())
    proc = tetrad_crd.run_kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=text)
    assert proc.returncode == 0, f"{proc.stderr}\n{json.dumps(doc['spec'], indent=1)}"
    assert proc.stdout.count("(server dry run)") == len(render(job).objects()), proc.stdout
    ptj = tetrad_crd.run_kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                                 input=json.dumps(doc))
    assert ptj.returncode == 0, ptj.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(("meta", "spec"), [
    ({"name": "MyJob"}, {}), ({"name": "a" * 58}, {}), ({"name": "1job"}, {}), ({"name": "a.b"}, {}),
    ({}, {"checkpoint": {"path": "/etc/tetrad"}}), ({}, {"checkpoint": {"path": "/"}}),
    ({}, {"checkpoint": {"path": "ckpt"}}), ({}, {"checkpoint": {"path": "/a/../etc"}}),
    ({}, {"nodes": "1"}), ({}, {"nodes": True}), ({}, {"parallelism": {"dpShard": "2"}}),
], ids=str)
def test_the_crd_refuses_what_validation_refuses(tetrad_crd, namespace, meta, spec):
    doc = manifest(**spec)
    doc["metadata"] = {"name": "ok", "namespace": namespace, **meta}
    assert parse(doc)[0] is None or not check_spec(parse(doc)[0].spec).ok  # type: ignore[union-attr]
    proc = tetrad_crd.run_kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                                  input=json.dumps(doc))
    assert proc.returncode != 0 and ("metadata.name" in proc.stderr or "spec." in proc.stderr), proc.stderr
