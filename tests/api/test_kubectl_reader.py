"""Tetrad reads a manifest as kubectl does (tetrad.api.scalars): the numbers, booleans and keys the API
server gets, not YAML 1.1's. With the marker `tools`, kubectl itself reads every example and test
manifest (`kubectl patch --local -o json`, the YAML-to-JSON reader of `kubectl create` and `apply`
without a server: `create --dry-run=client` needs the API's discovery to map the kind) and hypothesis
feeds both readers generated scalars."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tetrad.api.manifest import ManifestError, load_manifests, reads_as_string
from tetrad.cli import app
from tetrad.cli.yamlout import dump_all

ROOT = Path(__file__).parents[2]
HERE = Path(__file__).parent / "manifests"
# Every file of Kubernetes objects among the examples and the tests' inputs.
MANIFESTS = sorted([*ROOT.glob("examples/**/*.yaml"), *HERE.glob("*.yaml"),
                    *(Path(__file__).parent / "kubeflow").glob("*.yaml")])


def canonical(value: Any) -> Any:
    """A value as the API server holds it: an integer beyond int64 is a float64 (kubectl's printer writes
    float64 2**63 as 9223372036854776000, which Python's json reads back as that integer)."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return float(value)
    return value


def typed(value: Any) -> Any:
    """The value with each scalar's type beside it: 2 and 2.0 (or 1 and True) compare unequal."""
    value = canonical(value)
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


def test_numbers_kubectl_reads_as_numbers_validate():
    """`lr: 3e-4`, `normEps: 1e-5`: numbers to kubectl and the API server, text to YAML 1.1."""
    result = CliRunner().invoke(app, ["validate", str(HERE / "numbers.yaml")])
    assert result.exit_code == 0, result.output
    (doc,) = load_manifests((HERE / "numbers.yaml").read_text())
    spec = doc["spec"]
    assert spec["training"] == {"steps": 100, "lr": 0.0003, "minLr": 3e-05, "weightDecay": 0.1, "gradClip": 1,
                                "globalBatch": 8}
    assert (spec["model"]["normEps"], spec["model"]["ropeTheta"], spec["model"]["seqLen"]) == (
        1e-05, 500000, 128)
    assert type(spec["training"]["steps"]) is int and type(spec["training"]["gradClip"]) is int


def test_the_loader_reads_scalars_as_kubectl_printed_them():
    """scalars.kubectl.json is kubectl's reading of scalars.yaml (checked against kubectl below, marker
    tools)."""
    (mine,) = load_manifests((HERE / "scalars.yaml").read_text())
    assert typed(mine) == typed(json.loads((HERE / "scalars.kubectl.json").read_text()))


@pytest.mark.parametrize("text",
                         ["1e3", "3e-4", "08", "+.5", "0o17", "y", "N", "1_000", ".5e3", "0x1F", "2.0", "~"])
def test_render_quotes_a_string_kubectl_would_read_as_something_else(text):
    assert not reads_as_string(text)
    out = dump_all([{"value": text}])
    assert out == f'value: "{text}"\n'
    assert load_manifests(out) == [{"value": text}] and yaml.safe_load(out) == {"value": text}


@pytest.mark.parametrize("text", ["abc", "1:30", "1.2.3", "_1", "0b", "yes please", "2001-12-14"])
def test_render_writes_plain_what_every_reader_reads_as_that_string(text):
    assert reads_as_string(text)
    assert load_manifests(dump_all([{"value": text}])) == [{"value": text}]


# -- kubectl itself -------------------------------------------------------------------------------

def kubectl_reads(kubectl: Path, path: Path, tmp_path: Path) -> list[Any]:
    """The objects of `path` as kubectl reads them, without a server (an empty kubeconfig)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    proc = subprocess.run([str(kubectl), "--kubeconfig", str(kubeconfig), "patch", "--local", "-f", str(path),
                           "--type", "merge", "-p", "{}", "-o", "json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"{path}: {proc.stderr}"
    decoder, text, at, docs = json.JSONDecoder(), proc.stdout, 0, []
    while (at := len(text) - len(text[at:].lstrip())) < len(text):  # one JSON object per document
        doc, at = decoder.raw_decode(text, at)
        docs.append(doc)
    return docs


@pytest.mark.tools
def test_every_example_and_test_manifest_reads_the_same_in_kubectl(k8s_tools: Path, tmp_path: Path) -> None:
    assert len(MANIFESTS) >= 30 and HERE / "numbers.yaml" in MANIFESTS
    for path in MANIFESTS:
        assert typed(load_manifests(path.read_text())) == typed(
            kubectl_reads(k8s_tools / "kubectl", path, tmp_path)), path


# Plain scalars near go-yaml's and YAML 1.1's rules: signs, prefixes, dots, exponents, underscores, words.
_pieces = st.sampled_from(["0", "1", "7", "8", "9", "0x", "0o", "0b", "x", "o", "b", "e", "E", "e-", "e+",
                           ".", "_", "+", "-", "1f", "inf", "nan", "y", "n", "on", "Off", "~", ":", "12"])
_scalars = st.lists(_pieces, min_size=1, max_size=6).map("".join).filter(
    lambda s: s[0] not in "-:" or (len(s) > 1 and s[1] not in " :"))


@pytest.mark.tools
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_scalars, min_size=1, max_size=60, unique=True))
def test_generated_scalars_read_the_same_in_kubectl(k8s_tools: Path, tmp_path_factory: pytest.TempPathFactory,
                                                    scalars: list[str]) -> None:
    """Each generated scalar, as a value and as a key, in one file that kubectl reads once."""
    tmp_path = tmp_path_factory.mktemp("scalars")
    path = tmp_path / "scalars.yaml"
    values = "".join(f"  v{i}: {s}\n" for i, s in enumerate(scalars))
    path.write_text(
        f"apiVersion: tetrad.dev/v1alpha1\nkind: Scalars\nmetadata: {{name: s}}\nvalues:\n{values}")
    try:
        (mine,) = load_manifests(path.read_text())
    except ManifestError:  # what Tetrad refuses (not YAML: `v: 1:`), kubectl refuses too
        with pytest.raises(AssertionError):
            kubectl_reads(k8s_tools / "kubectl", path, tmp_path)
        return
    if any(isinstance(v, float) and v != v or v in (float("inf"), float("-inf"))
           for v in mine["values"].values()):
        return  # .nan and .inf: JSON has none, kubectl refuses the file; the model refuses them as not finite
    (theirs,) = kubectl_reads(k8s_tools / "kubectl", path, tmp_path)
    assert typed(mine["values"]) == typed(theirs["values"])


@pytest.mark.tools
def test_generated_keys_read_the_same_in_kubectl(k8s_tools: Path, tmp_path: Path) -> None:
    keys = ["1", "0x10", "1.5", "0.1", "1e3", "1e6", "1e-5", "-0.0", "y", "off", "123456.0", "1000000.5",
            "3.14159265358979", "16777217.0", "1e30", "017", "08", "2_000", "+5", "-7"]
    path = tmp_path / "keys.yaml"
    path.write_text("apiVersion: tetrad.dev/v1alpha1\nkind: Scalars\nmetadata: {name: k}\nkeys:\n"
                    + "".join(f"  {k}: v{i}\n" for i, k in enumerate(keys)))
    (mine,) = load_manifests(path.read_text())
    (theirs,) = kubectl_reads(k8s_tools / "kubectl", path, tmp_path)
    assert mine["keys"] == theirs["keys"]
