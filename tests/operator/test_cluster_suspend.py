"""Checkpoint-aware suspend and checkpoint-now against a real API server (kwok pods; the test plays
the kubelet and, through a loopback metrics endpoint, rank 0's trainer).

Suspend: the operator deletes the pods with their grace period (the kubelet's SIGTERM makes the
trainer save and exit 75); a test finalizer holds each pod while the test reports that exit, with
rank 0's termination message naming the saved step. The job is Suspended with that step in its
condition, an Event and status.checkpoint, with no restart spent; a resume recreates the same pods
and status.checkpoint.resumedFrom is the step the new trainer reports."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from prometheus_client import Gauge

from tetrad.api import contract

from .conftest import operator_in_thread
from .helpers import (
    JOBS,
    asked_token,
    condition,
    ptj,
    terminate,
    tetrad_cli,
    wait_events,
    wait_for,
    wait_phase,
    wait_running,
)
from .test_cluster_checkpoint import Rank0

pytestmark = pytest.mark.cluster
KUBELET = "tetrad.test/kubelet"  # the test's finalizer: a pod stays Terminating until the test let it go


def test_suspend_saves_records_the_step_and_resume_continues_from_it(api, operator_cluster, namespace):
    ns, rank0 = namespace, Rank0()
    job = f"{JOBS}/namespaces/{ns}/paralleltrainingjobs/sus"
    try:
        with operator_in_thread([ns]) as op:
            api.create_job(ns, ptj("sus", nodes=2, metrics={"port": rank0.port},
                                   checkpoint={"enabled": True, "path": "/ckpt", "interval": 1000}))
            pods = [p["metadata"]["name"] for p in wait_running(api, ns, "sus", 2)]
            for pod in pods:
                api.patch(f"/api/v1/namespaces/{ns}/pods/{pod}", {"metadata": {"finalizers": [KUBELET]}})

            api.patch(job, {"spec": {"runPolicy": {"suspend": True}}})
            st = wait_phase(api, ns, "sus", "Suspended")
            assert condition(st, "Suspended")["reason"] == "Suspending", st
            wait_for(lambda: all(p["metadata"].get("deletionTimestamp") for p in api.pods(ns, "sus")),
                     what="both pods deleted")
            graceful = op.controller.metrics.registry.get_sample_value("tetrad_operator_pods_deleted_total",
                                                                       {"force": "false"})
            assert graceful == 2, "deleted with their grace period: the kubelet sends SIGTERM first"

            committed = time.time()
            for pod in pods:  # the trainer saved step 40 on SIGTERM and exited 75
                message = (json.dumps({contract.TERMINATION_CHECKPOINT_STEP: 40,
                                       contract.TERMINATION_CHECKPOINT_TIME: committed})
                           if pod.endswith("-0") else None)
                terminate(api, ns, pod, contract.EXIT_PREEMPTED, message)
            wait_for(lambda: (api.status(ns, "sus").get("checkpoint") or {}).get("step") == 40,
                     what="the saved step in status.checkpoint")
            for pod in pods:
                api.patch(f"/api/v1/namespaces/{ns}/pods/{pod}", {"metadata": {"finalizers": None}})
            wait_for(lambda: not api.pods(ns, "sus"), what="the pods gone")
            st = wait_for(lambda: (lambda s: s if condition(s, "Suspended")["reason"] == "Suspended"
                                   else None)(api.status(ns, "sus")), what="Suspended with the saved step")
            assert "the last committed checkpoint is step 40" in condition(st, "Suspended")["message"]
            assert (st["checkpoint"]["path"] == "/ckpt/step-00000040"
                    and st["checkpoint"]["time"].endswith("Z"))
            assert st["restarts"] == 0 and st["disruptions"] == 0, "a suspend is no restart"
            assert wait_events(api, ns, "sus", "Suspended", "step 40")

            rank0.new_process()  # the resumed trainer: its gauges unset until it decided
            api.patch(job, {"spec": {"runPolicy": {"suspend": False}}})
            pods_again = wait_running(api, ns, "sus", 2)
            assert sorted(p["metadata"]["name"] for p in pods_again) == sorted(pods)
            assert wait_events(api, ns, "sus", "Resumed", "resumes from checkpoint step 40")
            assert "resumedFrom" not in api.status(ns, "sus")["checkpoint"]
            rank0.set(contract.METRIC_RESUMED_FROM, 40)
            st = wait_for(lambda: (lambda s: s if s.get("checkpoint", {}).get("resumedFrom") == 40 else None)(
                api.status(ns, "sus")), what="status.checkpoint.resumedFrom")
            assert st["checkpoint"]["step"] == 40 and st["checkpoint"]["resumedAtRestart"] == 0
            assert st["restarts"] == 0 and st["disruptions"] == 0
    finally:
        rank0.close()


def test_checkpoint_now_reaches_rank_0_and_status_shows_its_commit(api, operator_cluster, namespace):
    ns, rank0 = namespace, Rank0()
    request_step = Gauge(contract.METRIC_REQUEST_STEP, "", [contract.LABEL_REQUEST_TOKEN],
                         registry=rank0.registry)
    request_time = Gauge(contract.METRIC_REQUEST_TIME, "", [contract.LABEL_REQUEST_TOKEN],
                         registry=rank0.registry)
    try:
        with operator_in_thread([ns]):
            api.create_job(ns, ptj("now", nodes=2, metrics={"port": rank0.port},
                                   checkpoint={"enabled": True, "path": "/ckpt", "interval": 1000}))
            wait_running(api, ns, "now", 2)
            # `tetrad checkpoint` sets the annotation (as kubectl annotate would) and waits for the answer
            asking = subprocess.Popen(tetrad_cli("checkpoint", "now", "-n", ns, "--wait", "60"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

            def annotation(rank: int) -> str | None:
                pod = api.get(f"/api/v1/namespaces/{ns}/pods/now-r0-{rank}")
                return (pod["metadata"].get("annotations") or {}).get(contract.ANNOTATION_CHECKPOINT_NOW)

            token = wait_for(lambda: annotation(0), what="the token on rank 0's pod")
            assert annotation(1) is None
            assert api.status(ns, "now")["checkpoint"]["requested"] == token
            assert wait_events(api, ns, "now", "CheckpointRequested")
            assert asking.poll() is None  # no answer yet: rank 0 has not saved

            request_step.labels(token).set(57)  # rank 0 saved step 57 for it, committed now
            request_time.labels(token).set(time.time())
            out, err = asking.communicate(timeout=60)
            assert asking.returncode == 0, err
            assert asked_token(out, contract.ANNOTATION_CHECKPOINT_NOW) == token
            assert "saved: rank 0 committed the checkpoint of step 57" in out
            st = api.status(ns, "now")["checkpoint"]["requestCommitted"]
            assert st["token"] == token and st["step"] == 57 and st["time"].endswith("Z")
            assert api.status(ns, "now")["phase"] == "Running"
    finally:
        rank0.close()
