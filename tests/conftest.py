"""Suite-wide pytest setup: the cluster fixtures are shared by tests/cluster and tests/operator, and
`--fast-lane` (what `make test-unit` runs) keeps only the tests that need neither a cluster, nor process
groups, nor a tool built from Go modules."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.cluster_fixtures"]

# Markers of the tests the fast lane leaves out, and the fixture that builds the Go tools (hack/k8s-tools.sh):
# a fast-lane test that reaches it, however indirectly, is a marking mistake, reported at collection.
SLOW_LANE_MARKERS = ("cluster", "distributed", "tools")
BUILT_TOOLS_FIXTURE = "k8s_tools"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast-lane", action="store_true",
                     help=f"only tests marked none of {', '.join(SLOW_LANE_MARKERS)}: "
                          f"no cluster, no Go build")


def fast_lane_violations(items: list[pytest.Item]) -> list[str]:
    """The fast-lane tests that would build the Go tools: each must carry one of SLOW_LANE_MARKERS."""
    return [item.nodeid for item in items if BUILT_TOOLS_FIXTURE in getattr(item, "fixturenames", ())]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast-lane"):
        return
    slow = [i for i in items if any(i.get_closest_marker(m) for m in SLOW_LANE_MARKERS)]
    items[:] = [i for i in items if i not in slow]
    config.hook.pytest_deselected(items=slow)
    if violations := fast_lane_violations(items):
        raise pytest.UsageError(f"these tests need the Go-built tools ({BUILT_TOOLS_FIXTURE}) "
                                f"but carry none of the markers {SLOW_LANE_MARKERS}: {', '.join(violations)}")
