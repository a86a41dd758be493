"""Shared fixtures: straight (never interrupted) toy runs, computed once per layout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint import gang, toy

LAYOUTS = {
    "dps2": {"dpShard": 2},
    "dps4": {"dpShard": 4},
    "tp2xdps2": {"tp": 2, "dpShard": 2},
    "dps1": {},
}


def world_of(layout: dict[str, int]) -> int:
    w = 1
    for d in layout.values():
        w *= d
    return w


def run_toy(layout: str, path: Path, **spec: Any) -> list[dict[str, Any]]:
    lay = LAYOUTS[layout]
    return gang.run(toy.train, world_of(lay), {"layout": lay, "path": str(path), **spec})


def assert_same_run(resumed: dict[str, Any], straight: dict[str, Any], steps: range,
                    tol: float = 0.0) -> None:
    """Losses at `steps` and the final parameters agree (exactly when tol == 0)."""
    for s in steps:
        a, b = straight["losses"][s], resumed["losses"][s]
        assert abs(a - b) <= tol * max(1.0, abs(a)), f"step {s}: loss {b!r} after resuming, {a!r} straight"
    for name, want in straight["params"].items():
        got = resumed["params"][name]
        if tol == 0.0:
            assert torch.equal(got, want), f"parameter {name} differs after resuming"
        else:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="session")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    cache: dict[str, list[dict[str, Any]]] = {}

    def get(layout: str) -> list[dict[str, Any]]:
        if layout not in cache:
            path = tmp_path_factory.mktemp(f"straight-{layout}")
            cache[layout] = run_toy(layout, path / "ckpt", steps=10, interval=1000)
            assert cache[layout][0]["resumed"] is None
        return cache[layout]

    return get


def manifest_of(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "MANIFEST.json").read_text())
