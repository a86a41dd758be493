"""The preflight gate with real processes: `tetrad run` on two local nodes of two gloo processes
each passes it and reports the bus bandwidth of every node; a node with fewer CPUs than the job
requests, or whose rendezvous name does not resolve, exits EXIT_PREFLIGHT naming itself and the
reason in its termination message (the CPU check applies in a pod, where TETRAD_NODE_NAME is set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from tetrad_trainer.metrics import RankMetrics

from tests.trainer.harness import free_port_block
from tetrad.api import parse
from tetrad.api.contract import (
    ENV_NODE_NAME,
    ENV_TERMINATION_LOG,
    EXIT_PREFLIGHT,
    METRIC_PREFLIGHT_BUS_BANDWIDTH,
    METRIC_PREFLIGHT_SECONDS,
)
from tetrad.api.termination import TerminationMessage
from tetrad.node.gang import NodeFigures
from tetrad.render.env import job_env
from tetrad.resolve import resolve

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def job_doc(**spec: object) -> dict[str, object]:
    return {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "gate"},
            "spec": {"nodes": 2, "nprocPerNode": 2, "parallelism": {"dpShard": 4},
                     "model": {"preset": "debug", "seqLen": 64}, "training": {"steps": 1, "globalBatch": 4},
                     "metrics": {"port": free_port_block(4)}, **spec}}


def tetrad_run(tmp_path: Path, doc: dict[str, object], *, cpus: set[int] | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "tetrad.cli", "run", str(path), "--workdir", str(tmp_path / "w")],
        capture_output=True, text=True, cwd=ROOT, timeout=500,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)  # noqa: PLW1509 - affinity only


def preflight_lines(log: Path) -> list[dict[str, object]]:
    return [json.loads(line)["preflight"] for line in log.read_text().splitlines()
            if line.startswith('{"preflight"')]


@pytest.mark.slow
def test_two_nodes_pass_the_gate_and_report_each_nodes_bus_bandwidth(tmp_path: Path) -> None:
    r = tetrad_run(tmp_path, job_doc(preflight={"allReduceMiB": 4, "timeoutSeconds": 120}))
    assert r.returncode == 0, r.stderr[-3000:]
    (report,) = preflight_lines(tmp_path / "w" / "node-0.log")  # rank 0's JSON line
    assert report["passed"] is True and report["world_size"] == 4 and report["bytes"] == 4 * 2**20
    nodes = report["nodes"]
    assert isinstance(nodes, list) and [n["node_rank"] for n in nodes] == [0, 1]
    for n in nodes:
        assert n["bus_bandwidth_bytes_per_second"] > 0 and n["seconds"] > 0, n
    assert isinstance(report["slow_nodes"], list)
    assert preflight_lines(tmp_path / "w" / "node-1.log") == [], "only rank 0 prints the report"


@pytest.mark.slow
def test_a_node_with_fewer_cpus_than_requested_fails_naming_itself_and_the_reason(tmp_path: Path) -> None:
    r = tetrad_run(tmp_path, job_doc(resources={"cpu": "2"}), cpus={0}, env={ENV_NODE_NAME: "gpu-node-7"})
    assert r.returncode == EXIT_PREFLIGHT, r.stderr[-3000:]
    # tetrad run gives each node its termination message in the work directory, as a pod's
    # /dev/termination-log
    said = [TerminationMessage.parse(p.read_text()).preflight
            for p in sorted((tmp_path / "w").glob("node-*.termination"))]
    failure = next(f for failures in said for f in failures)
    assert failure.node == "gpu-node-7" and failure.node_rank in (0, 1)
    assert failure.reason == ("cpu: resources.cpu requests 2 CPUs, this node's processes may run on 1 (their "
                              "CPU affinity)")
    node_log = (tmp_path / "w" / f"node-{failure.node_rank}.log").read_text()
    assert "preflight failed on node gpu-node-7" in node_log and "torch.distributed.run" not in node_log
    # one process per node: four on the one CPU take minutes to start
    outside_a_pod = tetrad_run(tmp_path, job_doc(resources={"cpu": "2"}, nprocPerNode=1,
                                                 parallelism={"dpShard": 2},
                                                 training={"steps": 1, "globalBatch": 4},
                                                 preflight={"allReduceMiB": 1}), cpus={0})
    assert outside_a_pod.returncode == 0, ("`tetrad run`'s nodes share the machine: a pod's CPU request is "
                                           "not checked")


def test_a_node_whose_rendezvous_name_does_not_resolve_fails_before_torchrun(tmp_path: Path) -> None:
    job, problems = parse(job_doc(preflight={"timeoutSeconds": 2}))
    assert job is not None, problems
    pods = job_env(resolve(job), master_addr="gate-0.no-such-service.invalid", master_port=29500,
                   config_path="/unused", rdzv_timeout=900)
    log, started = tmp_path / "termination-log", tmp_path / "started"
    r = subprocess.run([sys.executable, "-m", "tetrad.node", "supervise", "--", "touch", str(started)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, **pods, "PET_NODE_RANK": "0", ENV_NODE_NAME: "node-b",
                            ENV_TERMINATION_LOG: str(log)})
    assert r.returncode == EXIT_PREFLIGHT, r.stderr
    assert not started.exists(), "torchrun must not start on a node that failed the gate"
    (failure,) = TerminationMessage.parse(log.read_text()).preflight
    # rank 0: a worker first waits for the name (test_rendezvous)
    assert (failure.node, failure.node_rank) == ("node-b", 0)
    assert failure.reason.startswith("rendezvous: pod 0's name gate-0.no-such-service.invalid did not "
                                     "resolve within 2 s")


def test_rank_0_exports_every_nodes_figures_as_labelled_gauges() -> None:
    metrics = RankMetrics(port=None, rank=0, labels={}, jsonl=None)
    metrics.preflight([NodeFigures("n0", 0, 2.5e9, 0.4), NodeFigures("n1", 1, 1.25e9, 0.5)])
    text = generate_latest(metrics.registry).decode()
    assert f'{METRIC_PREFLIGHT_BUS_BANDWIDTH}{{node="n0",node_rank="0"}} 2.5e+09' in text
    assert f'{METRIC_PREFLIGHT_BUS_BANDWIDTH}{{node="n1",node_rank="1"}} 1.25e+09' in text
    assert f'{METRIC_PREFLIGHT_SECONDS}{{node="n1",node_rank="1"}} 0.5' in text
