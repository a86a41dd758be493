"""pytest plugin: a real local Kubernetes control plane for tests.

Fixtures
--------
``k8s_tools`` (session)
    The directory with every pinned binary (kubectl, helm, kwokctl, ...),
    building whatever is missing with ``hack/k8s-tools.sh`` (30+ minutes cold
    on two cores, under a second warm).
``cluster`` (session)
    Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
    kwok with fake GPU nodes through ``hack/cluster.sh up`` (building the
    pinned binaries first with ``hack/k8s-tools.sh`` if they are missing) and
    stops everything at the end of the session. Yields a :class:`Cluster`.
``namespace`` (function)
    A fresh namespace per test, deleted afterwards.

Environment
-----------
``TETRAD_SKIP_CLUSTER=1``  skip ``cluster`` tests instead of building/starting.
``TETRAD_KEEP_CLUSTER=1``  leave the cluster running after the session (a
                          cluster that was already running is always left).
``TETRAD_NODES`` etc.      shape of the fake nodes, see ``hack/cluster.sh``.

Under pytest-xdist every worker gets its own cluster instance.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
HACK = REPO / "hack"
T = TypeVar("T")


class KubectlError(RuntimeError):
    def __init__(self, args: tuple[str, ...], proc: subprocess.CompletedProcess[str]):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        super().__init__(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")


@dataclass
class Cluster:
    """A running control plane started by ``hack/cluster.sh``."""

    name: str
    kubeconfig: Path
    api_url: str
    bin_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    def run_kubectl(
        self, *args: str, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; never raises on a non-zero exit."""
        return subprocess.run(
            [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        """Run kubectl and return stdout; raise :class:`KubectlError` on failure."""
        proc = self.run_kubectl(*args, input=input, timeout=timeout)
        if proc.returncode != 0:
            raise KubectlError(args, proc)
        return proc.stdout

    def kubectl_json(self, *args: str, timeout: float = 120) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout))

    def apply(self, manifest: str | dict[str, Any], namespace: str | None = None) -> str:
        """``kubectl apply -f -`` for a YAML/JSON string or an object."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text)

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this cluster (imported lazily)."""
        from kubernetes import client, config

        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig), client_configuration=client.Configuration()
        )


def wait_until(
    probe: Callable[[], T | None], timeout: float = 30, interval: float = 0.25, what: str = "condition"
) -> T:
    """Call ``probe`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except (KubectlError, subprocess.TimeoutExpired) as exc:
            last_exc = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_exc})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(interval)


def _read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


def cluster_script(
    *args: str, name: str, extra_env: dict[str, str] | None = None, timeout: float = 3600
) -> subprocess.CompletedProcess[str]:
    """Run ``hack/cluster.sh`` for the instance ``name``; output is captured."""
    env = {**os.environ, "TETRAD_CLUSTER_NAME": name, **(extra_env or {})}
    return subprocess.run(
        [str(HACK / "cluster.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def build_tools() -> Path:
    """``hack/k8s-tools.sh``: build every pinned tool that is missing (a no-op
    taking well under a second when all are built); return the bin dir."""
    proc = subprocess.run(
        [str(HACK / "k8s-tools.sh"), "build"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=7200,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"hack/k8s-tools.sh failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
        )
    return tools_bin_dir()


def tools_bin_dir() -> Path:
    return Path(
        subprocess.run(
            [str(HACK / "k8s-tools.sh"), "bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )


def start_cluster(name: str, extra_env: dict[str, str] | None = None) -> Cluster:
    """``hack/cluster.sh up`` (it builds the control-plane tools when needed)."""
    up = cluster_script("up", name=name, extra_env=extra_env)
    if up.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh up failed ({up.returncode}):\n{up.stderr[-6000:]}")
    env_file = Path(cluster_script("env", name=name).stdout.strip())
    env = _read_env(env_file)
    return Cluster(
        name=name,
        kubeconfig=Path(env["KUBECONFIG"]),
        api_url=env["APISERVER_URL"],
        bin_dir=tools_bin_dir(),
        env=env,
    )


def stop_cluster(name: str) -> None:
    down = cluster_script("down", name=name, timeout=300)
    if down.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh down failed ({down.returncode}):\n{down.stderr[-4000:]}")


def _is_running(name: str) -> bool:
    return cluster_script("status", name=name, timeout=60).returncode == 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: needs the local Kubernetes control plane (hack/cluster.sh)")


@pytest.fixture(scope="session")
def k8s_tools() -> Path:
    """Directory holding every pinned tool (kubectl, helm, kwokctl, ...), built if missing."""
    if os.environ.get("TETRAD_SKIP_CLUSTER") == "1":
        pytest.skip("TETRAD_SKIP_CLUSTER=1")
    return build_tools()


@pytest.fixture(scope="session")
def cluster(k8s_tools: Path) -> Iterator[Cluster]:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    default = f"pytest-{worker}" if worker else "pytest"
    name = os.environ.get("TETRAD_CLUSTER_NAME", default)
    already_running = _is_running(name)
    c = start_cluster(name)
    try:
        yield c
    finally:
        if not already_running and os.environ.get("TETRAD_KEEP_CLUSTER") != "1":
            stop_cluster(name)


def _namespace_name(nodeid: str) -> str:
    test = re.sub(r"[^a-z0-9-]+", "-", nodeid.split("::")[-1].lower()).strip("-")
    return f"t-{test[:44].rstrip('-')}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists (pods can be created)."""
    name = _namespace_name(request.node.nodeid)
    cluster.kubectl("create", "namespace", name)
    wait_until(
        lambda: cluster.run_kubectl("get", "serviceaccount", "default", "-n", name).returncode == 0,
        timeout=30,
        what=f"default ServiceAccount in {name}",
    )
    try:
        yield name
    finally:
        cluster.run_kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
