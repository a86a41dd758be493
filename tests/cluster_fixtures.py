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
``real_nodes`` (session)
    A separate instance with real nodes (``hack/cluster.sh up --real-nodes 2``:
    a kubelet and a containerd each, CNI bridges in 198.18.0.0/15, CoreDNS)
    beside one kwok node; needs root. Yields a :class:`RealCluster`, which
    also holds a snapshot of the host taken before ``up`` so that a test can
    check that ``down`` restored it.

Environment
-----------
``TETRAD_SKIP_CLUSTER=1``  skip ``cluster`` tests instead of building/starting.
``TETRAD_KEEP_CLUSTER=1``  leave the cluster running after the session (a
                          cluster that was already running is always left).
``TETRAD_NODES`` etc.      shape of the fake nodes, see ``hack/cluster.sh``.
``TETRAD_REAL_CLUSTER_NAME`` name of the ``real_nodes`` instance (default pytest-real).

Under pytest-xdist every worker gets its own cluster instance.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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
TETRAD_CRD = REPO / "crds" / "tetrad.dev_paralleltrainingjobs.yaml"
T = TypeVar("T")
UNANSWERED = "Unable to connect to the server"  # what kubectl says of a request that got no answer
UNANSWERED_RETRIES = 4  # after 1, 2, 4 and 8 s


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
        """Run kubectl and return stdout; raise :class:`KubectlError` on failure. A call that got no answer
        (kubectl: "Unable to connect to the server", such as a TLS handshake that timed out on a loaded
        machine) is made again, up to UNANSWERED_RETRIES times: the test's own client is not what it tests."""
        for attempt in range(UNANSWERED_RETRIES + 1):
            proc = self.run_kubectl(*args, input=input, timeout=timeout)
            if proc.returncode == 0:
                return proc.stdout
            if UNANSWERED not in proc.stderr or attempt == UNANSWERED_RETRIES:
                break
            time.sleep(2 ** attempt)
        raise KubectlError(args, proc)

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


def stop_cluster(name: str, missing_ok: bool = False) -> None:
    """``hack/cluster.sh down``; missing_ok: a cluster this machine never brought up is fine."""
    down = cluster_script("down", name=name, timeout=300)
    if missing_ok and down.returncode != 0 and "error: no such cluster" in down.stderr:
        return
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


REAL_NODES = 2
HOST_SYSCTLS = (
    "net.ipv4.ip_forward",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
HOST_DIRS = (
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
    "/var/lib/cni",
    "/run/netns",
    "/run/containerd",
)


def host_snapshot() -> dict[str, Any]:
    """What real nodes change on the host: links, netns, mounts, top-level
    cgroups, the nftables ruleset, sysctls and the kubelet's fixed dirs."""

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    def rules(text: str) -> str:  # without comments (dates) and packet counters
        text = re.sub(r"\[\d+:\d+\]|counter packets \d+ bytes \d+", "", text)
        return "\n".join(line for line in text.splitlines() if not line.startswith("#"))

    links = {line.split(": ")[1].split("@")[0] for line in run("ip", "-o", "link", "show").splitlines()}
    mounts = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    cgroups = {
        f"{h.name}/{d.name}"
        for h in Path("/sys/fs/cgroup").iterdir()
        if h.is_dir() and not h.is_symlink()
        for d in h.iterdir()
        if d.is_dir()
    }
    return {
        "links": links,
        "netns": sorted(Path("/run/netns").iterdir()) if Path("/run/netns").is_dir() else [],
        "mounts": mounts,
        "cgroups": cgroups,
        "nft": rules(run("nft", "list", "ruleset")),
        "iptables-legacy": rules(run("iptables-legacy-save")) if shutil.which("iptables-legacy-save") else "",
        "sysctls": {k: Path("/proc/sys", *k.split(".")).read_text() for k in HOST_SYSCTLS},
        "dirs": {d for d in HOST_DIRS if Path(d).exists()},
    }


def node_processes(pod_uid: str, workers_only: bool = False) -> list[int]:
    """PIDs on this machine that belong to the pod's trainer container (its cgroup names the pod): the
    supervisor, torchrun and the workers, or only the workers (torchrun gives them a LOCAL_RANK)."""
    needle = f"pod{pod_uid}"
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cgroups = (proc / "cgroup").read_text()
                cmdline = (proc / "cmdline").read_bytes()
                environ = (proc / "environ").read_bytes().split(b"\0") if workers_only else []
            except OSError:
                continue
            if needle in cgroups and b"tetrad-node.pyz" in cmdline and (
                    not workers_only or any(v.startswith(b"LOCAL_RANK=") for v in environ)):
                pids.append(int(proc.name))
    return pids


FAKE_NODE_TAINT = "tetrad.dev/fake-node=true:NoSchedule"


@dataclass
class RealCluster(Cluster):
    """A :class:`Cluster` whose ``real-node-<i>`` nodes run a kubelet and containerd."""

    host_before: dict[str, Any] = field(default_factory=dict)

    @property
    def node_names(self) -> list[str]:
        return [f"real-node-{i}" for i in range(int(self.env["REAL_NODES_UP"]))]

    @property
    def state(self) -> Path:
        return Path(self.env["TETRAD_CLUSTER_STATE"])


@pytest.fixture(scope="session")
def real_nodes(k8s_tools: Path) -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (bridges, cgroups, containerd)")
    name = os.environ.get("TETRAD_REAL_CLUSTER_NAME", "pytest-real")
    # A real-node cluster is the only one of its kind on a machine; `down` also removes what a crashed
    # earlier run of it left on the host (links, mounts, cgroups), so the snapshot is of a clean host. On a
    # fresh machine there is none yet.
    stop_cluster(name, missing_ok=True)
    before = host_snapshot()
    # One kwok node beside the real ones, tainted so that no workload of these tests lands on it.
    extra = {"TETRAD_NODES": "1", "TETRAD_REAL_NODES": str(REAL_NODES), "TETRAD_NODE_TAINT": FAKE_NODE_TAINT}
    c = start_cluster(name, extra_env=extra)
    try:
        yield RealCluster(**vars(c), host_before=before)
    finally:
        if os.environ.get("TETRAD_KEEP_CLUSTER") != "1":
            stop_cluster(name)


def _namespace_name(nodeid: str) -> str:
    test = re.sub(r"[^a-z0-9-]+", "-", nodeid.split("::")[-1].lower()).strip("-")
    return f"t-{test[:44].rstrip('-')}-{uuid.uuid4().hex[:6]}"


def table_row(header: str, row: str) -> dict[str, str]:
    """A row of kubectl's table output by the header's column positions; an empty cell stays ""."""
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, bounds, strict=True)}


def install_tetrad_crd(cluster: Cluster, timeout: float = 300) -> None:
    """Apply the generated ParallelTrainingJob CRD (taking over its fields) and wait until kubectl can
    list its objects. Each step is retried until `timeout`: a cluster just started, on a machine the other
    lane loads, may refuse or time out a request for a while."""
    wait_until(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(TETRAD_CRD)),
               timeout, interval=2, what="the ParallelTrainingJob CRD applied")
    wait_until(lambda: cluster.kubectl("get", "paralleltrainingjobs.tetrad.dev", "-A") is not None,
               timeout, interval=1, what="the ParallelTrainingJob CRD served")


@pytest.fixture(scope="module")
def tetrad_crd(cluster: Cluster) -> Cluster:
    """The cluster with the ParallelTrainingJob CRD installed."""
    install_tetrad_crd(cluster)
    return cluster


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists (pods can be created)."""
    name = _namespace_name(request.node.nodeid)
    yield from fresh_namespace(cluster, name)


def fresh_namespace(cluster: Cluster, name: str) -> Iterator[str]:
    """Create ``name``, wait for its default ServiceAccount, yield it, delete it (not waiting)."""
    cluster.kubectl("create", "namespace", name)
    wait_until(
        lambda: cluster.run_kubectl("get", "serviceaccount", "default", "-n", name).returncode == 0,
        timeout=120,  # the controller-manager makes it; on a loaded machine, seconds late
        what=f"default ServiceAccount in {name}",
    )
    try:
        yield name
    finally:
        cluster.run_kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
