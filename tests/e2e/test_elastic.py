"""An elastic job end to end on the real nodes, through the chart's operator: a node taken out of service
(cordoned) under a preempted pod leaves no room for the gang of two pods; after shrinkAfterSeconds the gang
restarts on the one node left, two data-parallel ranks instead of four with the same global batch; when
the node is back the operator asks rank 0 for a checkpoint and grows the gang back to two pods. Every
step's loss, across the four incarnations, equals an uninterrupted `tetrad run` of the same job within
1e-4 (the accumulation order differs at two ranks)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.cluster_fixtures import RealCluster, fresh_namespace, wait_until
from tests.e2e.test_bring_your_own import checkpoints_in, job, shared_dir
from tests.e2e.test_training import (
    JOB_TIMEOUT,
    ExitWatch,
    PodLogs,
    describe,
    job_status,
    json_lines,
    local_losses,
    trainer_pods,
    wait_for_phase,
)

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.xdist_group("real-nodes"),
              pytest.mark.timeout(3600)]

STEPS = 160
# One pod per real node: two of 1.5 cpu do not fit in a node's 2.
POD = {"cpu": "1.5", "memory": "3Gi"}


@dataclass
class ElasticRun:
    status: dict[str, Any]
    shrunk: dict[str, Any]  # the job's status once the one-pod gang ran
    preempted: dict[str, Any]  # the deleted pod as it terminated
    events: list[dict[str, Any]]
    logs: dict[int, str]  # rank 0's log of each incarnation that ran
    local: list[float]


@pytest.fixture(scope="module")
def elastic_ns(installed: RealCluster) -> Iterator[str]:
    yield from fresh_namespace(installed, f"e2e-elastic-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def elastic_run(installed: RealCluster, elastic_ns: str,
                tmp_path_factory: pytest.TempPathFactory) -> ElasticRun:
    c, ns = installed, elastic_ns
    spec = job("elastic", nprocPerNode=2, resources=POD, model={"preset": "debug"},
               parallelism={"dpShard": "auto"},
               training={"steps": STEPS, "globalBatch": 8, "precision": "fp32", "warmupSteps": 2,
                         "lr": 0.001},
               checkpoint={"enabled": True, "interval": 8,
                           **checkpoints_in(shared_dir(tmp_path_factory, "ck"))},
               elastic={"minNodes": 1, "shrinkAfterSeconds": 10, "growAfterSeconds": 5},
               runPolicy={"maxRestarts": 0, "terminationGracePeriodSeconds": 30, "backoffSeconds": 2})["spec"]
    manifest = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
                "metadata": {"name": "elastic"}, "spec": spec}
    c.apply(manifest, namespace=ns)
    logs = PodLogs(c, ns, "elastic", 2, tmp_path_factory.mktemp("elastic-logs"))

    def running(restart: int, pods: int) -> bool:
        status = job_status(c, ns, "elastic")
        assert status.get("phase") != "Failed", f"{status}\n{describe(c, ns)}"
        up = [p for p in trainer_pods(c, ns, "elastic", restart) if p["status"].get("phase") == "Running"]
        if len(up) == pods:
            logs.follow(restart)
        return len(up) == pods

    def committed(restart: int) -> bool:
        resumed, last = logs.checkpoints(restart)
        return last >= resumed + 8

    wait_until(lambda: running(0, 2) and committed(0), timeout=JOB_TIMEOUT, interval=2,
               what="a checkpoint in incarnation 0")
    assert logs.last_step(0) <= STEPS - 20, "incarnation 0 trained too far for the faults to come"
    victim = trainer_pods(c, ns, "elastic", 0)[1]
    node = victim["spec"]["nodeName"]
    c.kubectl("cordon", node)
    try:
        watch = ExitWatch(c, ns, victim["metadata"]["name"])
        c.kubectl("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false", "--ignore-not-found")
        preempted = watch.terminated()
        # restart 1 waits for room for two pods; restart 2 runs on the node left
        wait_until(lambda: running(2, 1) and logs.last_step(2) > logs.checkpoints(2)[0], timeout=JOB_TIMEOUT,
                   interval=2, what="the shrunken gang training")
        shrunk = job_status(c, ns, "elastic")
        assert logs.last_step(2) <= STEPS - 10, "the shrunken gang trained too far for the grow to come"
    finally:
        c.kubectl("uncordon", node)
    wait_until(lambda: running(3, 2), timeout=JOB_TIMEOUT, interval=2, what="the gang grown back to two pods")
    status = wait_for_phase(c, ns, "elastic", "Succeeded")
    events = c.kubectl_json("get", "events", "-n", ns, "--field-selector",
                            "involvedObject.name=elastic")["items"]
    return ElasticRun(status, shrunk, preempted, events, logs.rank0(),
                      local_losses(manifest, tmp_path_factory.mktemp("local-elastic")))


def test_a_gang_without_room_shrinks_onto_the_node_left_and_grows_back_to_the_uninterrupted_loss(
        elastic_run: ElasticRun) -> None:
    run = elastic_run
    assert run.preempted["exitCode"] == 75
    shrunk = run.shrunk
    assert (shrunk["elastic"]["nodes"], shrunk["mesh"], shrunk["worldSize"]) == (1, "pp1.dpr1.dps2.cp1.tp1",
                                                                                2)
    final = run.status
    assert (final["restarts"], final["disruptions"], final["elastic"]["nodes"], final["elastic"]["resizes"],
            final["mesh"]) == (3, 1, 2, 2, "pp1.dpr1.dps4.cp1.tp1")
    reasons = [e["reason"] for e in run.events]
    assert "Shrunk" in reasons and "Grown" in reasons
    # maxRestarts 0: neither the preemption nor the two resizes spent a restart
    assert "MaxRestartsExceeded" not in reasons
    shrink = next(e["message"] for e in run.events if e["reason"] == "Shrunk")
    assert "restarting it on 1 of spec.nodes=2" in shrink
    assert "resumed step" in run.logs[2] and "model and optimizer resharded" in run.logs[2]
    assert "model and optimizer resharded" in run.logs[3]
    by_step = {s["step"]: s["loss"] for r in (0, 2, 3) for s in json_lines(run.logs[r])}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert [by_step[s] for s in range(1, STEPS + 1)] == pytest.approx(run.local, rel=1e-4)
