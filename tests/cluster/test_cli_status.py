"""The generated CRD and `tetrad status` in the real apiserver, no operator: the tests write the
status subresource as the operator would.

kubectl 1.36 explains an int-or-string field of a CRD as <Object> (its template reads only `type`;
built-in types show <IntOrString> through their $ref); what the apiserver publishes is checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster_fixtures import Cluster, KubectlError, install_tetrad_crd, table_row, wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
def job(name: str, parallelism: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
        "spec": {"nodes": 2, "nprocPerNode": 8, "resources": {"gpu": 8}, "parallelism": parallelism,
                 "model": {"preset": "llama3-1b", "seqLen": 8192},
                 "training": {"steps": 1000, "globalBatch": 16}},
    }


def published_degree(cluster: Cluster) -> dict[str, Any] | None:
    doc = json.loads(cluster.kubectl("get", "--raw", "/openapi/v3/apis/tetrad.dev/v1alpha1"))
    schema = doc["components"]["schemas"].get("dev.tetrad.v1alpha1.ParallelTrainingJob")
    return schema["properties"]["spec"]["properties"]["parallelism"]["properties"]["tp"] if schema else None


def test_degrees_are_int_or_string_and_cel_still_checks_them(cluster: Cluster, namespace: str) -> None:
    install_tetrad_crd(cluster)
    tp = wait_until(lambda: published_degree(cluster), timeout=60, what="the CRD's OpenAPI v3 schema")
    assert tp["x-kubernetes-int-or-string"] is True and "type" not in tp
    assert tp["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    explained = cluster.kubectl("explain", "paralleltrainingjobs.spec.parallelism.tp")
    assert "FIELD: tp <" in explained and "An integer >= 1 or 'auto'" in " ".join(explained.split())

    cluster.apply(job("tp-auto", {"tp": "auto", "dpShard": "auto"}), namespace=namespace)
    cluster.apply(job("tp-two", {"tp": 2, "dpShard": "auto"}), namespace=namespace)
    stored = cluster.kubectl_json("get", "ptj", "tp-auto", "tp-two", "-n", namespace)["items"]
    assert [j["spec"]["parallelism"]["tp"] for j in stored] == ["auto", 2]

    for name, parallelism, words in [
        ("tp-quoted", {"tp": "2", "dpShard": "auto"},
         'spec.parallelism.tp must be an integer >= 1, unquoted (tp: 2, not tp: "2")'),
        ("tp-zero", {"tp": 0, "dpShard": "auto"}, "spec.parallelism.tp must be an integer >= 1"),
        ("tp-three", {"tp": 3, "dpShard": 5, "pp": 1}, "tp=3 must divide heads=32 and kvHeads=8"),
    ]:
        with pytest.raises(KubectlError) as err:
            cluster.apply(job(name, parallelism), namespace=namespace)
        assert words in err.value.stderr, err.value.stderr


def tetrad_status(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run([sys.executable, "-m", "tetrad.cli", "status", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)


def test_tetrad_status_and_wide_columns_show_a_running_job(cluster: Cluster, namespace: str) -> None:
    install_tetrad_crd(cluster)
    cluster.apply(job("watched", {"tp": 2, "dpShard": "auto"}), namespace=namespace)
    # 16 sequences x 8192 tokens per step at 65536 tokens/s: 2 s a step, 600 steps left: 20 minutes.
    status = {"phase": "Running", "mesh": "pp1.dpr1.dps8.cp1.tp2", "worldSize": 16, "restarts": 1,
              "disruptions": 1, "startTime": "2026-01-01T00:00:00Z",
              "training": {"step": 400, "loss": 2.5, "tokensPerSecond": 65536.0, "mfu": 0.42,
                           "peakMemoryBytes": 40 * 2**30, "updated": "2026-01-01T01:00:00Z"},
              "goodput": {"fraction": 0.8312, "wallSeconds": 3600.0,
                          "seconds": {"productive": 2992.32, "restarts": 607.68}}}
    cluster.kubectl("patch", "ptj", "watched", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))

    r = tetrad_status(cluster, "watched", "-n", namespace)
    assert r.returncode == 0, r.stderr
    shown = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in r.stdout.splitlines())}
    assert shown["Job"] == f"{namespace}/watched" and shown["Phase"] == "Running"
    assert shown["Model"] == "llama3-1b (seqLen 8192)"
    assert shown["Mesh"] == "pp1.dpr1.dps8.cp1.tp2 on 2 nodes x 8 processes"
    assert shown["Progress"] == "step 400 / 1000 (40.0%), ETA 20m00s"
    assert (shown["Tokens/s"], shown["MFU"], shown["Loss"]) == ("65,536", "42.0%", "2.5000")
    assert shown["Restarts"] == "1 (1 of them disruptions, not counted against maxRestarts)"
    assert shown["Goodput"].startswith("83.1% of 1h00m trained; lost: restarts 10m0"), shown["Goodput"]

    r = tetrad_status(cluster, "watched", "-n", namespace, "-o", "json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["step"], summary["steps"], summary["stepSeconds"], summary["etaSeconds"]) == (
        400, 1000, 2.0, 1200.0)

    r = tetrad_status(cluster, "missing", "-n", namespace)
    assert r.returncode == 1 and f"ParallelTrainingJob {namespace}/missing not found" in r.stderr, r.stderr

    wide = cluster.kubectl("get", "ptj", "watched", "-n", namespace, "-o", "wide").splitlines()
    assert table_row(wide[0], wide[1]) | {"AGE": ""} == {
        "NAME": "watched", "PHASE": "Running", "NODES": "2", "RUNNING-NODES": "",
        "MESH": "pp1.dpr1.dps8.cp1.tp2", "RESTARTS": "1", "TOKENS/S": "65536", "LAST-CKPT": "", "STEP": "400",
        "STEPS": "1000", "LOSS": "2.5", "MFU": "0.42", "GOODPUT": "0.8312", "AGE": ""}
