"""kopf registrations: thin adapters from kopf's watch events to the Controller.

- the startup handler starts the Controller, whose own informers watch the pods and every node
  (kopf watches only the jobs);
- the job event handler only wakes the job's loop;
- one daemon per ParallelTrainingJob runs that job's reconcile loop; kopf stops it when the
  job is deleted or when peering pauses this replica, and starts it again on resume.

Signatures follow kopf's handler protocols (memo: Any, namespace: str | None). The handlers are
coroutines: kopf runs a plain function in a thread pool, a hop per event.
"""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes.config import ConfigException

from tetrad.api import contract
from tetrad.api.contract import GROUP, PLURAL, VERSION
from tetrad_operator import status
from tetrad_operator.controller import Controller
from tetrad_operator.kube import Kube

JOBS = (GROUP, VERSION, PLURAL)


@kopf.on.startup()
async def start(memo: Any, **_: Any) -> None:
    try:
        kube = Kube(workers=memo.config.api_concurrency)
    except ConfigException as e:
        raise kopf.PermanentError(f"no Kubernetes credentials: {e}") from e
    memo.controller = controller = Controller(kube, memo.config, memo.namespaces)  # stopped at cleanup
    try:
        await controller.start()  # the job daemons start after this: the informers hold their first LIST
    except PermissionError as e:  # an RBAC rule missing: retrying cannot help
        await controller.stop()
        raise kopf.PermanentError(str(e)) from e
    if memo.metrics_port:
        memo.metrics_server = controller.metrics.serve(memo.metrics_port)


@kopf.on.cleanup()
async def stop(memo: Any, **_: Any) -> None:
    if getattr(memo, "metrics_server", None) is not None:
        memo.metrics_server.shutdown()
        memo.metrics_server.server_close()
    if getattr(memo, "controller", None) is not None:
        await memo.controller.stop()


@kopf.on.event(*JOBS)
async def job_changed(namespace: str | None, name: str, body: kopf.Body, event: kopf.RawEvent, memo: Any,
                      **_: Any) -> None:
    if event["type"] != "DELETED":
        memo.controller.job_seen((namespace, name), event["object"])  # the loop's next pass reads it
    # Our own status writes come back here too; only a new spec generation or a new checkpoint-now or
    # restart-in-place token (an annotation: no new generation) needs a reconcile.
    written = status.read(body.get("status"))
    checkpoint = body.meta.annotations.get(contract.ANNOTATION_CHECKPOINT_NOW)
    restart = body.meta.annotations.get(contract.ANNOTATION_RESTART_IN_PLACE)
    if body.meta.get("generation") != written.observed_generation or \
            (checkpoint and checkpoint != (written.checkpoint and written.checkpoint.requested)) or \
            (restart and restart != written.restart_requested):
        memo.controller.wake((namespace, name))


@kopf.daemon(*JOBS, cancellation_backoff=10.0, cancellation_timeout=5.0)  # finish the pass, then stop
async def job_loop(namespace: str | None, name: str, body: kopf.Body, stopped: kopf.DaemonStopped, memo: Any,
                   **_: Any) -> None:
    await memo.controller.run_job(namespace, name, stopped, dict(body))  # the body as the watch showed it
