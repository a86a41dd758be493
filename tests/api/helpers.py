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
