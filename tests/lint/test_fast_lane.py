"""The fast lane (`make test-unit`, `pytest --fast-lane`) needs no cluster and builds nothing from Go:
its collection leaves out the tests marked cluster, distributed or tools, and refuses one that reaches the
Go-built tools without such a marker."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import BUILT_TOOLS_FIXTURE, fast_lane_violations

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Item:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)


def test_a_test_that_reaches_the_built_tools_unmarked_is_a_violation() -> None:
    items = [Item("a", ["tmp_path"]), Item("b", ["namespace", "cluster", BUILT_TOOLS_FIXTURE])]
    assert fast_lane_violations(items) == ["b"]  # type: ignore[arg-type]


def test_the_fast_lanes_collection_needs_no_built_tool() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--fast-lane", "-p",
                        "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    assert len(collected) > 500 and not any("tests/operator/test_cluster_" in t or "tests/e2e/" in t
                                            for t in collected)
    assert "tests/lint/test_fast_lane.py::test_the_fast_lanes_collection_needs_no_built_tool" in collected
    assert not any("actionlint" in t for t in collected), "actionlint is built from Go modules: marked tools"
