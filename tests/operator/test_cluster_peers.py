"""The operator benchmark's peers against their real controllers (built from Go modules, started by
`hack/cluster.sh peer`, hack/cluster/peers.sh): each takes the job bench/peers.py gives it and runs
its pods on kwok nodes as it would on GPUs, so a broken build, CRD, webhook or job body fails here
rather than in a benchmark run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.operator_bench import tetrad_pod
from bench.peers import PEERS, with_pod
from tests.cluster_fixtures import cluster_script

from .helpers import wait_for

# The peers are processes beside the session's cluster, and the three kubeflow-v1 modes take turns
# with one training-operator: keep these tests on one worker (--dist loadgroup).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("peers")]

SMALL = {"requests": {"cpu": "100m", "memory": "64Mi"}}  # room beside the other tests' pods
WORKERS = 3


def env(pod: dict[str, Any], name: str) -> str | None:
    return next((e.get("value") for e in pod["spec"]["containers"][0].get("env") or [] if e["name"] == name),
                None)


@pytest.mark.parametrize("name", list(PEERS))
def test_a_peer_runs_the_benchmarks_job_on_kwok_nodes(operator_cluster, api, namespace, name):
    peer = PEERS[name]
    up = cluster_script("peer", name, name=operator_cluster.name, timeout=1800)
    assert up.returncode == 0, up.stderr[-4000:]
    api.create(peer.jobs(namespace), peer.body("j", WORKERS, SMALL))
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == WORKERS
                             and all(p["status"].get("phase") == "Running" for p in ps)
                             else None)(api.list(f"/api/v1/namespaces/{namespace}/pods")),
                    timeout=120, what=f"{WORKERS} Running pods of {name}'s job")
    if peer.running:
        wait_for(lambda: peer.running(api.get(f"{peer.jobs(namespace)}/j") or {}), timeout=60,
                 what=f"{name}'s job Running")
    if name.startswith("kubeflow-v1"):  # the operator gives every pod the torchrun environment
        assert sorted(env(p, "RANK") or "" for p in pods) == ["0", "1", "2"]
        assert {env(p, "WORLD_SIZE") for p in pods} == {str(WORKERS)}
        # ... and its modes take turns on one training-operator, restarted with the mode's flags
        pid_file = Path(operator_cluster.env["TETRAD_CLUSTER_STATE"]) / "run" / "training-operator.pid"
        flags = Path(f"/proc/{pid_file.read_text().split()[0]}/cmdline").read_bytes().split(b"\0")
        assert (b"--kube-api-qps" in flags) == (name == "kubeflow-v1-tuned"), flags
        assert (b"--gang-scheduler-name" in flags) == (name == "kubeflow-v1-coscheduling"), flags
    if name == "kubeflow-v1-coscheduling":  # one PodGroup of all the pods, bound by that scheduler
        groups = api.list(f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{namespace}/podgroups")
        assert [(g["metadata"]["name"], g["spec"]["minMember"]) for g in groups] == [("j", WORKERS)]
        assert {p["spec"]["schedulerName"] for p in pods} == {"scheduler-plugins-scheduler"}
    if name == "jobset":
        assert {p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] for p in pods} == {"j"}
    if name == "kubeflow-trainer":  # Trainer made a JobSet of the TrainJob, JobSet made the pods
        jobsets = api.list(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets")
        assert [(s["metadata"]["name"], s["metadata"]["ownerReferences"][0]["kind"])
                for s in jobsets] == [("j", "TrainJob")]
        assert {env(p, "PET_NNODES") for p in pods} == {str(WORKERS)}


def test_jobset_runs_pods_with_tetrads_content(operator_cluster, api, namespace):
    """`--peer-pods tetrad`: JobSet's pod template takes the env, ports, volumes and security
    settings of Tetrad's pod (its own name, image and resources stay), and JobSet runs it."""
    up = cluster_script("peer", "jobset", name=operator_cluster.name, timeout=1800)
    assert up.returncode == 0, up.stderr[-4000:]
    peer, content = PEERS["jobset"], tetrad_pod()
    api.create(peer.jobs(namespace), with_pod(peer.body, content)("t", WORKERS, SMALL))
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == WORKERS
                             and all(p["status"].get("phase") == "Running" for p in ps)
                             else None)(api.list(f"/api/v1/namespaces/{namespace}/pods")),
                    timeout=120, what=f"{WORKERS} Running pods of the JobSet")
    for p in pods:
        c = p["spec"]["containers"][0]
        assert c["name"] == "node" and c["resources"]["requests"] == SMALL["requests"]
        assert c["envFrom"] == content["spec"]["containers"][0]["envFrom"]
        assert env(p, "PET_NODE_RANK") == "1" and len(c["ports"]) == 8  # Tetrad's rank-1 pod of a 4-node job
        assert {v["name"] for v in p["spec"]["volumes"]} >= {v["name"] for v in content["spec"]["volumes"]}
    assert with_pod(PEERS["kubeflow-trainer"].body, content)("t", 2) == PEERS["kubeflow-trainer"].body("t", 2)


def test_the_recovery_benchmark_times_a_whole_gang_restart_of_tetrad_and_of_jobset(operator_cluster, api,
                                                                                   operator, namespace):
    """bench/recovery.py's timeline on real controllers: one failed pod, then every phase in order up to
    a new gang all Running (Tetrad's restart 1; JobSet's recreated Jobs)."""
    from bench.recovery import JOBSET_INDEX, PHASES, fail_one, restartable
    from tetrad.api.contract import LABEL_RANK

    from .helpers import JOBS, ptj, wait_running

    api.create_job(namespace, ptj("r", nodes=WORKERS, cpu="100m", runPolicy={"backoffSeconds": 0}))
    wait_running(api, namespace, "r", WORKERS)
    tetrad = fail_one(api, namespace, WORKERS, LABEL_RANK)
    assert [tetrad[k] for k in PHASES] == sorted(tetrad[k] for k in PHASES) and tetrad["running"] < 60
    assert api.status(namespace, "r")["restarts"] == 1
    api.delete(f"{JOBS}/namespaces/{namespace}/paralleltrainingjobs/r")
    wait_for(lambda: not api.list(f"/api/v1/namespaces/{namespace}/pods"), what="the job's pods gone")

    peer = PEERS["jobset"]
    up = cluster_script("peer", peer.name, name=operator_cluster.name, timeout=1800)
    assert up.returncode == 0, up.stderr[-4000:]
    api.create(peer.jobs(namespace), restartable(peer, "j", WORKERS, SMALL))
    def all_running() -> bool:
        pods = api.list(f"/api/v1/namespaces/{namespace}/pods")
        return len(pods) == WORKERS and all(p["status"].get("phase") == "Running" for p in pods)

    wait_for(all_running, timeout=120, what="the JobSet's pods Running")
    jobset = fail_one(api, namespace, WORKERS, JOBSET_INDEX)
    assert [jobset[k] for k in PHASES] == sorted(jobset[k] for k in PHASES) and jobset["running"] < 60
    restarts = (api.get(f"{peer.jobs(namespace)}/j") or {}).get("status", {}).get("restarts")
    assert restarts == 1, restarts


def test_the_recovery_benchmark_counts_a_restart_in_place_with_every_pod_kept(operator_cluster, api,
                                                                              namespace):
    """bench/recovery.py --in-place on a real API server and operator: rank 0's stand-in reports round 1,
    the status counts it, and no pod was touched meanwhile (the bench checks each poll). The scrape that
    reads the round wakes the job's loop, which counts it at once rather than at the pass of the scrape
    after (10 s apart here; the resync 60 s): the round begins just after a scrape, so it is counted
    about 10 s later, not 20."""
    import os

    from bench.recovery import Rank0, restart_in_place

    from .conftest import operator_in_thread
    from .helpers import ptj, wait_running

    rank0 = Rank0()
    try:
        with operator_in_thread([namespace], env={"TETRAD_OPERATOR_SCRAPE_INTERVAL_SECONDS": "10",
                                                  "TETRAD_OPERATOR_RESYNC_SECONDS": "60"}):
            api.create_job(namespace, ptj("ip", nodes=WORKERS, cpu="100m", metrics={"port": rank0.port}))
            pods = {p["metadata"]["uid"] for p in wait_running(api, namespace, "ip", WORKERS)}

            def scraped() -> str | None:
                return (api.status(namespace, "ip").get("trainerTime") or {}).get("updated")

            first = wait_for(scraped, timeout=30, what="a scrape")
            wait_for(lambda: scraped() != first, timeout=30, what="the next scrape")
            r = restart_in_place(api, namespace, "ip", rank0, os.getpid())
    finally:
        rank0.close()
    assert 0 < r["counted"] < 15 and r["restarts"] == 0, r  # the next scrape, and a pass
    assert {p["metadata"]["uid"] for p in api.pods(namespace, "ip")} == pods
    status = api.status(namespace, "ip")
    assert status["restartsInPlace"] == 1
    assert status["trainerTime"]["roundCause"].startswith("node 1 exited 137"), status["trainerTime"]
