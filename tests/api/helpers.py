"""Building manifests for API tests."""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "tetrad.dev/v1alpha1",
    "kind": "ParallelTrainingJob",
    "metadata": {"name": "t", "namespace": "ns"},
    "spec": {"nodes": 2, "nprocPerNode": 4, "parallelism": {"pp": 2, "dpShard": 2, "tp": 2},
             "training": {"globalBatch": 8}},
}


def manifest(**spec: Any) -> dict[str, Any]:
    """BASE with spec keys replaced (dicts merged one level deep)."""
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return doc


def container_env(pod: dict[str, Any], configmaps: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The environment the kubelet gives the pod's first container: each envFrom ConfigMap's data
    (`configmaps`: by name), then its env, which wins; a valueFrom stays as written."""
    c = pod["spec"]["containers"][0]
    env: dict[str, Any] = {}
    for source in c.get("envFrom") or []:
        ref = source["configMapRef"]["name"]
        env.update({source.get("prefix", "") + k: v for k, v in configmaps[ref].items()})
    env.update({e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []})
    return env


def rendered_env(rendered: Any, rank: int) -> dict[str, Any]:
    """What the rendered pod of `rank` sees: its env over the job's environment ConfigMap."""
    cm = rendered.environment
    return container_env(rendered.pods[rank], {cm["metadata"]["name"]: cm["data"]})
