"""Real pods on real nodes: two kubelets, each with its own containerd, CNI
bridges in 198.18.0.0/15, and CoreDNS (``hack/cluster.sh up --real-nodes 2``).

The last test crashes the nodes (SIGKILL to every kubelet and containerd,
pods left running) and checks that ``down`` still restores the host as it
was before ``up``: no link, netns, mount, cgroup, process, nftables rule or
sysctl of ours left.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster_fixtures import RealCluster, cluster_script, fresh_namespace, host_snapshot, wait_until

# One real-node cluster per machine: under pytest-xdist keep these tests on one worker (--dist loadgroup).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.xdist_group("real-nodes")]

BUSYBOX = "localhost/tetrad/busybox:local"
SERVER = 'while true; do echo "hello from $(hostname)" | nc -l -p 7000; done'


@pytest.fixture
def ns(real_nodes: RealCluster) -> Iterator[str]:
    yield from fresh_namespace(real_nodes, f"e2e-{uuid.uuid4().hex[:8]}")


def pod(name: str, node: str, command: str, restart: str = "Never", subdomain: str | None = None) -> dict:
    spec: dict = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": BUSYBOX, "command": ["sh", "-c", command]}],
    }
    if subdomain:
        spec |= {"hostname": name, "subdomain": subdomain}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "peers"}},
        "spec": spec,
    }


def phase(c: RealCluster, ns: str, name: str) -> str:
    return c.kubectl("get", "pod", name, "-n", ns, "-o", "jsonpath={.status.phase}")


def test_real_nodes_are_ready_and_run_the_control_planes_version(real_nodes: RealCluster) -> None:
    nodes = real_nodes.kubectl_json("get", "nodes", "-l", "tetrad.dev/real-node=true")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == real_nodes.node_names
    version = json.loads(real_nodes.kubectl("version", "-o", "json"))["serverVersion"]["gitVersion"]
    for n in nodes:
        info = n["status"]["nodeInfo"]
        assert info["kubeletVersion"] == version
        assert info["containerRuntimeVersion"].startswith("containerd://")
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"]
        assert ready == "True"
        (ip,) = [a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"]
        i = int(n["metadata"]["name"].rsplit("-", 1)[1])
        assert ip == f"198.18.{i}.1"


def test_pods_run_commands_and_report_exit_codes(real_nodes: RealCluster, ns: str) -> None:
    node0, node1 = real_nodes.node_names
    real_nodes.apply(pod("ok", node0, "echo ran on $(hostname)"), namespace=ns)
    real_nodes.apply(pod("fails", node1, "exit 3"), namespace=ns)
    wait_until(lambda: phase(real_nodes, ns, "ok") == "Succeeded", timeout=120, what="pod ok Succeeded")
    wait_until(lambda: phase(real_nodes, ns, "fails") == "Failed", timeout=120, what="pod fails Failed")
    state = real_nodes.kubectl_json("get", "pod", "fails", "-n", ns)["status"]["containerStatuses"][0][
        "state"
    ]
    assert state["terminated"]["exitCode"] == 3
    assert real_nodes.kubectl("logs", "-n", ns, "ok").strip() == "ran on ok"


def test_pods_on_two_nodes_reach_each_other_by_ip_and_headless_dns_name(
    real_nodes: RealCluster, ns: str
) -> None:
    node0, node1 = real_nodes.node_names
    real_nodes.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "peers"},
            "spec": {"clusterIP": "None", "selector": {"app": "peers"}, "ports": [{"port": 7000}]},
        },
        namespace=ns,
    )
    real_nodes.apply(pod("a", node0, f"echo a is up; {SERVER}", "Always", "peers"), namespace=ns)
    real_nodes.apply(pod("b", node1, f"echo b is up; {SERVER}", "Always", "peers"), namespace=ns)
    for name in ("a", "b"):
        wait_until(
            lambda n=name: phase(real_nodes, ns, n) == "Running", timeout=120, what=f"pod {name} Running"
        )
    pods = {p["metadata"]["name"]: p for p in real_nodes.kubectl_json("get", "pods", "-n", ns)["items"]}
    assert {pods["a"]["spec"]["nodeName"], pods["b"]["spec"]["nodeName"]} == {node0, node1}
    ip_a = pods["a"]["status"]["podIP"]
    assert ip_a.startswith("198.18.0.") and pods["b"]["status"]["podIP"].startswith("198.18.1.")

    def ask(target: str) -> str | None:
        proc = real_nodes.run_kubectl(
            "exec", "-n", ns, "b", "--", "nc", "-w", "5", target, "7000", timeout=30
        )
        return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None

    assert wait_until(lambda: ask(ip_a), timeout=60, what="b -> a by IP") == "hello from a"
    # pod 0's name as the renderer writes it: hostname.subdomain, through the pod's search path
    assert wait_until(lambda: ask("a.peers"), timeout=60, what="b -> a.peers") == "hello from a"
    fqdn = f"a.peers.{ns}.svc.cluster.local"
    lookup = real_nodes.kubectl("exec", "-n", ns, "b", "--", "nslookup", fqdn)
    assert ip_a in lookup
    assert real_nodes.kubectl("logs", "-n", ns, "a").splitlines()[0] == "a is up"


def test_load_refuses_an_image_the_disk_cannot_hold_before_importing_anything(
    real_nodes: RealCluster, tmp_path: Path
) -> None:
    """A full disk would make the kubelets evict pods and drop images no registry can give back."""
    huge = tmp_path / "huge.tar"
    with huge.open("wb") as f:
        f.truncate(8 << 40)  # sparse: 8 TiB by its size, nothing on the disk
    load = cluster_script("load", str(huge), name=real_nodes.name, timeout=60)
    assert load.returncode != 0
    assert ("not enough disk for the images of 2 real node(s): about 32772 GiB needed"
            in load.stderr), load.stderr
    assert "Free some space" in load.stderr


@pytest.mark.takes_cluster_down
def test_down_after_a_crash_restores_the_host(real_nodes: RealCluster, ns: str) -> None:
    """Last of the real-node tests (tests/e2e/conftest.py): it takes the session's cluster down."""
    node0, _ = real_nodes.node_names
    real_nodes.apply(pod("survivor", node0, "sleep 3600"), namespace=ns)
    wait_until(lambda: phase(real_nodes, ns, "survivor") == "Running", timeout=120, what="pod Running")
    run = real_nodes.state / "run"
    daemons = sorted(run.glob("kubelet-*.pid")) + sorted(run.glob("containerd-*.pid"))
    assert len(daemons) == 2 * len(real_nodes.node_names)
    for f in daemons:  # a crash: no daemon gets to clean up, the pods keep running
        os.killpg(_pids(f), signal.SIGKILL)
    after_crash = host_snapshot()
    assert after_crash["links"] - real_nodes.host_before["links"], "the crash should leave our links"

    down = cluster_script("down", name=real_nodes.name, timeout=300)
    assert down.returncode == 0, down.stderr
    after = host_snapshot()
    for key, before in real_nodes.host_before.items():
        assert after[key] == before, f"{key} differs after down"
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, str(real_nodes.state))]
    assert not left, f"processes of the cluster still running: {left}"


def _pids(pid_file: Path) -> int:
    return int(pid_file.read_text().split()[0])


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
