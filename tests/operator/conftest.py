"""Fixtures for the operator's cluster tests: CRDs, a REST helper, and operators to run.

Cluster tests (marked `cluster`) use the real control plane of tests/cluster_fixtures.py with
kwok nodes. The operator runs in-process (a thread with its own event loop) for most tests,
and as a `python -m tetrad_operator` subprocess where it must be SIGKILLed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "tests.cluster_fixtures"
CRDS = [REPO / "crds" / "tetrad.dev_paralleltrainingjobs.yaml", REPO / "crds" / "kopf.dev_peerings.yaml",
        *sorted((Path(__file__).parent / "crds").glob("*.yaml"))]

# Fast operator settings for tests (seconds).
FAST_ENV = {
    "TETRAD_OPERATOR_RESYNC_SECONDS": "2",
    "TETRAD_OPERATOR_BATCH_SECONDS": "0.02",
    "TETRAD_OPERATOR_ADMISSION_RETRY_SECONDS": "1",
    "TETRAD_OPERATOR_SCRAPE_INTERVAL_SECONDS": "1",
    "TETRAD_OPERATOR_NODE_LOST_SECONDS": "5",
    "TETRAD_OPERATOR_STUCK_TERMINATING_SECONDS": "5",
    "TETRAD_OPERATOR_NODE_UNKNOWN_SECONDS": "2",
    "TETRAD_OPERATOR_PEERING_LIFETIME_SECONDS": "10",
    # kwok pods have made-up IPs: the operator reads rank 0's metrics from loopback instead, so no
    # test ever sends a packet towards an address outside this machine.
    "TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1",
}


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN):
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        config.pluginmanager.import_plugin(PLUGIN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def operator_cluster(cluster: Any) -> Iterator[Any]:
    """The cluster with the operator's CRDs installed and KUBECONFIG pointing at it."""
    for crd in CRDS:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    # In-process operators log in through the kubernetes client (kopf's login_via_client), whose
    # default kubeconfig path was fixed from $KUBECONFIG when the module was first imported.
    from kubernetes.config import kube_config

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(cluster.kubeconfig))
        mp.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))
        yield cluster


def gang_scheduler(cluster: Any, name: str) -> Any:
    """`hack/cluster.sh scheduler NAME` beside the cluster (it stops with the cluster)."""
    from tests.cluster_fixtures import cluster_script

    up = cluster_script("scheduler", name, name=cluster.name, timeout=1800)
    if up.returncode:
        raise RuntimeError(f"hack/cluster.sh scheduler {name} failed ({up.returncode}):\n{up.stderr[-6000:]}")
    return cluster


@pytest.fixture(scope="session")
def coscheduling(operator_cluster: Any) -> Any:
    """The scheduler-plugins scheduler (Coscheduling) and its PodGroup controller."""
    return gang_scheduler(operator_cluster, "coscheduling")


@pytest.fixture(scope="session")
def kueue(operator_cluster: Any) -> Any:
    """The Kueue manager with its pod-group integration and webhooks."""
    return gang_scheduler(operator_cluster, "kueue")


@pytest.fixture(scope="session")
def api(operator_cluster: Any) -> Any:
    from tests.operator.helpers import Api

    return Api(operator_cluster.kubeconfig)


@dataclass
class InProcessOperator:
    namespaces: list[str]
    metrics_port: int
    memo: Any
    stop: threading.Event
    thread: threading.Thread
    errors: list[BaseException] = field(default_factory=list)

    @property
    def controller(self) -> Any:
        return self.memo.controller

    def shutdown(self, timeout: float = 30) -> None:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the operator did not stop"
        assert not self.errors, f"the operator crashed: {self.errors!r}"


@contextmanager
def operator_in_thread(namespaces: list[str], *, peering: str | None = None, priority: int | None = None,
                       env: dict[str, str] | None = None) -> Iterator[InProcessOperator]:
    import kopf
    from tetrad_operator.main import serve
    from tetrad_operator.settings import OperatorSettings

    config = OperatorSettings.from_env({**FAST_ENV, **(env or {})})
    stop, ready = threading.Event(), threading.Event()
    memo = kopf.Memo()
    port = free_port()
    op: InProcessOperator

    def target() -> None:
        try:
            asyncio.run(serve(namespaces, False, port, peering, peering is None, config=config,
                              priority=priority, stop_flag=stop, ready_flag=ready, memo=memo))
        except BaseException as e:  # surfaced by shutdown()
            op.errors.append(e)

    thread = threading.Thread(target=target, name=f"operator {namespaces}", daemon=True)
    op = InProcessOperator(namespaces, port, memo, stop, thread)
    thread.start()
    assert ready.wait(60), "the operator did not start"
    try:
        yield op
    finally:
        op.shutdown()


@pytest.fixture
def operator(operator_cluster: Any, namespace: str) -> Iterator[InProcessOperator]:
    """An in-process operator watching only this test's namespace."""
    with operator_in_thread([namespace]) as op:
        yield op


@pytest.fixture
def pool(api: Any, namespace: str) -> Iterator[Any]:
    """Nodes of this test only (8 cpu each), selected by a label; removed afterwards.
    `pool(n, cpu=..., labels={...})` adds n of them with extra labels (a rack, say)."""
    from tests.operator.helpers import fake_node

    label = {"tetrad.dev/test-pool": namespace}
    created: list[str] = []

    def add(n: int = 1, cpu: str = "8", labels: dict[str, str] | None = None,
            taints: list[dict[str, str]] | None = None) -> list[str]:
        """Returns once they take pods (`takes_pods`): a gang's fit counts those only. Tainted,
        they take only pods that tolerate the taints (no other test's pod lands there)."""
        from tests.operator.helpers import takes_pods, wait_for

        names = []
        for _ in range(n):
            name = f"{namespace}-n{len(created)}"
            api.create("/api/v1/nodes", fake_node(name, cpu=cpu, labels={**label, **(labels or {})},
                                                  taints=taints))
            created.append(name)
            names.append(name)
        from tetrad_operator.observed import NodeState

        def ready(name: str) -> bool:
            node = api.get(f"/api/v1/nodes/{name}")
            return node is not None and takes_pods(NodeState.from_body(node))

        wait_for(lambda: all(map(ready, names)), what=f"nodes {names} Ready without the not-ready taint")
        return names

    add.label = label  # type: ignore[attr-defined]
    yield add
    for name in created:
        api.delete(f"/api/v1/nodes/{name}")


def operator_process(namespace: str, *, kubeconfig: Path | str, log: Path, env: dict[str, str] | None = None,
                     metrics_port: int = 0, peering: str | None = None) -> subprocess.Popen[bytes]:
    """`python -m tetrad_operator -n NS --standalone` (or `--peering NAME`) as a child process
    (SIGKILL-able)."""
    full_env = {**os.environ, **FAST_ENV, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tetrad_operator", "-n", namespace,
             *(["--peering", peering] if peering else ["--standalone"]), "--metrics-port", str(metrics_port)],
            env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
