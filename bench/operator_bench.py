"""Benchmark the Tetrad operator on the local control plane with kwok nodes.

    .venv/bin/python bench/operator_bench.py                       # sizes 8,128,1024; 100 concurrent jobs
    .venv/bin/python bench/operator_bench.py --sizes 8,128 --concurrent 20 --keep
    .venv/bin/python bench/operator_bench.py --sizes 1024 --concurrent 0 --gangs builtin,coscheduling,kueue

It starts its own cluster (hack/cluster.sh, instance `bench-operator`) with one fake 8-GPU node
per pod of the largest job, runs the operator as its own process (`python -m tetrad_operator -A`,
default settings) and measures:

- for one job of each size (pods of 8 GPUs, so one per node and the built-in gang must pack the
  whole cluster): apply -> every pod created, -> every gate removed (the gang released), -> every
  pod bound by the kube-scheduler, -> every pod Running (kwok), -> status.phase Running;
- `--concurrent` jobs of 4 pods applied at once: apply -> all Running, and after the benchmark
  (playing the kubelet) marks every pod Succeeded, -> all Succeeded; with the reconciles per
  second the operator did meanwhile (from its own metrics);
- the operator's peak RSS (VmHWM);
- the baseline, in the same run: each job's pods POSTed directly (no gate, no operator, 16 in
  flight), until all Running; the job's time over it is the operator's and the gang's cost.

`--gangs` runs each job once per gang backend: builtin (Tetrad's gates), coscheduling (the
scheduler-plugins scheduler and controller) and kueue (the Kueue manager, one ClusterQueue with
room for everything), each started beside the cluster by `hack/cluster.sh scheduler`.
"Released" is then "no scheduling gate left" (Tetrad's or Kueue's).

Times are wall-clock seconds from just before the first POST, polled every 0.1 s (0.5 s above 500
pods), so they carry that much resolution. Results go to stdout (a markdown table) and --json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster_fixtures import cluster_script, start_cluster, stop_cluster  # noqa: E402
from tests.operator.conftest import CRDS, free_port  # noqa: E402
from tests.operator.helpers import JOBS, Api, now  # noqa: E402

CLUSTER = "bench-operator"


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
        api.create(f"{KUEUE}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                                "metadata": {"name": "bench"}})
        quota = [{"name": "cpu", "nominalQuota": str(96 * nodes)}, {"name": "memory", "nominalQuota": f"{1536 * nodes}Gi"},
                 {"name": "nvidia.com/gpu", "nominalQuota": str(8 * nodes)}]
        api.create(f"{KUEUE}/clusterqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "bench"},
            "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
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


def bare_pods(api: Api, size: int) -> float:
    """Baseline: the same pods POSTed directly (16 in flight, no gate, no operator, no gang);
    seconds until the scheduler and kwok have every one Running. The floor the operator is held to."""
    from tetrad.api import ParallelTrainingJob
    from tetrad.render.objects import render

    ns = f"bench-bare-{size}"
    namespace(api, ns)
    pods = render(ParallelTrainingJob.model_validate({**job("bare", size), "metadata": {"name": "bare", "namespace": ns}})).pods
    for pod in pods:
        pod["metadata"]["labels"] = {"bench": "bare"}  # not the operator's: its pod watch must not see them
        pod["metadata"].pop("ownerReferences", None)
        pod["spec"].pop("schedulingGates", None)
    interval = 0.1 if size <= 500 else 0.5
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: api.create(f"/api/v1/namespaces/{ns}/pods", p), pods))
    while sum(p["status"].get("phase") == "Running" for p in api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")) < size:
        if time.monotonic() - t0 > 1800:
            raise TimeoutError(f"{size} bare pods not Running after 1800 s")
        time.sleep(interval)
    elapsed = time.monotonic() - t0
    drop_namespace(api, ns)
    return elapsed


def one_job(api: Api, size: int, gang: str = "builtin") -> dict[str, float]:
    ns = f"bench-{gang}-{size}"
    namespace_for(api, ns, gang)
    interval = 0.1 if size <= 500 else 0.5
    t0 = time.monotonic()
    api.create(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", job("big", size, gang))
    out: dict[str, float] = {}
    while len(out) < 5:
        pods = api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")
        t = time.monotonic() - t0
        complete = len(pods) == size
        if "created" not in out and complete:
            out["created"] = t
        if "released" not in out and complete and not any(p["spec"].get("schedulingGates") for p in pods):
            out["released"] = t  # the operator removed every gate
        if "bound" not in out and complete and all(p["spec"].get("nodeName") for p in pods):
            out["bound"] = t  # the scheduler placed every pod
        if "pods_running" not in out and sum(p["status"].get("phase") == "Running" for p in pods) == size:
            out["pods_running"] = t
        if "phase_running" not in out and (api.job(ns, "big") or {}).get("status", {}).get("phase") == "Running":
            out["phase_running"] = t
        if t > 1800:
            raise TimeoutError(f"size {size}: {out} after {t:.0f}s")
        time.sleep(interval)
    out["restarts"] = (api.job(ns, "big") or {}).get("status", {}).get("restarts", 0)
    drop_namespace(api, ns)
    return out


def many_jobs(api: Api, n: int, metrics_port: int) -> dict[str, float]:
    ns = "bench-many"
    namespace(api, ns)
    reconciles0 = operator_metric(metrics_port, "tetrad_operator_reconcile_duration_seconds_count")
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: api.create(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", job(f"j{i:03d}", 4)), range(n)))
    applied = time.monotonic() - t0

    def phases() -> list[str]:
        return [(j.get("status") or {}).get("phase", "") for j in api.list(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs")]

    while sum(p == "Running" for p in phases()) < n:
        if time.monotonic() - t0 > 1800:
            raise TimeoutError(f"not all {n} jobs Running: {phases()}")
        time.sleep(0.5)
    all_running = time.monotonic() - t0

    t1 = time.monotonic()
    pods = api.list(f"/api/v1/namespaces/{ns}/pods")
    body = {"status": {"phase": "Succeeded", "containerStatuses": [{
        "name": "trainer", "image": "tetrad/trainer:0.1.0", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}}}]}}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: api.patch(f"/api/v1/namespaces/{ns}/pods/{p['metadata']['name']}/status", body), pods))
    while sum(p == "Succeeded" for p in phases()) < n:
        if time.monotonic() - t1 > 1800:
            raise TimeoutError(f"not all {n} jobs Succeeded: {phases()}")
        time.sleep(0.5)
    all_succeeded = time.monotonic() - t1
    reconciles = operator_metric(metrics_port, "tetrad_operator_reconcile_duration_seconds_count") - reconciles0
    total = time.monotonic() - t0
    drop_namespace(api, ns)
    return {"jobs": n, "applied": applied, "all_running": all_running, "all_succeeded_after_finish": all_succeeded,
            "reconciles": reconciles, "reconciles_per_second": reconciles / total, "jobs_per_second": n / all_running}


def result_key(size: int, gang: str) -> str:
    return f"job_{size}" if gang == "builtin" else f"job_{size}_{gang}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,128,1024", help="pods per job, comma-separated")
    p.add_argument("--concurrent", type=int, default=100, help="jobs of 4 pods applied at once (0: skip)")
    p.add_argument("--nodes", type=int, help="fake 8-GPU nodes (default: the largest size, at least 4 per concurrent job)")
    p.add_argument("--gangs", default="builtin", help=f"gang backends, comma-separated, of {','.join(GANGS)}")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    gangs = [g for g in a.gangs.split(",") if g]
    if unknown := set(gangs) - set(GANGS):
        p.error(f"--gangs: unknown {sorted(unknown)}; choose from {','.join(GANGS)}")
    nodes = a.nodes or max([*sizes, 4 * a.concurrent])

    t = time.monotonic()
    cluster = start_cluster(CLUSTER, {"TETRAD_NODES": str(nodes), "TETRAD_GPUS_PER_NODE": "8"})
    print(f"cluster with {nodes} nodes up in {time.monotonic() - t:.0f}s", flush=True)
    results: dict[str, Any] = {"nodes": nodes, "cpus": os.cpu_count()}
    op = None
    try:
        for crd in CRDS[:2]:
            cluster.kubectl("apply", "--server-side", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        api = Api(cluster.kubeconfig)
        port = free_port()
        (REPO / ".cache").mkdir(exist_ok=True)
        log = open(REPO / ".cache" / "bench-operator.log", "wb")  # noqa: SIM115
        # On a starved machine kwok can be late renewing a thousand node leases; a node that flaps
        # NotReady must not restart the gang being measured (restarts are reported below).
        # kwok pods have made-up IPs: rank 0's metrics are read from loopback, never from them.
        env = {"TETRAD_OPERATOR_NODE_LOST_SECONDS": "600", **os.environ, "KUBECONFIG": str(cluster.kubeconfig),
               "TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}
        op = subprocess.Popen([sys.executable, "-m", "tetrad_operator", "-A", "--standalone", "--metrics-port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                operator_metric(port, "tetrad_operator_jobs")
                break
            except OSError:
                if time.monotonic() > deadline or op.poll() is not None:
                    raise RuntimeError("the operator did not start; see .cache/bench-operator.log") from None
                time.sleep(0.5)
        for gang in gangs:
            start_gang_scheduler(api, gang, nodes)
        # Warm up: the first job waits for kopf to list and index every node.
        one_job(api, 1)
        results["idle_rss_kib"] = rss_kib(op.pid)["VmRSS"]
        for size in sizes:
            bare = bare_pods(api, size)
            for gang in gangs:
                cpu = cpu_seconds(op.pid)
                r = one_job(api, size, gang)
                r["operator_cpu_seconds"] = cpu_seconds(op.pid) - cpu
                r["bare_pods_running"] = bare
                results[result_key(size, gang)] = r
                print(f"{size} pods, {gang}: created {r['created']:.1f}s, released {r['released']:.1f}s, "
                      f"bound {r['bound']:.1f}s, all Running {r['pods_running']:.1f}s (bare pods {bare:.1f}s, ratio "
                      f"{r['pods_running'] / bare:.2f}), phase Running {r['phase_running']:.1f}s; "
                      f"operator CPU {r['operator_cpu_seconds']:.1f}s; restarts {r['restarts']}", flush=True)
        if a.concurrent:
            cpu = cpu_seconds(op.pid)
            r = many_jobs(api, a.concurrent, port)
            r["operator_cpu_seconds"] = cpu_seconds(op.pid) - cpu
            results["concurrent"] = r
            print(f"{a.concurrent} jobs: applied in {r['applied']:.1f}s, all Running {r['all_running']:.1f}s, "
                  f"all Succeeded {r['all_succeeded_after_finish']:.1f}s after finishing; "
                  f"{r['reconciles_per_second']:.1f} reconciles/s", flush=True)
        results.update({f"operator_{k}": v for k, v in rss_kib(op.pid).items()})
    finally:
        if op is not None:
            op.terminate()
            op.wait(30)
        if not a.keep:
            stop_cluster(CLUSTER)
    print("\n| measurement | seconds | operator CPU s |\n|---|---|---|")
    for size in sizes:
        print(f"| {size} bare pods (baseline): POST -> all Running | {results[result_key(size, gangs[0])]['bare_pods_running']:.1f} | |")
        for gang in gangs:
            r, what = results[result_key(size, gang)], f"{size}-pod job" + ("" if gang == "builtin" else f", {gang}")
            print(f"| {what}: apply -> all pods created | {r['created']:.1f} | |")
            print(f"| {what}: apply -> gang released (no gate left) | {r['released']:.1f} | |")
            print(f"| {what}: apply -> all pods bound by the scheduler | {r['bound']:.1f} | |")
            print(f"| {what}: apply -> all pods Running | {r['pods_running']:.1f} | |")
            print(f"| {what} / bare pods (all Running) | {r['pods_running'] / r['bare_pods_running']:.2f}x | |")
            print(f"| {what}: apply -> phase Running | {r['phase_running']:.1f} | {r['operator_cpu_seconds']:.1f} |")
    if "concurrent" in results:
        r = results["concurrent"]
        print(f"| {r['jobs']} x 4-pod jobs: apply -> all Running | {r['all_running']:.1f} | |")
        print(f"| {r['jobs']} x 4-pod jobs: pods finished -> all Succeeded | {r['all_succeeded_after_finish']:.1f} | "
              f"{r['operator_cpu_seconds']:.1f} |")
        print(f"\nreconciles/s: {r['reconciles_per_second']:.1f}; jobs/s to Running: {r['jobs_per_second']:.2f}")
    print(f"operator peak RSS: {results['operator_VmHWM'] / 1024:.0f} MiB (idle {results['idle_rss_kib'] / 1024:.0f} MiB)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
