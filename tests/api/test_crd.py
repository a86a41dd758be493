"""The generated CRD: no drift from the model, structural, described, and CEL rules that behave.

The CEL rules are evaluated with cel-python here; tests/cluster also runs them in a real apiserver.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.api.helpers import manifest
from tetrad.api.crd import PRESENCE_SIGNIFICANT, crd, crd_yaml
from tetrad.api.presets import PRESETS
from tetrad.api.problems import Problem
from tetrad.api.spec import ParallelTrainingJobSpec
from tetrad.resolve import validate_document

CRD_FILE = Path(__file__).parents[2] / "crds" / "tetrad.dev_paralleltrainingjobs.yaml"


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_file_matches_model():
    assert CRD_FILE.read_text() == crd_yaml(), "crds/ drifted from tetrad/api: run `make crds`"


def _walk(node: dict[str, Any], path: str):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_every_field_is_described():
    spec, status = schema()["properties"]["spec"], schema()["properties"]["status"]
    missing = [p for root, name in ((spec, "spec"), (status, "status"))
               for p, n in _walk(root, name) if "description" not in n and not p.endswith(("[]", "{}"))]
    assert missing == []


def test_schema_is_structural():
    for path, node in _walk(schema(), ""):
        assert not any(k in node for k in ("$ref", "oneOf", "allOf", "title")), path
        # the one anyOf structural schemas allow, as the apiserver publishes it
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "anyOf" not in node, path
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_crd_metadata():
    c = crd()["spec"]
    assert c["names"]["shortNames"] == ["ptj"]
    v = c["versions"][0]
    assert v["subresources"] == {"status": {}}
    columns = v["additionalPrinterColumns"]
    assert [col["name"] for col in columns if not col.get("priority")] == [
        "Phase", "Nodes", "Mesh", "Restarts", "Tokens/s", "Last-Ckpt", "Age"]
    assert [col["name"] for col in columns if col.get("priority") == 1] == [  # -o wide
        "Running-Nodes", "Step", "Steps", "Loss", "MFU", "Goodput"]


def test_printer_columns_name_schema_fields():
    for col in crd()["spec"]["versions"][0]["additionalPrinterColumns"]:
        if col["jsonPath"].startswith(".metadata."):
            continue
        node = schema()
        for name in col["jsonPath"].lstrip(".").split("."):
            assert name in node.get("properties", {}), (
                f"{col['name']}: {col['jsonPath']} is not in the schema")
            node = node["properties"][name]
        # a number may be shown whole (the apiserver truncates it for an integer column)
        assert col["type"] in (node["type"], "integer" if node["type"] == "number" else node["type"]), col


def _defaulted(doc: dict[str, Any]) -> Any:
    """The spec as the apiserver stores it: CRD defaults applied (the model's defaults are the same), the
    sections whose presence counts left out when the manifest leaves them out."""
    spec = ParallelTrainingJobSpec.model_validate(doc["spec"]).model_dump(by_alias=True, exclude_none=True,
                                                                          mode="json")
    for name in PRESENCE_SIGNIFICANT:
        if name not in doc["spec"]:
            spec.pop(name, None)
    return celpy.json_to_cel(spec)


def _cel_format(text: Any, args: Any) -> Any:
    """The Kubernetes CEL strings extension's format() for %d/%s, which cel-python lacks."""
    values = iter(args)
    return celpy.celtypes.StringType(re.sub(r"%[ds]", lambda _: str(next(values)), str(text)))


_ENV = celpy.Environment()


@cache
def _program(expression: str, formatted: bool = False) -> Any:
    """A compiled CEL program (compiling is slow; the property below evaluates thousands)."""
    return _ENV.program(_ENV.compile(expression), functions={"format": _cel_format} if formatted else None)


def _evaluate(rule: dict[str, str], activation: dict[str, Any]) -> tuple[bool, str]:
    ok = bool(_program(rule["rule"]).evaluate(activation))
    if ok:
        return True, ""
    if "messageExpression" in rule:
        return False, str(_program(rule["messageExpression"], formatted=True).evaluate(activation))
    return False, rule["message"]


def spec_rules() -> list[dict[str, str]]:
    """The spec-level CEL rules of one object (not the transition rules, which compare with oldSelf)."""
    return [
        r for r in schema()["properties"]["spec"]["x-kubernetes-validations"] if "oldSelf" not in r["rule"]]


def spec_rule_results(doc: dict[str, Any]) -> list[tuple[dict[str, str], bool, str]]:
    """(rule, admitted, message) for every spec-level CEL rule."""
    activation = {"self": _defaulted(doc)}
    return [(r, *_evaluate(r, activation)) for r in spec_rules()]


def spec_rule_failures(doc: dict[str, Any]) -> list[str]:
    return [msg for _, ok, msg in spec_rule_results(doc) if not ok]


def script_job(**spec: Any) -> dict[str, Any]:
    doc = manifest(**spec)
    for name in ("model", "training"):
        if name not in spec:
            doc["spec"].pop(name, None)
    doc["spec"]["script"] = {"path": "/app/train.py"}
    return doc


CASES = [
    (manifest(), []),
    (manifest(parallelism={"tp": 4}),
     ["product of the degrees dpReplicate*dpShard*tp*cp*pp = 1*2*4*1*2 = 16"]),
    (manifest(nodes=1, nprocPerNode=6, parallelism={"pp": 1, "tp": 3, "dpShard": 2}),
     ["tp=3 must divide heads=8 and kvHeads=4", "tp*2*cp = 6"]),
    (manifest(model={"seqLen": 102}), ["seqLen=102 must be divisible by tp*2*cp = 4"]),
    (manifest(model={"preset": "llama3-8b", "heads": 6, "kvHeads": 6, "dim": 4092},
              parallelism={"tp": 4, "pp": 1}),
     ["tp=4 must divide heads=6 and kvHeads=6"]),
    (manifest(nodes=1, nprocPerNode=8, parallelism={"pp": 8, "dpShard": 1, "tp": 1}),
     ["pp*ppStagesPerRank = 8*1 = 8 stages exceed layers=4 + 2"]),
    (manifest(nodes=1, nprocPerNode=6, parallelism={"pp": 6, "dpShard": 1, "tp": 1}), []),
    (manifest(parallelism={"ppSchedule": "Interleaved1F1B", "ppStagesPerRank": 4}),
     ["2*4 = 8 stages exceed layers=4 + 2"]),
    (manifest(parallelism={"ppMicrobatches": 1}),
     ["ppMicrobatches=1 is below the 2 pipeline stages (pp=2 x 1 per rank)"]),
    (manifest(parallelism={"ppSchedule": "Interleaved1F1B", "ppMicrobatches": 2}),
     ["ppMicrobatches=2 is below the 4 pipeline stages"]),
    (manifest(resources={"gpu": 2}), ["gpu=2 must equal nprocPerNode=4"]),
    (manifest(gang={"scheduler": "kueue"}), ["needs gang.queue"]),
    (manifest(parallelism={"dpShard": "auto", "tp": "auto"}), []),
    (manifest(parallelism={"pp": 4, "dpShard": 1}, training={"fsdp": {"offload": "cpu"}}),
     ["offload=cpu needs FSDP, but dpShard*cp = 1*1 = 1"]),
    (manifest(parallelism={"pp": 4, "dpShard": 1, "cp": 2, "tp": 1},
              training={"fsdp": {"offload": "cpu"}}), []),
    # float8: compiled bf16 on GPUs, tp 1
    (manifest(resources={"gpu": 4}, parallelism={"tp": 1, "dpShard": 8, "pp": 1},
              training={"float8": {"recipe": "rowwise"}, "compile": True}), []),
    (manifest(parallelism={"tp": 2, "dpShard": 2, "pp": 2}, training={"float8": {"recipe": "tensorwise"},
                                                                    "precision": "fp32"}),
     ["float8 needs training.compile: true", "float8 trains a bf16 model", "float8 needs NVIDIA GPUs",
      "float8 with tensor parallelism is not supported"]),
    # A script job: the model-dependent rules do not apply (tp=8 divides no debug head count), the trainer's
    # sections and settings are refused.
    (script_job(parallelism={"tp": 8, "dpShard": 1, "pp": 1}), []),
    (script_job(parallelism={"tp": 8, "dpShard": 1, "pp": 1}, model={"preset": "debug"},
                training={"steps": 3}, data={"source": "synthetic"}),
     ["spec.model: spec.script runs your own training code", "spec.training: spec.script",
      "spec.data: spec.script"]),
    (script_job(checkpoint={"enabled": True}, parallelism={"ppMicrobatches": 4}),
     ["spec.checkpoint.enabled: spec.script saves its own",
      "spec.parallelism.ppMicrobatches: ppMicrobatches configures"]),
    # Data: a file source needs its path, jsonl a Hugging Face tokenizer.
    (manifest(data={"source": "jsonl"}), ["spec.data.path: data.source=jsonl needs data.path",
                                          "spec.data.tokenizer: data.source=jsonl needs a Hugging Face "
                                          "tokenizer"]),
    (manifest(data={"source": "tokens"}), ["spec.data.path: data.source=tokens needs data.path"]),
    (manifest(data={"source": "jsonl", "path": "/data/train.jsonl", "tokenizer": "/data/tokenizer"}), []),
    (manifest(data={"source": "text", "path": "/data/corpus.txt"}), []),
    (manifest(model={"vocab": 200}, data={"source": "text", "path": "/data/corpus.txt"}),
     ["spec.model.vocab: vocab=200 is below the 256 ids of the byte tokenizer"]),
    (manifest(model={"vocab": 200},
              data={"source": "text", "path": "/data/corpus.txt", "tokenizer": "/data/tok"}), []),
    (manifest(model={"vocab": 200}, data={"source": "tokens", "path": "/data/t.bin"}), []),
    # A model of one's own: kvHeads defaults to its heads.
    (manifest(model={"module": "m:d", "dim": 64, "layers": 2, "heads": 6, "vocab": 64, "seqLen": 48},
              nodes=1, nprocPerNode=3, parallelism={"tp": 3, "dpShard": 1, "pp": 1}), []),
    (manifest(model={"module": "m:d", "dim": 64, "layers": 2, "heads": 6, "kvHeads": 2, "vocab": 64,
                     "seqLen": 48},
              nodes=1, nprocPerNode=3, parallelism={"tp": 3, "dpShard": 1, "pp": 1}),
     ["tp=3 must divide heads=6 and kvHeads=2"]),
    # runPolicy: no always-retried code made permanent, no code in both lists (the permanent default counts),
    # a backoff cap at least the first delay.
    (manifest(runPolicy={"permanentExitCodes": [78, 75]}), ["exit codes 69 and 75 are always retried"]),
    (manifest(runPolicy={"retryableExitCodes": [78]}), ["in both retryableExitCodes and permanentExitCodes"]),
    (manifest(runPolicy={"retryableExitCodes": [78], "permanentExitCodes": [77]}), []),
    (manifest(runPolicy={"backoffSeconds": 60, "backoffMaxSeconds": 30}),
     ["backoffMaxSeconds=30 is below backoffSeconds=60"]),
    # elastic: minNodes within nodes, on the builtin gang
    (manifest(nodes=4, elastic={"minNodes": 2}, parallelism={"dpShard": "auto"}), []),
    (manifest(nodes=2, elastic={"minNodes": 3}), ["spec.elastic.minNodes: elastic.minNodes=3 is more than "
                                                  "nodes=2"]),
    (manifest(nodes=2, elastic={"minNodes": 1}, gang={"scheduler": "volcano"}),
     ["spec.elastic: elastic needs gang.scheduler: builtin"]),
]


@pytest.mark.parametrize("doc,expected", CASES)
def test_cel_spec_rules(doc, expected):
    failures = spec_rule_failures(doc)
    assert len(failures) == len(expected), failures
    for msg, words in zip(failures, expected, strict=True):
        assert words in msg


# The spec-level rules CEL and Python both express: CEL's (fieldPath, reason) -> whether a Python problem is
# that rule.
SHARED_RULES: dict[tuple[str, str], Any] = {
    (".parallelism", "FieldValueInvalid"):
        lambda p: p.field == "spec.parallelism" and "product of the degrees" in p.message,
    (".parallelism.tp", "FieldValueInvalid"): lambda p: p.field == "spec.parallelism.tp",
    (".model", "FieldValueInvalid"): lambda p: p.field == "spec.model.seqLen",
    (".parallelism.pp", "FieldValueInvalid"): lambda p: "stages exceed layers" in p.message,
    (".parallelism.ppMicrobatches", "FieldValueInvalid"):
        lambda p: p.field == "spec.parallelism.ppMicrobatches" and "is below" in p.message,
    (".resources.gpu", "FieldValueInvalid"): lambda p: p.field == "spec.resources.gpu",
    (".gang.queue", "FieldValueRequired"): lambda p: p.field == "spec.gang.queue",
    (".training.fsdp.offload", "FieldValueInvalid"): lambda p: p.field == "spec.training.fsdp.offload",
    (".training.float8.recipe", "FieldValueInvalid"): lambda p: p.field == "spec.training.float8.recipe",
    **{(f".{name}", "FieldValueForbidden"): (
        lambda p, name=name: p.field == f"spec.{name}" and "spec.script runs" in p.message)
       for name in ("model", "training", "data")},
    (".checkpoint.enabled", "FieldValueForbidden"): lambda p: p.field == "spec.checkpoint.enabled",
    (".data.path", "FieldValueRequired"): lambda p: p.field == "spec.data.path",
    (".data.tokenizer", "FieldValueInvalid"): lambda p: p.field == "spec.data.tokenizer",
    (".model.vocab", "FieldValueInvalid"): lambda p: p.field == "spec.model.vocab",
    **{(f".parallelism.{name}", "FieldValueForbidden"): (
        lambda p, name=name: p.field == f"spec.parallelism.{name}"
                             and "configures Tetrad's trainer's pipeline" in p.message)
       for name in ("ppMicrobatches", "ppStagesPerRank")},
    **{(f".runPolicy.{name}", "FieldValueInvalid"): (lambda p, name=name: p.field == f"spec.runPolicy.{name}")
       for name in ("permanentExitCodes", "retryableExitCodes", "backoffMaxSeconds")},
    (".elastic.minNodes", "FieldValueInvalid"):
        lambda p: p.field == "spec.elastic.minNodes" and "is more than nodes" in p.message,
    (".elastic", "FieldValueInvalid"): lambda p: p.field == "spec.elastic",
}
DEGREE_VALUES = [1, 2, 3, 4, 6, 8]


@st.composite
def model_specs(draw: Any) -> dict[str, Any]:
    """Valid models only (CEL leaves the model's own consistency to Python): a preset, maybe with
    layers or seqLen overridden, or explicit dims."""
    seq_len = st.sampled_from([8, 12, 16, 24, 32, 48, 100, 102, 128])
    if draw(st.booleans()):
        model: dict[str, Any] = {"preset": draw(st.sampled_from(list(PRESETS)))}
        if draw(st.booleans()):
            model["layers"] = draw(st.integers(1, 6))
        if draw(st.booleans()):
            model["seqLen"] = draw(seq_len)
        if draw(st.booleans()):  # below the byte tokenizer's 256 ids, or not
            model["vocab"] = draw(st.sampled_from([64, 512]))
        return model
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    return {"dim": heads * draw(st.sampled_from([8, 16])), "layers": draw(st.integers(1, 6)), "heads": heads,
            "kvHeads": kv_heads, "vocab": 64, "ffnDim": 32, "seqLen": draw(seq_len)}


@st.composite
def spec_documents(draw: Any, auto: bool) -> dict[str, Any]:
    """Manifests near the rules' edges: small worlds, degrees that often but not always multiply out."""
    nodes, nproc = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4, 6, 8]))
    degree = st.sampled_from([*DEGREE_VALUES, "auto"]) if auto else st.sampled_from(DEGREE_VALUES)
    parallelism: dict[str, Any] = {d: draw(degree) for d in ("dpShard", "tp", "cp", "pp")}
    if draw(st.booleans()):  # half the time degrees that multiply out to the world, so the other rules decide
        rest = nodes * nproc
        for d in ("tp", "cp", "pp"):
            parallelism[d] = draw(st.sampled_from([v for v in range(1, rest + 1) if rest % v == 0]))
            rest //= parallelism[d]
        parallelism["dpShard"] = rest
    parallelism["ppSchedule"] = draw(st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble"]))
    if draw(st.booleans()):
        parallelism["ppStagesPerRank"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        parallelism["ppMicrobatches"] = draw(st.integers(1, 16))
    gang: dict[str, Any] = {"scheduler": draw(st.sampled_from(["builtin", "kueue"]))}
    if draw(st.booleans()):
        gang["queue"] = "team-a"
    doc = manifest(nodes=nodes, nprocPerNode=nproc, parallelism=parallelism, model=draw(model_specs()),
                   resources={"gpu": draw(st.sampled_from([0, nproc, nproc + 1]))}, gang=gang,
                   training={"globalBatch": draw(st.sampled_from([8, 16, 48, 96])),
                             "fsdp": {"offload": draw(st.sampled_from(["none", "cpu"]))},
                             "float8": {"recipe": draw(st.sampled_from(["none", "tensorwise"]))},
                             "compile": draw(st.booleans()),
                             "precision": draw(st.sampled_from(["bf16", "fp32"]))})
    if draw(st.booleans()):  # data from a file, or not; with a path and a tokenizer, or not
        data: dict[str, Any] = {"source": draw(st.sampled_from(["synthetic", "text", "tokens", "jsonl"]))}
        if draw(st.booleans()):
            data["path"] = "/data/train"
        if draw(st.booleans()):
            data["tokenizer"] = draw(st.sampled_from(["byte", "/data/tokenizer"]))
        doc["spec"]["data"] = data
    run_policy: dict[str, Any] = {}
    codes = st.lists(st.sampled_from([1, 3, 69, 75, 77, 78, 79, 137, 255]), max_size=3)
    for name in ("permanentExitCodes", "retryableExitCodes"):
        if draw(st.booleans()):
            run_policy[name] = draw(codes)
    if draw(st.booleans()):
        run_policy["backoffSeconds"], run_policy["backoffMaxSeconds"] = (
            draw(st.sampled_from([0, 10, 60, 300])), draw(st.sampled_from([0, 10, 30, 300])))
    doc["spec"]["runPolicy"] = run_policy
    if draw(st.integers(0, 5)) == 0:  # a script job, with or without what only the trainer takes
        doc["spec"]["script"] = {"path": "/app/train.py"}
        for name in ("model", "training"):
            if draw(st.booleans()):
                del doc["spec"][name]
        if draw(st.booleans()):
            doc["spec"]["data"] = {"source": "synthetic"}
        doc["spec"]["checkpoint"] = {"enabled": draw(st.booleans())}
    if draw(st.booleans()):
        doc["spec"]["elastic"] = {"minNodes": draw(st.integers(1, 3))}
    return doc


def _python_rejects(problems: list[Problem]) -> set[tuple[str, str]]:
    errors = [p for p in problems if p.severity == "error"]
    return {path for path, matches in SHARED_RULES.items() if any(matches(p) for p in errors)}


def _cel_rejects(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(rule["fieldPath"], rule["reason"]) for rule, ok, _ in spec_rule_results(doc) if not ok}


def test_shared_rules_are_the_crd_spec_rules():
    assert {(r["fieldPath"], r["reason"]) for r in spec_rules()} == set(SHARED_RULES)


def test_cel_agrees_with_python_on_generated_specs():
    """With explicit degrees, each shared rule rejects in CEL iff it rejects in Python.

    Guard against passing vacuously: every rule must be seen both admitting and rejecting.
    """
    seen: Counter[tuple[tuple[str, str], bool]] = Counter()

    # derandomize: the same 300 specs every run, so the coverage guard below cannot fail by chance
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(spec_documents(auto=False))
    def agree(doc: dict[str, Any]) -> None:
        cel, python = _cel_rejects(doc), _python_rejects(validate_document(doc))
        assert cel == python, f"CEL rejects {sorted(cel)}, Python {sorted(python)}: {doc['spec']}"
        for path in SHARED_RULES:
            seen[path, path in cel] += 1
            event(f"{path} {'rejects' if path in cel else 'admits'}")

    agree()
    thin = {f"{path} {'rejects' if rejects else 'admits'}": seen[path, rejects]
            for path in SHARED_RULES for rejects in (True, False) if seen[path, rejects] < 5}
    assert not thin, f"the generated specs rarely reach these outcomes, widen the strategy: {thin}"


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_documents(auto=True))
def test_cel_never_rejects_what_python_admits(doc: dict[str, Any]) -> None:
    """With `auto` degrees CEL skips the layout rules (Python solves them first): CEL may admit more, never
    less."""
    if _cel_rejects(doc):
        assert [p for p in validate_document(doc) if p.severity == "error"]


def test_degree_rule():
    rule = schema()["properties"]["spec"]["properties"]["parallelism"]["properties"]["tp"][
        "x-kubernetes-validations"][0]
    assert _evaluate(rule, {"self": celpy.json_to_cel(2)})[0]
    assert _evaluate(rule, {"self": celpy.json_to_cel("auto")})[0]
    ok, msg = _evaluate(rule, {"self": celpy.json_to_cel(0)})
    assert not ok and "spec.parallelism.tp" in msg
    assert not _evaluate(rule, {"self": celpy.json_to_cel("many")})[0]
    # int-or-string: a quoted number reaches CEL as a string
    ok, msg = _evaluate(rule, {"self": celpy.json_to_cel("2")})
    assert not ok and 'not tp: "2"' in msg


def test_immutable_fields():
    props = schema()["properties"]["spec"]["properties"]
    for name in ("nodes", "nprocPerNode", "parallelism", "model", "script"):
        rule = next(r for r in props[name]["x-kubernetes-validations"] if "oldSelf" in r["rule"])
        old = celpy.json_to_cel({"x": 1})
        assert _evaluate(rule, {"self": old, "oldSelf": old})[0]
        ok, msg = _evaluate(rule, {"self": celpy.json_to_cel({"x": 2}), "oldSelf": old})
        assert not ok and f"spec.{name} is immutable" in msg
    assert "x-kubernetes-validations" not in props["runPolicy"], "runPolicy (suspend) must stay mutable"
    # model and script are optional: neither may appear or go (self == oldSelf sees only both present)
    for name in ("model", "script"):
        rule = next(r for r in schema()["properties"]["spec"]["x-kubernetes-validations"]
                    if r.get("fieldPath") == f".{name}" and "oldSelf" in r["rule"])
        with_it, without = celpy.json_to_cel({name: {"x": 1}}), celpy.json_to_cel({})
        assert _evaluate(rule, {"self": with_it, "oldSelf": with_it})[0]
        assert _evaluate(rule, {"self": without, "oldSelf": without})[0]
        for old, new in ((without, with_it), (with_it, without)):
            ok, msg = _evaluate(rule, {"self": new, "oldSelf": old})
            assert not ok and f"spec.{name} is immutable" in msg


def test_the_entry_point_and_plugin_rules() -> None:
    props = schema()["properties"]["spec"]["properties"]
    (entry,) = [r for r in props["script"]["x-kubernetes-validations"] if "oldSelf" not in r["rule"]]
    for entry_point, ok in (({"path": "/a.py"}, True), ({"module": "m"}, True), ({"command": ["x"]}, True),
                      ({}, False), ({"path": "/a.py", "module": "m"}, False)):
        assert _evaluate(entry, {"self": celpy.json_to_cel(entry_point)})[0] == ok, entry_point
    preset, dims, _, _, _ = [
        r for r in props["model"]["x-kubernetes-validations"] if "oldSelf" not in r["rule"]]
    full = {"module": "m:d", "dim": 64, "layers": 2, "heads": 4, "vocab": 64, "seqLen": 32}
    assert (_evaluate(preset, {"self": celpy.json_to_cel(full)})[0]
            and _evaluate(dims, {"self": celpy.json_to_cel(full)})[0])
    assert not _evaluate(preset, {"self": celpy.json_to_cel({**full, "preset": "debug"})})[0]
    ok, msg = _evaluate(dims, {"self": celpy.json_to_cel({"module": "m:d", "dim": 64})})
    assert not ok and "module needs its dims in spec.model" in msg
    assert _evaluate(dims, {"self": celpy.json_to_cel({"preset": "debug"})})[0], (
        "no module: the preset's dims")


def test_the_family_rules_say_what_python_says() -> None:
    """A Hugging Face directory the cluster cannot read needs a preset or the dims; a module is no family;
    family and preset agree. Each case is refused by CEL exactly when Python refuses it, naming the same
    field."""
    props = schema()["properties"]["spec"]["properties"]
    rules = [r for r in props["model"]["x-kubernetes-validations"] if "oldSelf" not in r["rule"]][2:]
    hf_dims = {"family": "qwen3", "dim": 64, "layers": 2, "heads": 4, "kvHeads": 2, "vocab": 64, "ffnDim": 96,
               "seqLen": 32, "ropeTheta": 1e6, "normEps": 1e-6}
    cases = [
        ({"hfDir": "/models/q"}, "spec.model.hfDir"),
        ({"hfDir": "/models/q", **{k: v for k, v in hf_dims.items() if k != "normEps"}}, "spec.model.hfDir"),
        ({"hfDir": "/models/q", **hf_dims}, None),
        ({"hfDir": "/models/q", "preset": "qwen3-1.7b"}, None),
        ({"preset": "qwen3-1.7b", "family": "qwen3"}, None),
        ({"preset": "qwen3-1.7b", "family": "llama"}, "spec.model.family"),
        ({"preset": "debug", "family": "qwen2"}, "spec.model.family"),
        ({"family": "qwen2"}, None),
        ({"module": "m:d", "dim": 64, "layers": 2, "heads": 4, "vocab": 64, "seqLen": 32, "family": "llama"},
         "spec.model.family"),
        ({"module": "m:d", "dim": 64, "layers": 2, "heads": 4, "vocab": 64, "seqLen": 32, "hfDir": "/m"},
         "spec.model.hfDir"),
    ]
    for model, field in cases:
        cel = [msg for rule in rules for ok, msg in [_evaluate(rule, {"self": celpy.json_to_cel(model)})]
               if not ok]
        python = [p for p in validate_document(manifest(model=model,
                                                        parallelism={"pp": 1, "tp": 1, "dpShard": 8}))
                  if p.severity == "error"]
        if field is None:
            assert cel == [] and python == [], (model, cel, python)
        else:
            assert len(cel) == 1 and cel[0].startswith(field.rsplit(".", 1)[0]), (model, cel)
            assert [p.field for p in python] == [field], (model, python)


def test_crd_yaml_round_trips():
    assert yaml.safe_load(crd_yaml()) == crd()
