"""The real-node tests share one session cluster, with the chart's operator installed once; the test
that takes it down runs last."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster_fixtures import HACK, RealCluster

LAST = "takes_cluster_down"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{LAST}: runs after every other test of the real-node cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # stable: the rest keep their order
    items.sort(key=lambda item: item.get_closest_marker(LAST) is not None)


@pytest.fixture(scope="session")
def installed(real_nodes: RealCluster) -> RealCluster:
    """Both images built (or taken from the cache), imported into every node, the chart installed."""
    proc = subprocess.run(
        [str(HACK / "e2e.sh"), "install"], capture_output=True, text=True, timeout=5400,
        env={**os.environ, "TETRAD_CLUSTER_NAME": real_nodes.name}, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return real_nodes
