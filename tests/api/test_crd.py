"""The generated CRD: no drift from the model, structural, described, and CEL rules that behave.

The CEL rules are evaluated with cel-python here; tests/cluster also runs them in a real apiserver.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from tests.api.helpers import manifest
from tetrad.api.crd import crd, crd_yaml
from tetrad.api.spec import ParallelTrainingJobSpec
from tetrad.api.validation import validate_document

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
        assert not any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf", "title")), path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        elif not node.get("x-kubernetes-preserve-unknown-fields"):
            assert "type" in node, path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_crd_metadata():
    c = crd()["spec"]
    assert c["names"]["shortNames"] == ["ptj"]
    v = c["versions"][0]
    assert v["subresources"] == {"status": {}}
    assert [col["name"] for col in v["additionalPrinterColumns"]] == ["Phase", "Nodes", "Mesh", "Restarts", "Tokens/s", "Age"]


def _defaulted(doc: dict[str, Any]) -> Any:
    """The spec as the apiserver stores it: CRD defaults applied (the model's defaults are the same)."""
    spec = ParallelTrainingJobSpec.model_validate(doc["spec"]).model_dump(by_alias=True, exclude_none=True, mode="json")
    return celpy.json_to_cel(spec)


def _cel_format(text: Any, args: Any) -> Any:
    """The Kubernetes CEL strings extension's format() for %d/%s, which cel-python lacks."""
    values = iter(args)
    return celpy.celtypes.StringType(re.sub(r"%[ds]", lambda _: str(next(values)), str(text)))


def _evaluate(rule: dict[str, str], activation: dict[str, Any]) -> tuple[bool, str]:
    env = celpy.Environment()
    ok = bool(env.program(env.compile(rule["rule"])).evaluate(activation))
    if ok:
        return True, ""
    if "messageExpression" in rule:
        program = env.program(env.compile(rule["messageExpression"]), functions={"format": _cel_format})
        return False, str(program.evaluate(activation))
    return False, rule["message"]


def spec_rule_failures(doc: dict[str, Any]) -> list[str]:
    activation = {"self": _defaulted(doc)}
    results = [_evaluate(r, activation) for r in schema()["properties"]["spec"]["x-kubernetes-validations"]]
    return [msg for ok, msg in results if not ok]


CASES = [
    (manifest(), []),
    (manifest(parallelism={"tp": 4}), ["product of the degrees dpReplicate*dpShard*tp*cp*pp = 1*2*4*1*2 = 16"]),
    (manifest(nodes=1, nprocPerNode=6, parallelism={"pp": 1, "tp": 3, "dpShard": 2}), ["tp=3 must divide heads=8 and kvHeads=4", "tp*2*cp = 6"]),
    (manifest(model={"seqLen": 102}), ["seqLen=102 must be divisible by tp*2*cp = 4"]),
    (manifest(model={"preset": "llama3-8b", "heads": 6, "kvHeads": 6, "dim": 4092}, parallelism={"tp": 4, "pp": 1}),
     ["tp=4 must divide heads=6 and kvHeads=6"]),
    (manifest(nodes=1, nprocPerNode=8, parallelism={"pp": 8, "dpShard": 1, "tp": 1}), ["pp=8 exceeds layers=4"]),
    (manifest(parallelism={"ppMicrobatches": 1}), ["ppMicrobatches=1 is below pp=2"]),
    (manifest(resources={"gpu": 2}), ["gpu=2 must equal nprocPerNode=4"]),
    (manifest(gang={"scheduler": "kueue"}), ["needs gang.queue"]),
    (manifest(parallelism={"dpShard": "auto", "tp": "auto"}), []),
]


@pytest.mark.parametrize("doc,expected", CASES)
def test_cel_spec_rules(doc, expected):
    failures = spec_rule_failures(doc)
    assert len(failures) == len(expected), failures
    for msg, words in zip(failures, expected, strict=True):
        assert words in msg


@pytest.mark.parametrize("doc,expected", CASES)
def test_cel_agrees_with_python(doc, expected):
    """Whatever CEL rejects, the Python validation rejects too (it checks strictly more)."""
    if expected:
        assert [p for p in validate_document(doc) if p.severity == "error"]


def test_degree_rule():
    rule = schema()["properties"]["spec"]["properties"]["parallelism"]["properties"]["tp"]["x-kubernetes-validations"][0]
    assert _evaluate(rule, {"self": celpy.json_to_cel(2)})[0]
    assert _evaluate(rule, {"self": celpy.json_to_cel("auto")})[0]
    ok, msg = _evaluate(rule, {"self": celpy.json_to_cel(0)})
    assert not ok and "spec.parallelism.tp" in msg
    assert not _evaluate(rule, {"self": celpy.json_to_cel("many")})[0]


def test_immutable_fields():
    props = schema()["properties"]["spec"]["properties"]
    for name in ("nodes", "nprocPerNode", "parallelism", "model"):
        rule = next(r for r in props[name]["x-kubernetes-validations"] if "oldSelf" in r["rule"])
        old = celpy.json_to_cel({"x": 1})
        assert _evaluate(rule, {"self": old, "oldSelf": old})[0]
        ok, msg = _evaluate(rule, {"self": celpy.json_to_cel({"x": 2}), "oldSelf": old})
        assert not ok and f"spec.{name} is immutable" in msg
    assert "x-kubernetes-validations" not in props["runPolicy"], "runPolicy (suspend) must stay mutable"


def test_crd_yaml_round_trips():
    assert yaml.safe_load(crd_yaml()) == crd()
