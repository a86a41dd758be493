"""Helpers for the operator's cluster tests: a blocking REST client, manifests, a fake kubelet."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

from kubernetes import client
from tetrad_operator.kube import load_configuration
from tetrad_operator.observed import NodeState

from tetrad.api import contract

T = TypeVar("T")
JOBS = "/apis/tetrad.dev/v1alpha1"


class Api:
    """Blocking JSON REST calls; raise on unexpected statuses."""

    def __init__(self, kubeconfig: Path | str):
        configuration = load_configuration(str(kubeconfig))
        configuration.connection_pool_maxsize = 16  # the benchmark POSTs from 16 threads
        self.client = client.ApiClient(configuration)

    def send(self, verb: str, path: str, query: dict[str, Any] | None, body: Any) -> tuple[int, Any]:
        """One blocking request through the `kubernetes` client: (HTTP status, decoded body)."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = ("application/merge-patch+json" if verb == "PATCH"
                                       else "application/json")
        full = path + (f"?{urlencode(query)}" if query else "")
        method, url, headers, _, _ = self.client.param_serialize(
            method=verb, resource_path=full, header_params=headers, auth_settings=["BearerToken"])
        rsp = self.client.call_api(method, url, header_params=headers, body=body,
                                   _request_timeout=(5.0, 60.0))
        raw = rsp.read()  # type: ignore[no-untyped-call]
        try:
            return rsp.status, json.loads(raw) if raw else None
        except ValueError:
            return rsp.status, raw.decode(errors="replace")

    def call(self, verb: str, path: str, body: Any = None, ok: tuple[int, ...] = (), **query: Any) -> Any:
        status, data = self.send(verb, path, query, body)
        if 200 <= status < 300:
            return data
        if status in ok:
            return None
        raise AssertionError(f"{verb} {path}: {status} {data}")

    def get(self, path: str) -> Any:
        return self.call("GET", path, ok=(404,))

    def list(self, path: str, **query: Any) -> list[dict[str, Any]]:
        return self.call("GET", path, **query)["items"]  # type: ignore[no-any-return]

    def create(self, path: str, body: dict[str, Any]) -> Any:
        return self.call("POST", path, body)

    def patch(self, path: str, body: dict[str, Any]) -> Any:
        return self.call("PATCH", path, body, ok=(404,))

    def delete(self, path: str, **query: Any) -> Any:
        return self.call("DELETE", path, ok=(404,), **query)

    # ------------------------------------------------------------------ shortcuts

    def job(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.get(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs/{name}")  # type: ignore[no-any-return]

    def status(self, ns: str, name: str) -> dict[str, Any]:
        job = self.job(ns, name)
        return (job or {}).get("status") or {}

    def create_job(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.create(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", body)  # type: ignore[no-any-return]

    def pods(self, ns: str, job: str | None = None) -> list[dict[str, Any]]:
        selector = {"labelSelector": f"{contract.LABEL_JOB}={job}"} if job else {}
        return self.list(f"/api/v1/namespaces/{ns}/pods", **selector)

    def events(self, ns: str, name: str) -> list[dict[str, Any]]:
        return [e for e in self.list(f"/api/v1/namespaces/{ns}/events")
                if e["involvedObject"].get("name") == name]


def ptj(name: str, nodes: int = 2, *, cpu: str = "1", **spec: Any) -> dict[str, Any]:
    """A small job: debug model, pure data parallel, quick restarts."""
    run_policy = {"backoffSeconds": 1, "backoffMaxSeconds": 2, "terminationGracePeriodSeconds": 5,
                  **spec.pop("runPolicy", {})}
    return {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
        "metadata": {"name": name},
        "spec": {"nodes": nodes, "nprocPerNode": 1, "training": {"globalBatch": 8 * nodes},
                 "resources": {"cpu": cpu, "memory": "1Gi"}, "runPolicy": run_policy, **spec},
    }


def wait_for(probe: Callable[[], T | None], timeout: float = 30, what: str = "condition",
             interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_phase(api: Api, ns: str, name: str, phase: str, timeout: float = 30) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = api.status(ns, name)
        return st if st.get("phase") == phase else None
    try:
        return wait_for(probe, timeout, f"{name} to be {phase}")
    except TimeoutError:
        raise TimeoutError(f"{name} not {phase} after {timeout}s: {api.status(ns, name)}") from None


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or [] if c["type"] == type_)


def condition_true(status: dict[str, Any] | None, type_: str) -> bool:
    """For wait_for: whether the condition is there and True (condition() raises while it is absent)."""
    return any(c["type"] == type_ and c.get("status") == "True"
               for c in (status or {}).get("conditions") or [])


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def terminate(api: Api, ns: str, pod: str, exit_code: int, message: str | None = None) -> None:
    """What a kubelet reports when the trainer exits (kwok leaves non-Pending pods alone), with the
    container's termination message."""
    t = now()
    state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                            "startedAt": t, "finishedAt": t, **({"message": message} if message else {})}}
    api.patch(f"/api/v1/namespaces/{ns}/pods/{pod}/status", {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "containerStatuses": [{"name": "trainer", "image": "tetrad/trainer:0.1.0", "imageID": "",
                               "ready": False, "restartCount": 0, "state": state}]}})


def running_pods(api: Api, ns: str, job: str, restart: int | None = None) -> list[dict[str, Any]]:
    return [p for p in api.pods(ns, job) if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
            and (restart is None or p["metadata"]["labels"][contract.LABEL_RESTART] == str(restart))]


def wait_running(api: Api, ns: str, job: str, nodes: int, restart: int = 0,
                 timeout: float = 30) -> list[dict[str, Any]]:
    wait_phase(api, ns, job, "Running", timeout)
    return wait_for(lambda: (lambda ps: ps if len(ps) == nodes else None)(
        running_pods(api, ns, job, restart)), timeout, f"{nodes} running pods of {job} restart {restart}")


def finish_all(api: Api, ns: str, job: str, exit_code: int = 0) -> None:
    for p in running_pods(api, ns, job):
        terminate(api, ns, p["metadata"]["name"], exit_code)


def wait_events(api: Api, ns: str, job: str, reason: str, text: str = "",
                timeout: float = 30) -> list[dict[str, Any]]:
    """The job's Events of `reason` (whose message holds `text`), once there is one: the operator
    posts a decision's Events after it wrote its status, so a test that saw the status may not see
    them yet."""
    what = f"a {reason} Event of {job}" + (f" saying {text!r}" if text else "")
    return wait_for(lambda: [e for e in api.events(ns, job) if e["reason"] == reason
                             and text in e["message"]], timeout, what)


def events_when_succeeded(api: Api, ns: str, job: str, reason: str) -> list[dict[str, Any]]:
    """Every pod succeeds; once the job has, its Events of `reason`."""
    finish_all(api, ns, job, 0)
    wait_phase(api, ns, job, "Succeeded")
    wait_events(api, ns, job, "Succeeded")  # the last Event of the decision that ended the job
    return [e for e in api.events(ns, job) if e["reason"] == reason]


def takes_pods(node: NodeState) -> bool:
    """Ready, and no longer carrying the node lifecycle controller's `node.kubernetes.io/not-ready`
    taint, which outlives Readiness for a moment: until then neither the scheduler nor a gang's fit
    counts the node."""
    return node.ready and not any(t.get("key") == "node.kubernetes.io/not-ready" for t in node.taints)


def fake_node(name: str, *, cpu: str = "8", memory: str = "32Gi", gpus: int = 0,
              labels: dict[str, str] | None = None,
              taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A Node kwok manages (it turns it Ready and runs its pods)."""
    alloc = {"cpu": cpu, "memory": memory, "pods": "110"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"kubernetes.io/hostname": name, "type": "kwok", **(labels or {})}},
        "spec": {"taints": taints or []},
        "status": {"capacity": alloc, "allocatable": alloc},
    }


def tetrad_cli(*args: str) -> list[str]:
    """The command line of `tetrad ARGS` (it reads KUBECONFIG, which operator_cluster sets)."""
    return [sys.executable, "-m", "tetrad.cli", *args]


def asked_token(stdout: str, annotation: str) -> str:
    """The token `tetrad checkpoint` or `tetrad restart` set, from its first line."""
    first = stdout.splitlines()[0]
    assert first.startswith(f"asked: {annotation}="), stdout
    return first.split("=", 1)[1]
