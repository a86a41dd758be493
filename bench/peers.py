"""The peers bench/operator_bench.py measures Tetrad against, each started by `hack/cluster.sh peer`
(hack/cluster/peers.sh) and given the job its users would write for N workers of the pods Tetrad's
job has (8 GPUs, 8 CPUs, 64Gi each):

- kubeflow-v1: a PyTorchJob of one Master and N-1 Workers (training-operator v1);
- kubeflow-v1-tuned: the same, the training-operator tuned to 500 API requests/s (burst 1,000; its
  default is 20, burst 30);
- kubeflow-v1-coscheduling: the same, with the operator's gang scheduling through scheduler-plugins
  (a PodGroup per job);
- jobset: a JobSet of one replicated Job of N indexed pods;
- kubeflow-trainer: a TrainJob of N nodes on the torch-distributed ClusterTrainingRuntime (Kubeflow
  Trainer v2, which makes a JobSet of it).

Each gets a minimal pod (one container: image, command, resources), or with `with_pod` the content
of Tetrad's own pod (its env, ports, volumes and security settings), so that the controllers are
compared on pods of the same size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IMAGE = "tetrad/trainer:0.1.0"  # never pulled: kwok runs the pods
RESOURCES = {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"},
             "limits": {"nvidia.com/gpu": "8"}}


Resources = dict[str, dict[str, str]]


def _container(name: str, resources: Resources) -> dict[str, Any]:
    return {"name": name, "image": IMAGE, "command": ["torchrun", "train.py"], "resources": resources}


def pytorchjob(name: str, pods: int, resources: Resources = RESOURCES) -> dict[str, Any]:
    def replicas(n: int) -> dict[str, Any]:
        return {"replicas": n, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [_container("pytorch", resources)]}}}

    specs = {"Master": replicas(1)} | ({"Worker": replicas(pods - 1)} if pods > 1 else {})
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"pytorchReplicaSpecs": specs}}


def jobset(name: str, pods: int, resources: Resources = RESOURCES) -> dict[str, Any]:
    job = {"parallelism": pods, "completions": pods, "completionMode": "Indexed", "backoffLimit": 0,
           "template": {"spec": {"restartPolicy": "Never", "containers": [_container("node", resources)]}}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name},
            "spec": {"replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]}}


def trainjob(name: str, pods: int, resources: Resources = RESOURCES) -> dict[str, Any]:
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": name},
            "spec": {"runtimeRef": {"name": "torch-distributed"},
                     "trainer": {"numNodes": pods, "image": IMAGE, "resourcesPerNode": resources}}}


def with_pod(body: Callable[..., dict[str, Any]], pod: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    """`body`'s job with `pod`'s content in each of its pod templates: the first container's envFrom,
    env, ports, mounts and security context, the pod's volumes and security settings (its own name,
    image, command and resources stay). A job without a pod template in it (a TrainJob: its
    runtime holds the template) is left as it is."""
    container_keys = ("envFrom", "env", "ports", "volumeMounts", "securityContext")
    pod_keys = ("volumes", "securityContext", "enableServiceLinks", "automountServiceAccountToken",
                "terminationGracePeriodSeconds")
    content = pod["spec"]

    def fill(node: Any) -> None:
        if isinstance(node, dict):
            if "containers" in node:  # a PodSpec
                node.update({k: content[k] for k in pod_keys if k in content})
                node["containers"][0].update({k: content["containers"][0][k] for k in container_keys
                                              if k in content["containers"][0]})
            for v in node.values():
                fill(v)
        elif isinstance(node, list):
            for v in node:
                fill(v)

    def job(name: str, pods: int, *args: Any) -> dict[str, Any]:
        out = body(name, pods, *args)
        fill(out)
        return out

    return job


def _condition_running(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Running" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


@dataclass(frozen=True)
class Peer:
    name: str  # hack/cluster.sh peer NAME
    # its processes (hack/cluster.sh's pid files): their CPU and memory are its cost
    components: tuple[str, ...]
    api: str  # group/version of its job
    plural: str
    body: Callable[..., dict[str, Any]]  # (name, pods[, resources])
    running: Callable[[dict[str, Any]], bool] | None = None  # its job's own "Running", where it has one

    def jobs(self, ns: str) -> str:
        return f"/apis/{self.api}/namespaces/{ns}/{self.plural}"


PEERS = {p.name: p for p in (
    Peer("kubeflow-v1", ("training-operator",), "kubeflow.org/v1", "pytorchjobs", pytorchjob,
         _condition_running),
    Peer("kubeflow-v1-tuned", ("training-operator",), "kubeflow.org/v1", "pytorchjobs", pytorchjob,
         _condition_running),
    Peer("kubeflow-v1-coscheduling", ("training-operator",), "kubeflow.org/v1", "pytorchjobs", pytorchjob,
         _condition_running),
    Peer("jobset", ("jobset",), "jobset.x-k8s.io/v1alpha2", "jobsets", jobset),
    Peer("kubeflow-trainer", ("kubeflow-trainer", "jobset"), "trainer.kubeflow.org/v1alpha1", "trainjobs",
         trainjob),
)}
