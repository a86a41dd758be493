"""The real-node tests share one session cluster; the test that takes it down runs last."""

from __future__ import annotations

import pytest

LAST = "takes_cluster_down"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{LAST}: runs after every other test of the real-node cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker(LAST) is not None)  # stable: the rest keep their order
