"""Benchmark the Tetrad operator on the local control plane with kwok nodes.

    .venv/bin/python bench/operator_bench.py                       # sizes 8,128,1024; 100 concurrent jobs
    .venv/bin/python bench/operator_bench.py --sizes 8,128 --concurrent 20 --keep
    .venv/bin/python bench/operator_bench.py --sizes 1024 --concurrent 0 --gangs builtin,coscheduling,kueue
    .venv/bin/python bench/operator_bench.py --peers kubeflow-v1,jobset,kubeflow-trainer
    .venv/bin/python bench/operator_bench.py --sizes "" --concurrent 100 --rounds 3 --peers jobset

It starts its own cluster (hack/cluster.sh, instance `bench-operator`) with one fake 8-GPU node
per pod of the largest job, runs the operator as its own process (`python -m tetrad_operator -A`,
default settings) and measures:

- for one job of each size (pods of 8 GPUs, so one per node and the built-in gang must pack the
  whole cluster): apply -> every pod created, -> every gate removed (the gang released), -> every
  pod bound by the kube-scheduler, -> every pod Running (kwok), -> status.phase Running;
- `--concurrent` jobs of 4 pods applied at once: apply -> all pods created, -> all Running (CPU
  and requests are counted until then, as for the peers), and after the benchmark (playing the
  kubelet) marks every pod Succeeded, -> all Succeeded; with the reconciles per second the
  operator did over both (from its own metrics); `--rounds N` runs them N times (bare pods,
  Tetrad, then each peer, in every round) and reports each system's median, every round's
  figure beside it, each round's ratio against that round's bare pods;
- the operator's peak RSS (VmHWM);
- the baseline, in the same run: each job's pods POSTed directly (no gate, no operator, 16 in
  flight), until all Running; the job's time over it is the operator's and the gang's cost.

`--gangs` runs each job once per gang backend: builtin (Tetrad's gates), coscheduling (the
scheduler-plugins scheduler and controller) and kueue (the Kueue manager, one ClusterQueue with
room for everything), each started beside the cluster by `hack/cluster.sh scheduler`.
"Released" is then "no scheduling gate left" (Tetrad's or Kueue's).

`--peers` runs the same jobs, one after the other in the same run, through Kubeflow
training-operator v1, JobSet and Kubeflow Trainer v2 (bench/peers.py), each started by
`hack/cluster.sh peer` at its release manifests' settings; a peer that cannot be started is
reported with the reason and the others still run. Their pods are minimal (one container), or
with `--peer-pods tetrad` carry the content of Tetrad's pod (env, ports, volumes, security), so
that the controllers are compared on pods of one size.

For every job: its controller's CPU seconds (the operator's, or the peer's processes'), the
control plane's (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok: on two
shared cores what a controller makes them do slows every pod), and the apiserver's requests by
verb (apiserver_request_total from its /metrics, every client's: the scheduler's, kwok's and the
controller-manager's too), from the first POST until all is Running; each namespace is deleted
after its figures are taken.

Times are wall-clock seconds from just before the first POST, polled every 0.1 s (0.5 s above 500
pods), so they carry that much resolution. Results go to stdout (a markdown table) and --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.peers import PEERS, Peer, with_pod  # noqa: E402
from tests.cluster_fixtures import Cluster, cluster_script, start_cluster, stop_cluster  # noqa: E402
from tests.operator.conftest import CRDS, free_port  # noqa: E402
from tests.operator.helpers import JOBS, Api, now  # noqa: E402

if TYPE_CHECKING:
    from tetrad.render.objects import Rendered

CLUSTER = "bench-operator"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


GANGS = {"builtin": {}, "coscheduling": {"scheduler": "coscheduling", "timeoutSeconds": 1800},
         "kueue": {"scheduler": "kueue", "queue": "bench"}}
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"


def job(name: str, pods: int, gang: str = "builtin") -> dict[str, Any]:
    return {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
        "metadata": {"name": name},
        "spec": {"nodes": pods, "nprocPerNode": 8, "parallelism": {"dpShard": "auto"},
                 "training": {"globalBatch": 8 * pods},
                 "resources": {"gpu": 8, "cpu": "8", "memory": "64Gi"}, "gang": GANGS[gang]},
    }


def start_gang_scheduler(api: Api, gang: str, nodes: int) -> None:
    """The scheduler behind a gang backend; for Kueue, a ClusterQueue with room for every node."""
    if gang == "builtin":
        return
    up = cluster_script("scheduler", gang, name=CLUSTER)
    if up.returncode:
        raise RuntimeError(f"hack/cluster.sh scheduler {gang} failed:\n{up.stderr[-4000:]}")
    if gang == "kueue":
        api.create(f"{KUEUE}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2",
                                                "kind": "ResourceFlavor",
                                                "metadata": {"name": "bench"}})
        quota = [{"name": "cpu", "nominalQuota": str(96 * nodes)},
                 {"name": "memory", "nominalQuota": f"{1536 * nodes}Gi"},
                 {"name": "nvidia.com/gpu", "nominalQuota": str(8 * nodes)}]
        api.create(f"{KUEUE}/clusterqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "bench"},
            "spec": {"namespaceSelector": {},
                     "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                                         "flavors": [{"name": "bench", "resources": quota}]}]}})


def namespace_for(api: Api, name: str, gang: str) -> None:
    namespace(api, name)
    if gang == "kueue":
        api.create(f"{KUEUE}/namespaces/{name}/localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "bench"},
            "spec": {"clusterQueue": "bench"}})


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def operator_metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def namespace(api: Api, name: str) -> None:
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    deadline = time.monotonic() + 60
    while api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}")
        time.sleep(0.2)


def drop_namespace(api: Api, name: str, timeout: float = 600) -> None:
    api.delete(f"/api/v1/namespaces/{name}")
    deadline = time.monotonic() + timeout
    while api.get(f"/api/v1/namespaces/{name}") is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {name} not gone")
        time.sleep(1)


def rendered_job(name: str, namespace: str, nodes: int) -> Rendered:
    """The objects the operator renders for the benchmark's job `name` of `nodes` pods."""
    from tetrad.api import ParallelTrainingJob
    from tetrad.render.objects import render

    return render(ParallelTrainingJob.model_validate({**job(name, nodes),
                                                      "metadata": {"name": name, "namespace": namespace}}))


def rendered_pods(name: str, namespace: str, nodes: int) -> list[dict[str, Any]]:
    """The pods the operator renders for the benchmark's job `name` of `nodes` pods."""
    return rendered_job(name, namespace, nodes).pods


def tetrad_pod() -> dict[str, Any]:
    """A worker pod as the operator renders it for the concurrent jobs (job j000's rank 1)."""
    return rendered_pods("j000", "ns", 4)[1]


def post_until_running(api: Api, ns: str, pods: list[dict[str, Any]]) -> float:
    """POST `pods` (16 in flight); seconds until the scheduler and kwok have every one Running."""
    interval = 0.1 if len(pods) <= 500 else 0.5
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: api.create(f"/api/v1/namespaces/{ns}/pods", p), pods))
    while sum(p["status"].get("phase") == "Running"
              for p in api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")) < len(pods):
        if time.monotonic() - t0 > 1800:
            raise TimeoutError(f"{len(pods)} bare pods in {ns} not Running after 1800 s")
        time.sleep(interval)
    return time.monotonic() - t0


def bare_pods(api: Api, ns: str, size: int) -> dict[str, float]:
    """Baseline: the same pods POSTed directly (16 in flight, no gate, no operator, no gang);
    seconds until the scheduler and kwok have every one Running. The floor the operator is held
    to."""
    namespace(api, ns)
    pods = rendered_pods("bare", ns, size)
    for pod in pods:
        pod["metadata"]["labels"] = {"bench": "bare"}  # not the operator's: its pod watch must not see them
        pod["metadata"].pop("ownerReferences", None)
        pod["spec"].pop("schedulingGates", None)
    return {"pods_running": post_until_running(api, ns, pods)}


def timeline(api: Api, ns: str, size: int, t0: float,
             job_running: Callable[[], bool] | None) -> dict[str, float]:
    """Seconds from t0 until the namespace's `size` pods are all created, free of gates, bound and
    Running, and until the job itself says Running (where it has a way to say it)."""
    interval = 0.1 if size <= 500 else 0.5
    out: dict[str, float] = {}
    while len(out) < (5 if job_running else 4):
        pods = api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")
        t = time.monotonic() - t0
        complete = len(pods) == size
        if "created" not in out and complete:
            out["created"] = t
        if "released" not in out and complete and not any(p["spec"].get("schedulingGates") for p in pods):
            out["released"] = t  # every gate removed (Tetrad's or Kueue's)
        if "bound" not in out and complete and all(p["spec"].get("nodeName") for p in pods):
            out["bound"] = t  # the scheduler placed every pod
        if "pods_running" not in out and sum(p["status"].get("phase") == "Running" for p in pods) == size:
            out["pods_running"] = t
        if job_running and "phase_running" not in out and job_running():
            out["phase_running"] = t
        if t > 1800:
            raise TimeoutError(f"size {size} in {ns}: {out} after {t:.0f}s")
        time.sleep(interval)
    return out


def one_job(api: Api, ns: str, size: int, gang: str = "builtin") -> dict[str, float]:
    namespace_for(api, ns, gang)
    t0 = time.monotonic()
    api.create(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", job("big", size, gang))
    out = timeline(api, ns, size, t0,
                   lambda: (api.job(ns, "big") or {}).get("status", {}).get("phase") == "Running")
    out["restarts"] = (api.job(ns, "big") or {}).get("status", {}).get("restarts", 0)
    return out


def peer_job(api: Api, ns: str, peer: Peer, size: int) -> dict[str, float]:
    namespace(api, ns)
    t0 = time.monotonic()
    api.create(peer.jobs(ns), peer.body("big", size))
    running = peer.running
    return timeline(api, ns, size, t0, running and (lambda: running(api.get(f"{peer.jobs(ns)}/big") or {})))


def apply_many(api: Api, ns: str, collection: str, body: Callable[[str, int], dict[str, Any]],
               n: int) -> dict[str, float]:
    """n jobs of 4 pods POSTed at once (8 in flight): the seconds until all are applied, until all
    their pods exist and until all are Running, counted from just before the first POST."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: api.create(collection, body(f"j{i:03d}", 4)), range(n)))
    figures = {"applied": time.monotonic() - t0}
    while True:
        pods = api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")
        if len(pods) >= 4 * n:
            figures.setdefault("created", time.monotonic() - t0)
        if sum(p["status"].get("phase") == "Running" for p in pods) >= 4 * n:
            return figures | {"pods_running": time.monotonic() - t0}
        if time.monotonic() - t0 > 1800:
            raise TimeoutError(f"not all pods of {n} jobs in {ns} Running after 1800 s")
        time.sleep(0.5)


def many_peer_jobs(api: Api, ns: str, peer: Peer, n: int) -> dict[str, float]:
    namespace(api, ns)
    return {"jobs": n, **apply_many(api, ns, peer.jobs(ns), peer.body, n)}


def many_jobs(api: Api, ns: str, n: int, metrics_port: int) -> dict[str, float]:
    """n Tetrad jobs applied at once, until every job's phase is Running (what the figures count)."""
    namespace(api, ns)
    reconciles = operator_metric(metrics_port, "tetrad_operator_reconcile_duration_seconds_count")
    t0 = time.monotonic()
    figures = apply_many(api, ns, f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", job, n)
    wait_phases(api, ns, n, "Running", t0)
    all_running = time.monotonic() - t0
    return {"jobs": n, **figures, "all_running": all_running,
            "jobs_per_second": n / all_running, "_t0": t0, "_reconciles_before": reconciles}


def many_jobs_finish(api: Api, ns: str, n: int, metrics_port: int,
                     running: dict[str, float]) -> dict[str, float]:
    """After `many_jobs`, outside its CPU and request figures: the benchmark (playing the kubelet)
    marks every pod Succeeded; the seconds until every job says Succeeded, and the reconciles per
    second over the whole run."""
    t1 = time.monotonic()
    pods = api.list(f"/api/v1/namespaces/{ns}/pods")
    body = {"status": {"phase": "Succeeded", "containerStatuses": [{
        "name": "trainer", "image": "tetrad/trainer:0.1.0", "imageID": "", "ready": False,
        "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(),
                                 "finishedAt": now()}}}]}}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: api.patch(f"/api/v1/namespaces/{ns}/pods/{p['metadata']['name']}/status",
                                          body), pods))
    wait_phases(api, ns, n, "Succeeded", t1)
    all_succeeded = time.monotonic() - t1
    reconciles = (operator_metric(metrics_port, "tetrad_operator_reconcile_duration_seconds_count")
                  - running["_reconciles_before"])
    return {"all_succeeded_after_finish": all_succeeded, "reconciles": reconciles,
            "reconciles_per_second": reconciles / (time.monotonic() - running["_t0"])}


def wait_phases(api: Api, ns: str, n: int, phase: str, t0: float) -> None:
    def phases() -> list[str]:
        return [(j.get("status") or {}).get("phase", "")
                for j in api.list(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs")]

    while sum(p == phase for p in phases()) < n:
        if time.monotonic() - t0 > 1800:
            raise TimeoutError(f"not all {n} jobs {phase}: {phases()}")
        time.sleep(0.5)


def apiserver_requests(cluster: Cluster) -> dict[str, float]:
    """apiserver_request_total by verb, every client's, from the apiserver's own /metrics."""
    totals: dict[str, float] = {}
    for line in cluster.kubectl("get", "--raw", "/metrics").splitlines():
        if line.startswith("apiserver_request_total{") and (verb := re.search(r'verb="([A-Z]+)"', line)):
            totals[verb[1]] = totals.get(verb[1], 0) + float(line.rsplit(" ", 1)[1])
    return totals


def measured(cluster: Cluster, api: Api, ns: str, pids: list[int], run: Callable[[str], dict[str, Any]],
             then: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """run(ns)'s figures, with the CPU seconds the controller's processes (pids) spent meanwhile and
    the apiserver requests made meanwhile, by verb; then `then(ns, figures)`'s figures, and the
    namespace is deleted, both outside the CPU and request figures. Keys starting with "_" are
    run's notes for `then`, left out of the figures."""
    control_plane = component_pids(cluster, CONTROL_PLANE)
    cpu0, requests0 = sum(map(cpu_seconds, pids)), apiserver_requests(cluster)
    control_plane0 = sum(map(cpu_seconds, control_plane))
    r = run(ns)
    r["cpu_seconds"] = sum(map(cpu_seconds, pids)) - cpu0
    r["control_plane_cpu_seconds"] = sum(map(cpu_seconds, control_plane)) - control_plane0
    r["requests"] = {verb: int(n - requests0.get(verb, 0))
                     for verb, n in sorted(apiserver_requests(cluster).items())
                     if n > requests0.get(verb, 0)}
    if then is not None:
        r.update(then(ns, r))
    drop_namespace(api, ns)
    return {k: v for k, v in r.items() if not k.startswith("_")}


def start_peer(cluster: Cluster, peer: Peer) -> list[int]:
    """`hack/cluster.sh peer NAME` (quick when it runs already); the pids of its processes."""
    up = cluster_script("peer", peer.name, name=CLUSTER)
    if up.returncode:
        raise RuntimeError(up.stderr.strip().splitlines()[-1] if up.stderr.strip()
                           else f"exit {up.returncode}")
    return component_pids(cluster, peer.components)


def component_pids(cluster: Cluster, components: Iterable[str]) -> list[int]:
    """The pids of processes `hack/cluster.sh` started for the cluster, by component name."""
    run = Path(cluster.env["TETRAD_CLUSTER_STATE"]) / "run"
    return [int((run / f"{c}.pid").read_text().split()[0]) for c in components]


def requests_text(requests: dict[str, int]) -> str:
    return " ".join(f"{verb} {n}" for verb, n in requests.items() if verb != "WATCH")


def start_operator(cluster: Cluster, port: int,
                   log_name: str = "bench-operator.log") -> subprocess.Popen[bytes]:
    """The operator as its own process (`python -m tetrad_operator -A`, default settings), serving its
    metrics on `port`; returns once they answer. Its log goes to .cache/LOG_NAME."""
    (REPO / ".cache").mkdir(exist_ok=True)
    log = open(REPO / ".cache" / log_name, "wb")  # noqa: SIM115
    # On a starved machine kwok can be late renewing a thousand node leases; a node that flaps
    # NotReady must not restart the gang being measured (restarts are reported).
    # kwok pods have made-up IPs: rank 0's metrics are read from loopback, never from them.
    env = {"TETRAD_OPERATOR_NODE_LOST_SECONDS": "600", **os.environ,
           "KUBECONFIG": str(cluster.kubeconfig), "TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}
    op = subprocess.Popen([sys.executable, "-m", "tetrad_operator", "-A", "--standalone",
                           "--metrics-port", str(port)],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            operator_metric(port, "tetrad_operator_jobs")
            return op
        except OSError:
            if time.monotonic() > deadline or op.poll() is not None:
                op.kill()
                raise RuntimeError(f"the operator did not start; see .cache/{log_name}") from None
            time.sleep(0.5)


@dataclass
class BenchCluster:
    """A kwok cluster of fake 8-GPU nodes with Tetrad's CRDs and the operator (`bench_cluster`)."""

    cluster: Cluster
    api: Api
    port: int  # the operator's metrics
    op: subprocess.Popen[bytes]


@contextmanager
def bench_cluster(nodes: int, keep: bool, log_name: str = "bench-operator.log") -> Iterator[BenchCluster]:
    """The cluster up with `nodes` nodes, the CRDs established and the operator started; afterwards the
    operator stopped and, unless `keep`, the cluster too."""
    t = time.monotonic()
    cluster = start_cluster(CLUSTER, {"TETRAD_NODES": str(nodes), "TETRAD_GPUS_PER_NODE": "8"})
    print(f"cluster with {nodes} nodes up in {time.monotonic() - t:.0f}s", flush=True)
    op = None
    try:
        for crd in CRDS[:2]:
            cluster.kubectl("apply", "--server-side", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        port = free_port()
        op = start_operator(cluster, port, log_name)
        yield BenchCluster(cluster, Api(cluster.kubeconfig), port, op)
    finally:
        if op is not None:
            op.terminate()
            op.wait(30)
        if not keep:
            stop_cluster(CLUSTER)


def result_key(size: int, system: str) -> str:
    return f"job_{size}" if system == "builtin" else f"job_{size}_{system}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,128,1024", help="pods per job, comma-separated")
    p.add_argument("--concurrent", type=int, default=100, help="jobs of 4 pods applied at once (0: skip)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of the concurrent jobs (medians are reported)")
    p.add_argument("--nodes", type=int,
                   help="fake 8-GPU nodes (default: the largest size, at least 4 per concurrent job)")
    p.add_argument("--gangs", default="builtin", help=f"gang backends, comma-separated, of {','.join(GANGS)}")
    p.add_argument("--peers", default="",
                   help=f"peers to run beside Tetrad, comma-separated, of {','.join(PEERS)}")
    p.add_argument("--peer-pods", choices=("minimal", "tetrad"), default="minimal",
                   help="the peers' pods: minimal (one container, what bench/peers.py writes), or with the "
                        "content of Tetrad's pod (env, ports, volumes, security), the same size as "
                        "Tetrad's")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    gangs = [g for g in a.gangs.split(",") if g]
    if unknown := set(gangs) - set(GANGS):
        p.error(f"--gangs: unknown {sorted(unknown)}; choose from {','.join(GANGS)}")
    peers = [PEERS[n] for n in a.peers.split(",") if n in PEERS]
    if a.peer_pods == "tetrad":
        content = tetrad_pod()
        peers = [replace(peer, body=with_pod(peer.body, content)) for peer in peers]
    if unknown := {n for n in a.peers.split(",") if n} - set(PEERS):
        p.error(f"--peers: unknown {sorted(unknown)}; choose from {','.join(PEERS)}")
    nodes = a.nodes or max([*sizes, 4 * a.concurrent])

    results: dict[str, Any] = {"nodes": nodes, "cpus": os.cpu_count(), "unavailable": {},
                               "peer_pods": a.peer_pods}
    if peers and a.peer_pods == "tetrad":
        print("the peers' pods carry Tetrad's pod content (a TrainJob's come from its runtime: unchanged)",
              flush=True)
    peer_pids: dict[str, list[int]] = {}
    with bench_cluster(nodes, a.keep) as bench:
        cluster, api, port, op = bench.cluster, bench.api, bench.port, bench.op
        for gang in gangs:
            start_gang_scheduler(api, gang, nodes)

        def note_peak_rss(system: str) -> None:
            """A peer's peak RSS so far (its processes' VmHWM; one may be restarted later)."""
            if system in peer_pids:
                peak = sum(rss_kib(pid)["VmHWM"] for pid in peer_pids[system])
                results[f"{system}_VmHWM"] = max(peak, results.get(f"{system}_VmHWM", 0))

        def ready(peer: Peer) -> list[int]:
            """The peer running (some share a process and take turns), warmed up after a start."""
            pids = start_peer(cluster, peer)
            if pids != peer_pids.get(peer.name):
                measured(cluster, api, f"bench-warm-up-{peer.name}", [],
                         lambda ns: peer_job(api, ns, peer, 1))
                peer_pids[peer.name] = pids
            return pids

        for peer in peers:
            try:
                ready(peer)
            # it says why, and runs the others
            except (RuntimeError, OSError, AssertionError, TimeoutError) as exc:
                results["unavailable"][peer.name] = str(exc)
                print(f"peer {peer.name} not run: {exc}", flush=True)
        running_peers = [peer for peer in peers if peer.name in peer_pids]
        # Warm up: the first job waits for kopf to list and index every node.
        measured(cluster, api, "bench-warm-up", [], lambda ns: one_job(api, ns, 1))
        results["idle_rss_kib"] = rss_kib(op.pid)["VmRSS"]
        for size in sizes:
            bare = measured(cluster, api, f"bench-bare-{size}", [],
                            lambda ns, size=size: bare_pods(api, ns, size))
            results[f"bare_{size}"] = bare
            print(f"{size} bare pods: all Running {bare['pods_running']:.1f}s", flush=True)
            # (system, its controller's pids once it is ready, its job)
            runs = [(gang, lambda: [op.pid], lambda ns, size=size, gang=gang: one_job(api, ns, size, gang))
                    for gang in gangs]
            runs += [(peer.name, lambda peer=peer: ready(peer),
                      lambda ns, size=size, peer=peer: peer_job(api, ns, peer, size))
                     for peer in running_peers]
            for system, pids, run in runs:
                r = measured(cluster, api, f"bench-{system}-{size}", pids(), run)
                note_peak_rss(system)
                results[result_key(size, system)] = r
                print(f"{size} pods, {system}: created {r['created']:.1f}s, bound {r['bound']:.1f}s, "
                      "all Running "
                      f"{r['pods_running']:.1f}s (bare pods {bare['pods_running']:.1f}s, ratio "
                      f"{r['pods_running'] / bare['pods_running']:.2f}), job Running "
                      f"{r.get('phase_running', float('nan')):.1f}s; "
                      f"CPU {r['cpu_seconds']:.1f}s; requests {requests_text(r['requests'])}", flush=True)
        rounds: list[dict[str, Any]] = []
        for i in range(a.rounds if a.concurrent else 0):  # each round: bare pods, Tetrad, each peer
            bare = measured(cluster, api, f"bench-many-bare-{i}", [],
                            lambda ns: bare_pods(api, ns, 4 * a.concurrent))
            rounds.append(round_ := {"bare": bare})
            round_["builtin"] = r = measured(cluster, api, f"bench-many-{i}", [op.pid],
                                             lambda ns: many_jobs(api, ns, a.concurrent, port),
                                             lambda ns, r: many_jobs_finish(api, ns, a.concurrent, port, r))
            print(f"round {i + 1}: {a.concurrent} jobs: applied in {r['applied']:.1f}s, all pods created "
                  f"{r['created']:.1f}s, Running "
                  f"{r['pods_running']:.1f}s (bare {bare['pods_running']:.1f}s), all Running "
                  f"{r['all_running']:.1f}s, "
                  f"all Succeeded {r['all_succeeded_after_finish']:.1f}s after finishing; "
                  f"{r['reconciles_per_second']:.1f} reconciles/s; CPU {r['cpu_seconds']:.1f}s, "
                  "control plane "
                  f"{r['control_plane_cpu_seconds']:.1f}s", flush=True)
            for peer in running_peers:
                round_[peer.name] = r = measured(
                    cluster, api, f"bench-many-{peer.name}-{i}", ready(peer),
                    lambda ns, peer=peer: many_peer_jobs(api, ns, peer, a.concurrent))
                note_peak_rss(peer.name)
                print(f"round {i + 1}: {a.concurrent} jobs, {peer.name}: applied in {r['applied']:.1f}s, "
                      f"all pods "
                      f"created {r['created']:.1f}s, Running {r['pods_running']:.1f}s; "
                      f"CPU {r['cpu_seconds']:.1f}s, "
                      f"control plane {r['control_plane_cpu_seconds']:.1f}s", flush=True)
        results["concurrent_rounds"] = rounds
        results.update({f"operator_{k}": v for k, v in rss_kib(op.pid).items()})
    print_tables(results, sizes, gangs + [peer.name for peer in peers if peer.name in peer_pids],
                 a.concurrent)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


def print_tables(results: dict[str, Any], sizes: list[int], systems: list[str], concurrent: int) -> None:
    """One markdown table: every job against the bare pods of its size; seconds from apply."""
    def name(system: str) -> str:
        return f"Tetrad, {system} gang" if system in GANGS else system

    if sizes:
        print("\n| pods | system | created | released | bound | all Running | / bare | job Running "
              "| controller CPU s "
              "| apiserver requests (all clients, WATCH left out) |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        bare = results[f"bare_{size}"]
        print(f"| {size} | bare pods (baseline) | | | | {bare['pods_running']:.1f} | 1.00x | | | "
              f"{requests_text(bare['requests'])} |")
        for system in systems:
            r = results[result_key(size, system)]
            job_running = f"{r['phase_running']:.1f}" if "phase_running" in r else "(none)"
            released = f"{r['released']:.1f}" if system in GANGS else ""
            print(f"| {size} | {name(system)} | {r['created']:.1f} | {released} | {r['bound']:.1f} | "
                  f"{r['pods_running']:.1f} | "
                  f"{r['pods_running'] / bare['pods_running']:.2f}x | {job_running} | "
                  f"{r['cpu_seconds']:.1f} | "
                  f"{requests_text(r['requests'])} |")
    if rounds := results.get("concurrent_rounds"):
        # The median of each figure over the rounds; each round's ratio is against its own bare pods.
        def med(system: str, key: str) -> float:
            return statistics.median(r[system][key] for r in rounds)

        def ratios(system: str) -> list[float]:
            return [r[system]["pods_running"] / r["bare"]["pods_running"] for r in rounds]

        print(f"\n| {concurrent} x 4-pod jobs at once, median of {len(rounds)} | applied | all pods created "
              "| all pods Running "
              "(each round) | / bare (each round) | all jobs Running | controller CPU s "
              "| control plane CPU s | "
              "apiserver requests (round 1) |\n|---|---|---|---|---|---|---|---|---|")
        for system in ["bare", *(s for s in systems if s in rounds[0])]:
            first = rounds[0][system]

            def figure(key: str, system: str = system, first: dict[str, Any] = first) -> str:
                return f"{med(system, key):.1f}" if key in first and system != "bare" else ""

            each = " / ".join(f"{r[system]['pods_running']:.1f}" for r in rounds)
            each_ratio = " / ".join(f"{x:.2f}" for x in ratios(system))
            label = f"bare pods ({4 * concurrent}, baseline)" if system == "bare" else name(system)
            print(f"| {label} | {figure('applied')} | {figure('created')} | "
                  f"{med(system, 'pods_running'):.1f} ({each}) | "
                  f"{statistics.median(ratios(system)):.2f}x ({each_ratio}) | {figure('all_running')} | "
                  f"{figure('cpu_seconds')} | {med(system, 'control_plane_cpu_seconds'):.1f} | "
                  f"{requests_text(first['requests'])} |")
        print(f"\nTetrad: all Succeeded {med('builtin', 'all_succeeded_after_finish'):.1f}s after the pods "
              "finished; "
              f"reconciles/s: {med('builtin', 'reconciles_per_second'):.1f}; "
              f"jobs/s to Running: {med('builtin', 'jobs_per_second'):.2f}")
    print(f"operator peak RSS: {results['operator_VmHWM'] / 1024:.0f} MiB "
          f"(idle {results['idle_rss_kib'] / 1024:.0f} MiB)")
    for system in systems:
        if f"{system}_VmHWM" in results:
            print(f"{system} peak RSS: {results[f'{system}_VmHWM'] / 1024:.0f} MiB")
    for system, why in results["unavailable"].items():
        print(f"{system}: not run: {why}")


if __name__ == "__main__":
    sys.exit(main())
