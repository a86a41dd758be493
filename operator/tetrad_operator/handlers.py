"""kopf registrations: thin adapters from kopf's watch events to the Controller.

- two indexes keep compact views of the operator's pods (by job) and of every node;
- event handlers only wake the right job loop (and the gang admission);
- one daemon per ParallelTrainingJob runs that job's reconcile loop; kopf stops it when the
  job is deleted or when peering pauses this replica, and starts it again on resume.

Signatures follow kopf's handler protocols (memo: Any, namespace: str | None); every object
watched here but nodes is namespaced.
"""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes.config import ConfigException

from tetrad.api import contract
from tetrad.api.contract import GROUP, PLURAL, VERSION
from tetrad_operator.controller import Controller
from tetrad_operator.kube import Kube
from tetrad_operator.state import NodeState, PodState

JOBS = (GROUP, VERSION, PLURAL)
OWN_PODS: dict[str, Any] = {contract.LABEL_JOB: kopf.PRESENT, contract.LABEL_MANAGED_BY: contract.MANAGED_BY}


@kopf.on.startup()
async def start(memo: Any, **indexes: Any) -> None:
    try:
        kube = Kube(workers=memo.config.api_concurrency)
    except ConfigException as e:
        raise kopf.PermanentError(f"no Kubernetes credentials: {e}") from e
    controller = Controller(kube, memo.config, memo.namespaces)
    controller.pods_index = indexes["pods_by_job"]  # kopf passes each index by its function's name
    controller.nodes_index = indexes["nodes_by_name"]
    await controller.start()
    memo.controller = controller
    if memo.metrics_port:
        memo.metrics_server = controller.metrics.serve(memo.metrics_port)


@kopf.on.cleanup()
async def stop(memo: Any, **_: Any) -> None:
    if getattr(memo, "metrics_server", None) is not None:
        memo.metrics_server.shutdown()
        memo.metrics_server.server_close()
    if getattr(memo, "controller", None) is not None:
        await memo.controller.stop()


@kopf.index("pods", labels=OWN_PODS)
def pods_by_job(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, PodState]:
    return {(namespace, labels[contract.LABEL_JOB]): PodState.from_body(body)}


@kopf.index("nodes")
def nodes_by_name(name: str, body: kopf.Body, **_: Any) -> dict[Any, NodeState]:
    return {name: NodeState.from_body(body)}


@kopf.on.event("pods", labels=OWN_PODS)
def pod_changed(namespace: str | None, labels: kopf.Labels, type: str | None, body: kopf.Body, memo: Any, **_: Any) -> None:
    memo.controller.on_pod_event(namespace, labels[contract.LABEL_JOB], type, body.get("status", {}).get("phase"),
                                 bool(body.meta.get("deletionTimestamp")))


@kopf.on.event("nodes")
def node_changed(name: str, type: str | None, body: kopf.Body, memo: Any, **_: Any) -> None:
    memo.controller.on_node_event(name, type, None if type == "DELETED" else NodeState.from_body(body))


@kopf.on.event(*JOBS)
def job_changed(namespace: str | None, name: str, body: kopf.Body, memo: Any, **_: Any) -> None:
    # Our own status writes come back here too; only a new spec generation or a new checkpoint-now
    # token (an annotation: no new generation) needs a reconcile.
    status = body.get("status", {})
    token = body.meta.annotations.get(contract.ANNOTATION_CHECKPOINT_NOW)
    if body.meta.get("generation") != status.get("observedGeneration") or \
            (token and token != (status.get("checkpoint") or {}).get("requested")):
        memo.controller.wake((namespace, name))


@kopf.daemon(*JOBS, cancellation_backoff=10.0, cancellation_timeout=5.0)  # finish the pass, then stop
async def job_loop(namespace: str | None, name: str, stopped: kopf.DaemonStopped, memo: Any, **_: Any) -> None:
    await memo.controller.run_job(namespace, name, stopped)
