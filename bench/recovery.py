"""Time to recover from a failed pod, the operator's part, on kwok nodes, beside JobSet's.

    .venv/bin/python bench/recovery.py                                # 128 and 1,024 pods, Tetrad and JobSet
    .venv/bin/python bench/recovery.py --sizes 128 --rounds 3 --peers ""

A job of N pods of 8 GPUs runs on exactly N fake 8-GPU nodes (kwok; bench/operator_bench.py's cluster,
operator and peers). Then one worker pod (rank 1, or index 1) fails the way a kubelet reports it: its
container exited 1 (the operator tests' `terminate`). From that patch, polled every 0.1 s (0.5 s above
500 pods), the seconds until:

- detected: the first pod of the failed incarnation is being deleted (or is gone);
- torn down: none of its pods is left (the next ones need its nodes: the cluster is full);
- created: N pods of the next incarnation exist;
- bound: the scheduler has placed them all;
- Running: all N are Running, where a real gang's containers would start.

Tetrad's job restarts whole gangs with maxRestarts 3 and backoffSeconds 0: the default 10 s backoff is a
policy a user chooses, not the restart's mechanics, and JobSet has none. JobSet's job is the one
bench/peers.py writes, with failurePolicy.maxRestarts 3 (it recreates every child Job). What follows
Running on a real node (the container's start, the rendezvous, the checkpoint load, the first step) is
the trainer's part of a recovery and is not measured here. Each system's controller CPU and the
apiserver's requests are counted over the whole run: the first gang's start and the recovery.

`--in-place` adds the same failure restarted in place (docs/operator.md, "Restarts in place"): the
gang's supervisors restart its processes in the pods they have, without the operator, so the operator's
part is what it does to the pods meanwhile. kwok pods run no process, so a stand-in for rank 0's
metrics on loopback (the operator's TETRAD_OPERATOR_SCRAPE_HOST) reports round 1 at the failure, as
rank 0's gauge tetrad_round does once the gang restarted. Measured: whether any pod was deleted,
created or stopped Running (none may be; the bench fails otherwise), the operator's CPU and the
seconds until status.restartsInPlace counts the round (the operator's bookkeeping, off the recovery
path: a scrape, every 15 s by default, and a pass).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.operator_bench import (  # noqa: E402
    bench_cluster,
    cpu_seconds,
    job,
    measured,
    namespace,
    one_job,
    peer_job,
    requests_text,
    start_peer,
    timeline,
)
from bench.peers import PEERS, Peer  # noqa: E402
from tests.operator.helpers import JOBS, Api, terminate  # noqa: E402

PHASES = ("detected", "torn_down", "created", "bound", "running")
JOBSET_INDEX = "batch.kubernetes.io/job-completion-index"


def recovery(api: Api, ns: str, size: int, failed: set[str], t0: float) -> dict[str, float]:
    """Seconds from t0 (the failure) until each of PHASES; `failed` holds the uids of the failed
    incarnation's pods."""
    interval = 0.1 if size <= 500 else 0.5
    out: dict[str, float] = {}
    while len(out) < len(PHASES):
        pods = api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")
        t = time.monotonic() - t0
        old = [p for p in pods if p["metadata"]["uid"] in failed]
        new = [p for p in pods if p["metadata"]["uid"] not in failed]
        if "detected" not in out and (len(old) < len(failed)
                                      or any(p["metadata"].get("deletionTimestamp") for p in old)):
            out["detected"] = t
        if "torn_down" not in out and not old:
            out["torn_down"] = t
        complete = len(new) >= size
        if "created" not in out and complete:
            out["created"] = t
        if "bound" not in out and complete and all(p["spec"].get("nodeName") for p in new):
            out["bound"] = t
        if "running" not in out and sum(p["status"].get("phase") == "Running" for p in new) >= size:
            out["running"] = t
        if t > 1800:
            raise TimeoutError(f"size {size} in {ns}: {out} after {t:.0f}s")
        time.sleep(interval)
    return out


def fail_one(api: Api, ns: str, size: int, label: str) -> dict[str, float]:
    """The job's pods are Running: fail the one whose `label` is 1 (rank 1; pod 0 when alone) as its
    kubelet would, and time the recovery."""
    pods = api.list(f"/api/v1/namespaces/{ns}/pods")
    victim = next((p for p in pods if p["metadata"].get("labels", {}).get(label) == "1"), pods[0])
    t0 = time.monotonic()
    terminate(api, ns, victim["metadata"]["name"], 1)
    return recovery(api, ns, size, {p["metadata"]["uid"] for p in pods}, t0)


def tetrad_recovery(api: Api, ns: str, size: int) -> dict[str, Any]:
    from tetrad.api.contract import LABEL_RANK

    namespace(api, ns)
    body = job("big", size)
    body["spec"]["runPolicy"] = {"maxRestarts": 3, "backoffSeconds": 0}
    t0 = time.monotonic()
    api.create(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", body)
    timeline(api, ns, size, t0, None)
    out: dict[str, Any] = dict(fail_one(api, ns, size, LABEL_RANK))
    out["restarts"] = (api.job(ns, "big") or {}).get("status", {}).get("restarts", 0)
    return out


class Rank0:
    """Rank 0's figures as the operator scrapes them from loopback: a heartbeat, the step, and the round
    of restarts in place the gang is in."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        from tetrad.api import contract
        from tetrad.launch.local import free_port

        registry = CollectorRegistry()
        self.round = Gauge(contract.METRIC_ROUND, "", [contract.LABEL_ROUND_CAUSE], registry=registry)
        self.round.labels("").set(0)
        Gauge(contract.METRIC_STEP, "", registry=registry).set(10)
        Gauge(contract.METRIC_TRAIN_SECONDS, "", registry=registry).set(30)
        Gauge(contract.METRIC_LAST_STEP_TIME, "", registry=registry).set_function(time.time)
        self.port = free_port()  # tetrad.launch.local's
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def next_round(self, cause: str) -> None:
        self.round.clear()
        self.round.labels(cause).set(1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def in_place_recovery(api: Api, ns: str, size: int, operator_pid: int) -> dict[str, Any]:
    """A job of `size` pods runs, then its gang restarts in place: the operator's part, with the pods kept."""
    namespace(api, ns)
    rank0 = Rank0()
    try:
        body = job("big", size)
        body["spec"]["runPolicy"] = {"maxRestarts": 3, "backoffSeconds": 0}
        body["spec"]["metrics"] = {"port": rank0.port}
        api.create(f"{JOBS}/namespaces/{ns}/paralleltrainingjobs", body)
        timeline(api, ns, size, time.monotonic(), None)
        return restart_in_place(api, ns, "big", rank0, operator_pid)
    finally:
        rank0.close()


def restart_in_place(api: Api, ns: str, name: str, rank0: Rank0, operator_pid: int) -> dict[str, Any]:
    """Job `name` runs with its metrics on `rank0`'s port: its gang restarts in place (rank 0 reports
    round 1). Seconds until status.restartsInPlace counts it, and the operator's CPU meanwhile; raises if
    a pod is deleted, created or stops Running meanwhile."""
    while ((api.job(ns, name) or {}).get("status", {}).get("trainerTime") or {}).get("round") != 0:
        time.sleep(0.5)  # the operator has read round 0
    before = {p["metadata"]["uid"] for p in api.list(f"/api/v1/namespaces/{ns}/pods")}
    interval = 0.1 if len(before) <= 500 else 0.5
    cpu0, t0 = cpu_seconds(operator_pid), time.monotonic()
    rank0.next_round("node 1 exited 137 (bench: a worker's SIGKILL)")
    while True:
        pods = api.list(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")
        running = [p for p in pods if p["status"].get("phase") == "Running"
                   and not p["metadata"].get("deletionTimestamp")]
        if {p["metadata"]["uid"] for p in running} != before or len(pods) != len(before):
            raise RuntimeError(f"{ns}/{name}: a pod was deleted, created or stopped in place")
        status = (api.job(ns, name) or {}).get("status", {})
        if status.get("restartsInPlace") == 1:
            return {"counted": time.monotonic() - t0, "round_cpu_seconds": cpu_seconds(operator_pid) - cpu0,
                    "restarts": status.get("restarts", 0)}
        if time.monotonic() - t0 > 600:
            raise TimeoutError(f"{ns}/{name}: round 1 not counted after 600 s: {status}")
        time.sleep(interval)


def restartable(peer: Peer, name: str, size: int, *resources: Any) -> dict[str, Any]:
    """The peer's job (JobSet's) that recreates every child Job after a failure, up to 3 times."""
    body = peer.body(name, size, *resources)
    body["spec"]["failurePolicy"] = {"maxRestarts": 3}
    return body


def peer_recovery(api: Api, ns: str, peer: Peer, size: int) -> dict[str, Any]:
    namespace(api, ns)
    t0 = time.monotonic()
    api.create(peer.jobs(ns), restartable(peer, "big", size))
    timeline(api, ns, size, t0, None)
    return dict(fail_one(api, ns, size, JOBSET_INDEX))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="128,1024", help="pods per job, comma-separated")
    p.add_argument("--peers", default="jobset", help="peers to run beside Tetrad (jobset; '' for none)")
    p.add_argument("--rounds", type=int, default=1, help="recoveries of each size and system (medians)")
    p.add_argument("--in-place", action="store_true", help="add the failure restarted in place (Tetrad)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    names = [n for n in a.peers.split(",") if n]
    if unknown := set(names) - {"jobset"}:
        p.error(f"--peers: {sorted(unknown)}: only jobset restarts a whole gang the way Tetrad does")
    nodes = max(sizes)
    results: dict[str, Any] = {"nodes": nodes, "cpus": os.cpu_count(), "runs": {}, "in_place": {}}
    with bench_cluster(nodes, a.keep, "bench-recovery.log") as bench:
        cluster, api, op = bench.cluster, bench.api, bench.op
        systems: list[tuple[str, list[int], Any]] = [
            ("Tetrad", [op.pid], lambda ns, size: tetrad_recovery(api, ns, size))]
        for name in names:
            peer = PEERS[name]
            pids = start_peer(cluster, peer)
            measured(cluster, api, f"bench-warm-up-{name}", [],
                     lambda ns, peer=peer: peer_job(api, ns, peer, 1))
            systems.append((name, pids, lambda ns, size, peer=peer: peer_recovery(api, ns, peer, size)))
        measured(cluster, api, "bench-warm-up", [], lambda ns: one_job(api, ns, 1))
        for size in sizes:
            for i in range(a.rounds):
                for system, pids, run in systems:
                    r = measured(cluster, api, f"bench-recover-{system.lower()}-{size}-{i}", pids,
                                 lambda ns, run=run, size=size: run(ns, size))
                    results["runs"].setdefault(f"{size}/{system}", []).append(r)
                    phases = ", ".join(f"{k} {r[k]:.1f}s" for k in PHASES)
                    print(f"{size} pods, {system}, round {i + 1}: {phases}; CPU {r['cpu_seconds']:.1f}s; "
                          f"requests {requests_text(r['requests'])}", flush=True)
                if a.in_place:
                    r = measured(cluster, api, f"bench-recover-in-place-{size}-{i}", [op.pid],
                                 lambda ns, size=size: in_place_recovery(api, ns, size, op.pid))
                    results["in_place"].setdefault(str(size), []).append(r)
                    print(f"{size} pods, Tetrad in place, round {i + 1}: no pod touched; counted after"
                          f" {r['counted']:.1f}s; CPU during the round {r['round_cpu_seconds']:.2f}s",
                          flush=True)
    print_table(results["runs"])
    print_in_place(results["in_place"], results["runs"])
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    print("\n| pods | system | detected | torn down | created | bound | all Running (each round) "
          "| / Tetrad | controller CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, rs in runs.items():
        size, system = key.split("/")
        median = {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "cpu_seconds")}
        tetrad = runs.get(f"{size}/Tetrad")
        base = statistics.median(r["running"] for r in tetrad) if tetrad else float("nan")
        ratio = median["running"] / base
        each = " / ".join(f"{r['running']:.1f}" for r in rs)
        print(f"| {size} | {system} | {median['detected']:.1f} | {median['torn_down']:.1f} | "
              f"{median['created']:.1f} | {median['bound']:.1f} | {median['running']:.1f} ({each}) | "
              f"{ratio:.2f}x | {median['cpu_seconds']:.1f} |")


def print_in_place(in_place: dict[str, list[dict[str, Any]]], runs: dict[str, list[dict[str, Any]]]) -> None:
    if not in_place:
        return
    print("\n| pods | in place: pods deleted, created or stopped | counted in status (each round) "
          "| operator CPU s in the round | recreate: all Running again | operator's part / recreate |")
    print("|---|---|---|---|---|---|")
    for size, rs in in_place.items():
        counted = statistics.median(r["counted"] for r in rs)
        each = " / ".join(f"{r['counted']:.1f}" for r in rs)
        cpu = statistics.median(r["round_cpu_seconds"] for r in rs)
        recreate = runs.get(f"{size}/Tetrad")
        base = statistics.median(r["running"] for r in recreate) if recreate else float("nan")
        print(f"| {size} | 0 | {counted:.1f} ({each}) | {cpu:.2f} | {base:.1f} | 0.00x |")


if __name__ == "__main__":
    sys.exit(main())
