"""render(job) -> the Kubernetes objects the operator creates. A pure function of the job.

Objects: a headless Service (publishNotReadyAddresses, so pod 0's DNS name resolves before it
is Ready), a ConfigMap with the resolved trainer config and the node launcher (tetrad.node.bundle: the
pods' command runs it with the image's python3), a ConfigMap with the environment every
pod shares (`env.job_env`, taken through envFrom: each pod carries only what sets it apart, which
makes it about a fifth smaller for every client that reads it), one Pod per node, and the gang
objects.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tetrad.api import ParallelTrainingJob, ParallelTrainingJobSpec, ResolvedConfig, contract
from tetrad.api.contract import API_VERSION, KIND
from tetrad.node import rounds
from tetrad.node.bundle import launcher
from tetrad.render import gangs, names
from tetrad.render.command import node_command
from tetrad.render.env import job_env, node_env, rounds_env
from tetrad.resolve import resolve

RUN_AS_USER = 1000
CONFIG_PATH = f"{contract.CONFIG_DIR}/{contract.CONFIG_FILE}"
LAUNCHER_PATH = f"{contract.CONFIG_DIR}/{contract.LAUNCHER_FILE}"
CHECKPOINT_REQUEST_PATH = f"{contract.POD_INFO_DIR}/{contract.CHECKPOINT_REQUEST_FILE}"
PYTHON = "python3"  # what the pods' command runs: the image's own interpreter, with torch
# torchrun's grace for workers after SIGTERM: the pod's grace period less time to exit.
SHUTDOWN_MARGIN_SECONDS = 10


def _copy(data: Any) -> Any:
    """A deep copy of JSON-like data (dicts, lists, scalars): each pod owns its objects.
    Five times faster than copy.deepcopy, which dominated rendering a large gang."""
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copy(v) for v in data]
    return data


@dataclass
class Rendered:
    config: ResolvedConfig
    service: dict[str, Any]
    configmap: dict[str, Any]
    environment: dict[str, Any]  # a ConfigMap: the environment every pod takes through envFrom
    pods: list[dict[str, Any]]
    # the scheduler's group objects, in creation order
    gang: list[dict[str, Any]] = field(default_factory=list)

    def gang_objects(self) -> list[dict[str, Any]]:
        return self.gang

    @property
    def pod_group(self) -> dict[str, Any] | None:
        return self._gang_object("PodGroup")

    @property
    def workload(self) -> dict[str, Any] | None:
        return self._gang_object("Workload")

    def _gang_object(self, kind: str) -> dict[str, Any] | None:
        return next((o for o in self.gang if o["kind"] == kind), None)

    def objects(self) -> list[dict[str, Any]]:
        return [self.service, self.configmap, self.environment, *self.gang_objects(), *self.pods]


def owner_references(job: ParallelTrainingJob) -> list[dict[str, Any]]:
    if not job.metadata.uid:
        return []
    return [{"apiVersion": API_VERSION, "kind": KIND, "name": job.metadata.name, "uid": job.metadata.uid,
             "controller": True, "blockOwnerDeletion": True}]


def _meta(job: ParallelTrainingJob, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {contract.LABEL_JOB: job.metadata.name, contract.LABEL_MANAGED_BY: contract.MANAGED_BY,
                   **(labels or {})},
        "annotations": {},
    }
    if refs := owner_references(job):
        meta["ownerReferences"] = refs
    return meta


def _ports(job: ParallelTrainingJob) -> list[dict[str, Any]]:
    spec = job.spec
    ports = [{"name": "rendezvous", "port": spec.rendezvous.port, "protocol": "TCP"}]
    ports += [{"name": f"metrics-{i}", "port": spec.metrics.port + i, "protocol": "TCP"}
              for i in range(spec.nproc_per_node)]
    return ports


def service(job: ParallelTrainingJob) -> dict[str, Any]:
    """Headless, for pod 0's DNS name (the rendezvous); it selects no other pod: nothing looks up
    theirs, and an endpoint per pod would cost an EndpointSlice update for every pod of a gang."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(job, names.service(job.metadata.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {contract.LABEL_JOB: job.metadata.name, contract.LABEL_RANK: "0"},
            "ports": _ports(job),
        },
    }


@functools.cache
def _launcher_base64() -> str:
    return base64.b64encode(launcher()).decode()


def configmap(job: ParallelTrainingJob, cfg: ResolvedConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, names.configmap(job.metadata.name)),
            "data": {contract.CONFIG_FILE: cfg.to_json()},
            "binaryData": {contract.LAUNCHER_FILE: _launcher_base64()}}


def environment(job: ParallelTrainingJob, cfg: ResolvedConfig) -> dict[str, Any]:
    """The job's `env.job_env` as a ConfigMap, the same for every pod of every incarnation."""
    spec, name = job.spec, job.metadata.name
    env = job_env(cfg, master_addr=names.master_addr(name, job.metadata.namespace),
                  master_port=spec.rendezvous.port, config_path=CONFIG_PATH,
                  rdzv_timeout=spec.rendezvous.timeout_seconds, shutdown_timeout=shutdown_timeout(spec))
    env[contract.ENV_CHECKPOINT_REQUEST_FILE] = CHECKPOINT_REQUEST_PATH  # rank 0 reads it
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, names.environment(name)),
            "data": env}


def _resources(job: ParallelTrainingJob) -> dict[str, Any]:
    r = job.spec.resources
    amounts: dict[str, Any] = {k: v for k, v in (("cpu", r.cpu), ("memory", r.memory)) if v}
    if r.gpu:
        amounts["nvidia.com/gpu"] = r.gpu
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _volumes(job: ParallelTrainingJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = job.spec
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for name, path in contract.POD_VOLUMES.items():  # the config, the pod's info, then writable scratch paths
        if path == contract.CONFIG_DIR:
            volumes.append({"name": name, "configMap": {"name": names.configmap(job.metadata.name)}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
        elif path == contract.POD_INFO_DIR:
            volumes.append({"name": name, "downwardAPI": {"items": [{
                "path": contract.CHECKPOINT_REQUEST_FILE, "fieldRef": {
                    "fieldPath": f"metadata.annotations['{contract.ANNOTATION_CHECKPOINT_NOW}']"}}]}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
        else:
            volumes.append({"name": name, "emptyDir": {"medium": "Memory"} if path == "/dev/shm" else {}})
            mounts.append({"name": name, "mountPath": path})
    if spec.checkpoint.volume:
        volumes.append({"name": contract.CHECKPOINT_VOLUME, **spec.checkpoint.volume})
        mounts.append({"name": contract.CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path})
    volumes += _copy(spec.template.volumes)
    mounts += _copy(spec.template.volume_mounts)
    return volumes, mounts


SECURE_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def shutdown_timeout(spec: ParallelTrainingJobSpec) -> int:
    """torchrun's --shutdown-timeout of a node, in a pod and under `tetrad run` alike."""
    return max(1, spec.run_policy.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS)


def avoiding(affinity: dict[str, Any] | None, nodes: Sequence[str]) -> dict[str, Any] | None:
    """`affinity` (copied) with a required node anti-affinity for `nodes`: every required node selector
    term also excludes them by name (terms are ORed, expressions in a term ANDed)."""
    if not nodes:
        return _copy(affinity) if affinity else None
    out = _copy(affinity) if affinity else {}
    required = out.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution",
                                                             {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchFields", []).append(
            {"key": "metadata.name", "operator": "NotIn", "values": sorted(set(nodes))})
    return out


def rounds_port(spec: ParallelTrainingJobSpec) -> int:
    """Where pod 0's coordinator of restarts in place listens."""
    return spec.rendezvous.port + contract.ROUNDS_PORT_OFFSET


def rounds_gang(job: ParallelTrainingJob, restart: int) -> str:
    """The id incarnation `restart`'s coordinator of restarts in place asks of whoever connects."""
    rdzv_id = names.rendezvous_id(job.metadata.name, job.metadata.uid, restart)
    return rounds.gang_id(rdzv_id, restart, rounds.token(rdzv_id))


def pod(job: ParallelTrainingJob, cfg: ResolvedConfig, *, rank: int, restart: int,
        excluded_nodes: Sequence[str] = (), in_place_left: int | None = None) -> dict[str, Any]:
    """Pod `rank` of incarnation `restart`; its gang may restart in place `in_place_left` times (default:
    spec.runPolicy.maxRestarts, a new job's)."""
    spec, name = job.spec, job.metadata.name
    policy = spec.run_policy
    rdzv_id = names.rendezvous_id(name, job.metadata.uid, restart)
    env = {**node_env(node_rank=rank, rdzv_id=rdzv_id, restart=restart),
           **rounds_env(policy, host=names.master_addr(name, job.metadata.namespace), port=rounds_port(spec),
                        left=policy.max_restarts if in_place_left is None else in_place_left,
                        token=rounds.token(rdzv_id), restarts=restart)}
    env_list: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    env_list.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    env_list.append({"name": contract.ENV_NODE_NAME,
                     "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    env_list += _copy(spec.template.env)
    volumes, mounts = _volumes(job)
    ports = ([{"name": "rendezvous", "containerPort": spec.rendezvous.port},
              {"name": "rounds", "containerPort": rounds_port(spec)}] if rank == 0 else [])
    ports += [{"name": f"metrics-{i}", "containerPort": spec.metrics.port + i}
              for i in range(spec.nproc_per_node)]
    trainer = {
        "name": "trainer",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": node_command(cfg, python=PYTHON, launcher=[LAUNCHER_PATH], config_path=CONFIG_PATH),
        "envFrom": [{"configMapRef": {"name": names.environment(name)}}],
        "env": env_list,
        "ports": ports,
        "resources": _resources(job),
        "volumeMounts": mounts,
        "securityContext": _copy(SECURE_CONTAINER),
    }
    labels = {contract.LABEL_RANK: str(rank), contract.LABEL_RESTART: str(restart), **spec.template.labels}
    meta = _meta(job, names.pod(name, restart, rank), labels)
    meta["annotations"].update(spec.template.annotations)
    pod_spec: dict[str, Any] = {
        "hostname": names.hostname(name, rank),
        "subdomain": names.service(name),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.run_policy.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [trainer],
        "volumes": volumes,
    }
    t = spec.template
    optional = {"nodeSelector": t.node_selector, "tolerations": t.tolerations,
                "affinity": avoiding(t.affinity, excluded_nodes),
                "priorityClassName": t.priority_class_name, "serviceAccountName": t.service_account_name}
    pod_spec.update({k: _copy(v) for k, v in optional.items() if v})
    p = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    gangs.apply_to_pod(spec, cfg, name, p, rank=rank, restart=restart)
    return p


def render(job: ParallelTrainingJob, *, restart: int = 0, config: ResolvedConfig | None = None,
           excluded_nodes: Sequence[str] = (), in_place_left: int | None = None) -> Rendered:
    """Every object of the job's gang incarnation `restart`, its pods kept off `excluded_nodes` and given
    `in_place_left` restarts in place (see `pod`). Raises InvalidJob for a bad spec."""
    cfg = config or resolve(job)
    name, namespace = job.metadata.name, job.metadata.namespace
    group_objects = gangs.objects(job.spec, cfg, name, namespace, restart)
    for obj in group_objects:
        if refs := owner_references(job):
            obj["metadata"]["ownerReferences"] = refs
    return Rendered(
        config=cfg,
        service=service(job),
        configmap=configmap(job, cfg),
        environment=environment(job, cfg),
        pods=[pod(job, cfg, rank=r, restart=restart, excluded_nodes=excluded_nodes,
                  in_place_left=in_place_left) for r in range(job.spec.nodes)],
        gang=group_objects,
    )
