"""The local control plane behaves like a real cluster where Tetrad needs it to."""

from __future__ import annotations

import ipaddress
import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from tests.cluster_fixtures import Cluster, KubectlError, wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
TETRAD_CRD = REPO / "crds" / "tetrad.dev_paralleltrainingjobs.yaml"
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def pinned_kubernetes_version() -> str:
    text = (REPO / "hack" / "tools" / "go.mod").read_text()
    match = re.search(r"^(?:require)?\s*k8s\.io/kubernetes (v\S+)", text, re.M)
    assert match, "hack/tools/go.mod must pin k8s.io/kubernetes"
    return match.group(1)


def pod(name: str, gpus: int = 0, owner: dict | None = None) -> dict:
    container: dict = {"name": "main", "image": "tetrad/trainer:test"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    meta: dict = {"name": name, "labels": {"app": "tetrad-test"}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 30},
    }


def get_pod(cluster: Cluster, ns: str, name: str) -> dict:
    return cluster.kubectl_json("get", "pod", name, "-n", ns)


def wait_running(cluster: Cluster, ns: str, name: str, timeout: float = 60) -> dict:
    def probe() -> dict | None:
        p = get_pod(cluster, ns, name)
        return p if p["status"].get("phase") == "Running" and p["status"].get("podIP") else None

    return wait_until(probe, timeout=timeout, what=f"pod {ns}/{name} Running with a podIP")


def test_version_is_the_pinned_release(cluster: Cluster) -> None:
    want = pinned_kubernetes_version()
    server = json.loads(cluster.kubectl("get", "--raw", "/version"))
    assert server["gitVersion"] == want
    assert (server["major"], server["minor"]) == tuple(want[1:].split(".")[:2])
    assert server["gitTreeState"] == "clean"
    client = json.loads(cluster.kubectl("version", "--client", "-o", "json"))["clientVersion"]
    assert client["gitVersion"] == want


BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
SERVICE_RANGE = ipaddress.ip_network("198.19.0.0/16")


def test_fake_gpu_nodes_are_ready_with_topology(cluster: Cluster) -> None:
    nodes = cluster.kubectl_json("get", "nodes", "-l", "tetrad.dev/fake-gpu-node=true")["items"]
    assert len(nodes) == int(cluster.env["NODES"])
    gpus = cluster.env["GPUS_PER_NODE"]
    cidrs = set()
    for node in nodes:
        labels = node["metadata"]["labels"]
        for key in ("topology.kubernetes.io/zone", "tetrad.dev/rack", "nvidia.com/nvlink-domain"):
            assert labels.get(key), f"{node['metadata']['name']} lacks label {key}"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == gpus
        assert node["status"]["capacity"]["nvidia.com/gpu"] == gpus
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert ready["Ready"] == "True"
        cidrs.add(node["spec"]["podCIDR"])
        # Made-up addresses stay in the benchmark range, never a private or public network's.
        internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal and all(ipaddress.ip_address(a) in BENCHMARK_RANGE for a in internal), internal
        assert ipaddress.ip_network(node["spec"]["podCIDR"]).subnet_of(BENCHMARK_RANGE)
        assert not ipaddress.ip_network(node["spec"]["podCIDR"]).overlaps(SERVICE_RANGE)
    assert len(cidrs) == len(nodes), "each node needs its own pod CIDR"

    # Liveness comes from node leases; kwok must keep renewing them.
    name = nodes[0]["metadata"]["name"]
    lease = cluster.kubectl_json("get", "lease", name, "-n", "kube-node-lease")
    renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
    assert (datetime.now(UTC) - renewed).total_seconds() < lease["spec"]["leaseDurationSeconds"]


def _install_crd(cluster: Cluster, manifest: str, name: str) -> None:
    cluster.apply(manifest)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


def test_inline_crd_cel_rule_rejects_bad_object(cluster: Cluster, namespace: str) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.celtest.tetrad.dev"},
        "spec": {
            "group": "celtest.tetrad.dev",
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "replicas": {"type": "integer"},
                                        "maxReplicas": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.replicas <= self.maxReplicas",
                                            "message": "replicas must not exceed maxReplicas",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    _install_crd(cluster, json.dumps(crd), "widgets.celtest.tetrad.dev")

    def widget(name: str, replicas: int) -> dict:
        return {
            "apiVersion": "celtest.tetrad.dev/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "maxReplicas": 4},
        }

    cluster.apply(widget("good", 3), namespace=namespace)
    with pytest.raises(KubectlError) as err:
        cluster.apply(widget("bad", 5), namespace=namespace)
    assert "replicas must not exceed maxReplicas" in err.value.stderr


@pytest.mark.skipif(
    not TETRAD_CRD.exists(), reason="crds/tetrad.dev_paralleltrainingjobs.yaml not generated yet"
)
def test_tetrad_crd_rejects_degrees_that_do_not_fill_the_gang(cluster: Cluster, namespace: str) -> None:
    _install_crd(cluster, TETRAD_CRD.read_text(), "paralleltrainingjobs.tetrad.dev")
    job = yaml.safe_load(QUICKSTART.read_text())
    cluster.apply(job, namespace=namespace)  # the shipped example is valid

    bad = json.loads(json.dumps(job))
    bad["metadata"]["name"] = "bad-product"
    spec = bad["spec"]
    spec["parallelism"].update({"pp": 2, "dpShard": 3, "tp": 2, "cp": 1, "dpReplicate": 1})
    assert spec["nodes"] * spec["nprocPerNode"] != 2 * 3 * 2
    with pytest.raises(KubectlError) as err:
        cluster.apply(bad, namespace=namespace)
    assert "spec.parallelism" in err.value.stderr
    assert "nodes*nprocPerNode" in err.value.stderr


def test_gpu_pod_is_scheduled_and_runs_on_a_fake_node(cluster: Cluster, namespace: str) -> None:
    gpus = int(cluster.env["GPUS_PER_NODE"])
    cluster.apply(pod("trainer-0", gpus=gpus), namespace=namespace)
    p = wait_running(cluster, namespace, "trainer-0")

    node = cluster.kubectl_json("get", "node", p["spec"]["nodeName"])
    assert node["metadata"]["labels"]["tetrad.dev/fake-gpu-node"] == "true"
    assert ipaddress.ip_address(p["status"]["podIP"]) in ipaddress.ip_network(node["spec"]["podCIDR"])
    assert p["status"]["hostIP"] == next(
        a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"
    )
    assert p["status"]["containerStatuses"][0]["state"].get("running")

    # No node has more GPUs than that: the next one stays Pending, unschedulable.
    cluster.apply(pod("too-big", gpus=gpus + 1), namespace=namespace)

    def unschedulable() -> bool:
        conds = get_pod(cluster, namespace, "too-big")["status"].get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    wait_until(unschedulable, timeout=30, what="too-big to be Unschedulable")


def test_patched_terminal_phase_is_not_overwritten(cluster: Cluster, namespace: str) -> None:
    """Tests play the kubelet for exits; kwok must only ever take pods to Running."""
    for name in ("ok", "crash"):
        cluster.apply(pod(name), namespace=namespace)
    for name in ("ok", "crash"):
        wait_running(cluster, namespace, name)

    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name, phase, code in (("ok", "Succeeded", 0), ("crash", "Failed", 137)):
        status = {
            "status": {
                "phase": phase,
                "containerStatuses": [
                    {
                        "name": "main",
                        "image": "tetrad/trainer:test",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": code,
                                "reason": "Completed" if code == 0 else "Error",
                                "startedAt": now,
                                "finishedAt": now,
                            }
                        },
                    }
                ],
            }
        }
        cluster.kubectl(
            "patch",
            "pod",
            name,
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )

    time.sleep(3)  # give kwok every chance to (wrongly) react
    for name, phase, code in (("ok", "Succeeded", 0), ("crash", "Failed", 137)):
        st = get_pod(cluster, namespace, name)["status"]
        assert st["phase"] == phase
        assert st["containerStatuses"][0]["state"]["terminated"]["exitCode"] == code


def test_deleting_the_owner_garbage_collects_pods(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "owner", "-n", namespace)
    uid = cluster.kubectl("get", "configmap", "owner", "-n", namespace, "-o", "jsonpath={.metadata.uid}")
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
    names = [f"worker-{i}" for i in range(3)]
    for name in names:
        cluster.apply(pod(name, gpus=1, owner=owner), namespace=namespace)
    for name in names:
        wait_running(cluster, namespace, name)

    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def gone() -> bool:
        return (
            cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=tetrad-test", "-o", "name").strip()
            == ""
        )

    wait_until(gone, timeout=60, what="owned pods to be garbage-collected")


def test_namespace_deletion_completes(cluster: Cluster) -> None:
    ns = f"t-nsdel-{int(time.time() * 1000) % 100000}"
    cluster.kubectl("create", "namespace", ns)
    wait_until(
        lambda: cluster.run_kubectl("get", "sa", "default", "-n", ns).returncode == 0,
        timeout=30,
        what="default ServiceAccount",
    )
    cluster.apply(pod("p", gpus=1), namespace=ns)
    wait_running(cluster, ns, "p")
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    wait_until(
        lambda: cluster.run_kubectl("get", "namespace", ns).returncode != 0,
        timeout=90,
        what=f"namespace {ns} to be deleted",
    )
