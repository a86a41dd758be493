"""Time to recover on the real kubelet nodes: from a fault to the first completed step after it, phase by
phase, Tetrad in place and in new pods, beside JobSet, in one run.

    .venv/bin/python bench/recovery_nodes.py                                  # root; every case, 2 rounds
    .venv/bin/python bench/recovery_nodes.py --cases tetrad-in-place,jobset --rounds 1 --keep [--reuse]

It brings up hack/cluster.sh's real-node cluster `bench-recovery` (a control plane and two kubelet nodes
with containerd, as the e2e tests have), builds or takes the images and installs the chart (hack/e2e.sh
install), and starts JobSet beside it (hack/cluster.sh peer jobset). Every case trains the same job:
examples/quickstart.yaml (the debug model, 2 pods x 4 processes, CPU/gloo, fp32; 4Gi pods, room for a
spare interpreter) with a checkpoint every 4 steps on a hostPath both nodes see and backoffSeconds 0 (the
default 10 s is a policy; JobSet has none). JobSet runs it as Tetrad's pods would (`jobset_of`: the same
image, command, config and volumes; one replicated Job of 2 indexed pods, failurePolicy.maxRestarts 3).
Once rank 0 has committed its second checkpoint and logged a step after it, pod 1 meets the case's fault
(CASES):

- a worker's SIGKILL (one worker process; its supervisor and torchrun stay): Tetrad restarts the gang in
  its own pods; under JobSet torchrun and the container exit, and JobSet recreates its child Jobs. The
  baseline of restarts in place, `tetrad-recreate`, SIGKILLs every process of the container: what a
  worker's SIGKILL came to before them (the container exits 137, the operator recreates the gang).
- the pod deleted (`kubectl delete pod`): Tetrad's trainer saves and exits 75, the gang is recreated;
  JobSet recreates its child Jobs.
- a stall (pod 1's workers SIGSTOPped; stallTimeoutSeconds 30): the operator asks pod 0's coordinator to
  restart the gang in place. JobSet cannot express it (it has no stall detection).
- a lost node (pod 1's node dies: every process of it, kubelet, containerd and containers, is SIGKILLed
  and its bridge goes down, so no peer hears a reset): Tetrad recreates the gang once the node has been
  NotReady for TETRAD_OPERATOR_NODE_LOST_SECONDS (60 s) or pod 0 fails first; JobSet once the node
  controller evicts the pod (its unreachable toleration, 300 s). The cluster gets one real node more for
  each such trial, as the new gang needs two live nodes and a lost node stays lost.

From the fault (this machine's clock, which the nodes share), the seconds until the end of each phase,
read from the API's timestamps (whole seconds) and rank 0's container log (`kubectl logs --timestamps`):

- in place: `stopped` (node 0's supervisor logs the restart: every node's workers are gone);
- in new pods: `detected` (the controller deletes the first old pod that is not pod 1), `torn_down` (no
  old pod is left), `created`, `scheduled`, `started` (the last new pod's; `started`: its container
  runs);
- then both: `rendezvous` (rank 0 logs the mesh: the process group formed), `loaded` (rank 0 resumed
  the checkpoint), `first_step` (rank 0 completed its first step).

Each case's figure is the median over --rounds, the cases alternating; the checkpoint's size is on the
disk of the hostPath.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster_fixtures import (  # noqa: E402
    FAKE_NODE_TAINT,
    HACK,
    REAL_NODES,
    RealCluster,
    cluster_script,
    node_processes,
    start_cluster,
    stop_cluster,
    wait_until,
)
from tetrad.node.rounds import RESTARTING  # noqa: E402
from tetrad.node.spare import READY  # noqa: E402

NAME = "bench-recovery"


@dataclass(frozen=True)
class Case:
    fault: str  # kill-worker, kill-container, delete-pod or stall (`fault`)
    jobset: bool  # the job runs as a JobSet, else as a ParallelTrainingJob
    in_place: bool  # the gang recovers in its own pods
    says: str  # the report's row


CASES = {
    "tetrad-in-place": Case("kill-worker", False, True, "worker SIGKILL | Tetrad, in place"),
    "tetrad-recreate": Case("kill-container", False, False,
                            "worker SIGKILL | Tetrad in new pods (its container killed, as before)"),
    "jobset": Case("kill-worker", True, False, "worker SIGKILL | JobSet"),
    "tetrad-deleted": Case("delete-pod", False, False, "pod deleted | Tetrad (saves on SIGTERM)"),
    "jobset-deleted": Case("delete-pod", True, False, "pod deleted | JobSet"),
    "tetrad-stall": Case("stall", False, True, "stall (workers stopped) | Tetrad, in place"),
    "tetrad-node-lost": Case("lose-node", False, False, "node lost (killed, network down) | Tetrad"),
    "jobset-node-lost": Case("lose-node", True, False, "node lost | JobSet"),
}
STALL_TIMEOUT_S = 30
IN_PLACE_PHASES = ("stopped", "rendezvous", "loaded", "first_step")
NEW_POD_PHASES = ("detected", "torn_down", "created", "scheduled", "started", "rendezvous", "loaded",
                  "first_step")
# rank 0's log lines that end the trainer's phases (tetrad_trainer/train.py, tetrad/node/supervisor.py)
MARKS = {"stopped": RESTARTING, "rendezvous": ": mesh ", "loaded": "checkpoint: resumed step",
         "first_step": "first step after"}
JOBSET_INDEX = "batch.kubernetes.io/job-completion-index"
TIMEOUT_S = 900.0
# A lost node's pods are evicted 300 s after it goes NotReady (the default unreachable toleration): a
# system that has not recovered 300 s after that will not without an operator's hand.
LOST_NODE_TIMEOUT_S = 700.0


def the_job(ns: str, store: Path) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["metadata"] = {"name": "rec", "namespace": ns}
    job["spec"]["training"] = {**job["spec"].get("training", {}), "steps": 2000}
    job["spec"]["checkpoint"] = {"enabled": True, "interval": 4,
                                 "volume": {"hostPath": {"path": str(store), "type": "Directory"}}}
    job["spec"]["resources"] = {**job["spec"]["resources"], "memory": "4Gi"}  # room for a spare (1 GiB)
    job["spec"]["runPolicy"] = {"maxRestarts": 3, "backoffSeconds": 0, "terminationGracePeriodSeconds": 30,
                                "stallTimeoutSeconds": STALL_TIMEOUT_S}
    return job


def jobset_of(job: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """`job` as a JobSet of the same pods: Tetrad's rendered pod and ConfigMaps, renamed to the JobSet's,
    each pod's node rank its completion index, the master its pod 0's name in the JobSet's Service, and
    without Tetrad's restarts in place (a JobSet restarts in new pods)."""
    name, ns = "rec-js", job["metadata"]["namespace"]
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    rendered = list(yaml.safe_load_all(subprocess.run(
        [sys.executable, "-m", "tetrad.cli", "render", str(work / "job.yaml")], check=True,
        capture_output=True, text=True).stdout))
    master = f"{job['metadata']['name']}-0.{job['metadata']['name']}.{ns}.svc"
    ours = f"{name}-node-0-0.{name}.{ns}.svc"
    renamed = {}
    objects = []
    for cm in (d for d in rendered if d and d["kind"] == "ConfigMap"):
        new = f"{name}-{cm['metadata']['name'].rsplit('-', 1)[-1]}"
        renamed[cm["metadata"]["name"]] = new
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": new, "namespace": ns},
                        "data": {k: v.replace(master, ours) for k, v in cm.get("data", {}).items()},
                        "binaryData": cm.get("binaryData", {})})
    pod = next(d for d in rendered if d and d["kind"] == "Pod")
    spec = copy.deepcopy(pod["spec"])
    for key in ("hostname", "subdomain", "schedulingGates", "nodeName", "affinity"):
        spec.pop(key, None)
    container = spec["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] not in ("TETRAD_ROUNDS", "PET_NODE_RANK")]
    container["env"].append({"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{JOBSET_INDEX}']"}}})
    for source in container.get("envFrom", []):
        source["configMapRef"]["name"] = renamed[source["configMapRef"]["name"]]
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"]["name"] = renamed[volume["configMap"]["name"]]
    nodes = job["spec"]["nodes"]
    pods = {"parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
            "template": {"spec": spec}}
    objects.append({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"failurePolicy": {"maxRestarts": 3}, "network": {"enableDNSHostnames": True},
                             "replicatedJobs": [{"name": "node", "replicas": 1,
                                                 "template": {"spec": pods}}]}})
    return objects


# ---------------------------------------------------------------------------- what the API and logs tell


def epoch(stamp: str | None) -> float | None:
    """An API or log timestamp (RFC 3339, any fraction) as seconds since the epoch."""
    if not stamp:
        return None
    whole, _, rest = stamp.rstrip("Z").partition(".")
    fraction = float(f"0.{rest}") if rest else 0.0
    return datetime.fromisoformat(whole + "+00:00").timestamp() + fraction


def pods_of(c: RealCluster, ns: str) -> list[dict[str, Any]]:
    """The job's trainer pods, Tetrad's or the JobSet's, rank by rank within each incarnation."""
    items: list[dict[str, Any]] = c.kubectl_json("get", "pods", "-n", ns)["items"]
    return [p for p in items if p["metadata"]["name"].startswith("rec-")]


def rank(pod: dict[str, Any]) -> int:
    labels, annotations = pod["metadata"].get("labels", {}), pod["metadata"].get("annotations", {})
    return int(labels.get("tetrad.dev/node-rank", annotations.get(JOBSET_INDEX, "0")))


def deleted(pod: dict[str, Any]) -> float | None:
    """When the pod's deletion was asked for: its deletionTimestamp is that plus the grace period."""
    at = epoch(pod["metadata"].get("deletionTimestamp"))
    return None if at is None else at - pod["metadata"].get("deletionGracePeriodSeconds", 0)


def log_marks(c: RealCluster, ns: str, pod: str, after: float) -> dict[str, float]:
    """When rank 0's log first said each of MARKS after `after` (epoch seconds)."""
    proc = c.run_kubectl("logs", "--timestamps", "-n", ns, pod, "-c", "trainer")
    seen: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        stamp, _, text = line.partition(" ")
        at = epoch(stamp)
        if at is None or at < after:
            continue
        for phase, mark in MARKS.items():
            if phase not in seen and mark in text:
                seen[phase] = at
    return seen


def trained_past_a_checkpoint(c: RealCluster, ns: str, pod: str) -> bool:
    """Rank 0 committed its second checkpoint and logged a step after it: a fault now loses steps."""
    text = c.run_kubectl("logs", "-n", ns, pod, "-c", "trainer").stdout
    commits = [i for i, line in enumerate(text.splitlines()) if "checkpoint: committed step" in line]
    return len(commits) >= 2 and any('"step"' in line for line in text.splitlines()[commits[-1] + 1:])


def checkpoint_bytes(store: Path) -> int:
    """The newest committed checkpoint's size on disk (the one its `latest` file names)."""
    latest = next(store.rglob("latest"))
    newest = latest.parent / latest.read_text().strip()
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------- one fault, one system


def node_pids(index: int) -> set[int]:
    """Every process of real node `index`: what its cgroup (hack/cluster/real-nodes.sh) holds, in any
    hierarchy."""
    pids: set[int] = set()
    for mount in Path("/sys/fs/cgroup").iterdir():
        if mount.is_symlink() or not (mount / f"tetrad-{NAME}-n{index}").is_dir():
            continue
        for procs in (mount / f"tetrad-{NAME}-n{index}").rglob("cgroup.procs"):
            try:
                pids.update(int(pid) for pid in procs.read_text().split())
            except OSError:
                continue
    return pids


def lose_node(index: int) -> None:
    """Real node `index` dies as a machine does: its network goes down first (no peer hears a reset), then
    every process of it is SIGKILLed until none is left."""
    addresses = subprocess.run(["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True,
                               text=True).stdout.splitlines()
    bridge = next(line.split()[1] for line in addresses if f" 198.18.{index}.1/24 " in line)
    subprocess.run(["ip", "link", "set", bridge, "down"], check=True)
    deadline = time.monotonic() + 20
    while pids := node_pids(index):
        if time.monotonic() > deadline:
            raise RuntimeError(f"real-node-{index} still has processes {sorted(pids)} after 20 s of SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def fault(c: RealCluster, ns: str, pod: dict[str, Any], kind: str) -> float:
    """The fault `kind` to `pod`; when (epoch seconds)."""
    if kind == "lose-node":
        at = time.time()
        lose_node(int(pod["spec"]["nodeName"].rsplit("-", 1)[1]))
        return at
    if kind == "delete-pod":
        at = time.time()
        c.kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns, "--wait=false")
        return at
    pids = node_processes(pod["metadata"]["uid"], workers_only=kind != "kill-container")
    assert pids, f"no trainer process of {pod['metadata']['name']} on this machine"
    at = time.time()
    for pid in pids[:1] if kind == "kill-worker" else pids:
        os.kill(pid, signal.SIGSTOP if kind == "stall" else signal.SIGKILL)
    return at


def in_place(c: RealCluster, ns: str, before: list[dict[str, Any]], fault: float) -> dict[str, float]:
    rank0 = next(p for p in before if rank(p) == 0)["metadata"]["name"]
    def ran_a_step() -> dict[str, float] | None:
        marks = log_marks(c, ns, rank0, fault)
        return marks if "first_step" in marks else None

    marks = wait_until(ran_a_step, timeout=TIMEOUT_S, interval=2, what="rank 0's first step in place")
    assert all(p["metadata"]["uid"] in {q["metadata"]["uid"] for q in pods_of(c, ns)} for p in before), \
        "the gang got new pods"
    return {phase: marks[phase] - fault for phase in IN_PLACE_PHASES}


def stuck(c: RealCluster, ns: str, before: list[dict[str, Any]], fault: float) -> str:
    """What the job's pods are, for a recovery that never came: the old ones' phase and deletion."""
    old = {p["metadata"]["uid"] for p in before}
    says = []
    for p in pods_of(c, ns):
        gone = deleted(p)
        says.append(f"{p['metadata']['name']} ({'old' if p['metadata']['uid'] in old else 'new'}, "
                    f"{p['status'].get('phase')}"
                    + (f", deleted at +{gone - fault:.0f}s" if gone is not None else "") + ")")
    return "; ".join(says) or "no pod"


def in_new_pods(c: RealCluster, ns: str, before: list[dict[str, Any]], fault: float,
                timeout: float = TIMEOUT_S) -> dict[str, float]:
    old = {p["metadata"]["uid"] for p in before}
    seen: dict[str, float] = {}

    def new_gang_ran_a_step() -> list[dict[str, Any]] | None:
        pods = pods_of(c, ns)
        left = [p for p in pods if p["metadata"]["uid"] in old]
        deleting = [deleted(p) for p in left if rank(p) != 1]
        if "detected" not in seen and any(deleting):
            seen["detected"] = min(t for t in deleting if t is not None)
        if "torn_down" not in seen and not left:
            seen["torn_down"] = time.time()
        new = [p for p in pods
               if p["metadata"]["uid"] not in old and not p["metadata"].get("deletionTimestamp")]
        rank0 = next((p for p in new if rank(p) == 0), None)
        if rank0 is None or len(new) < len(before):
            return None
        if not log_marks(c, ns, rank0["metadata"]["name"], fault).get("first_step"):
            return None
        return new

    new = wait_until(new_gang_ran_a_step, timeout=timeout, interval=0.5, what="the new gang's first step")
    seen.setdefault("detected", seen.get("torn_down", time.time()))

    def latest(times: list[float | None]) -> float:
        return max(t for t in times if t is not None)

    seen["created"] = latest([epoch(p["metadata"]["creationTimestamp"]) for p in new])
    seen["scheduled"] = latest([epoch(next((k["lastTransitionTime"] for k in p["status"]["conditions"]
                                            if k["type"] == "PodScheduled"), None)) for p in new])
    seen["started"] = latest([epoch(s["state"].get("running", {}).get("startedAt"))
                              for p in new for s in p["status"]["containerStatuses"]])
    rank0 = next(p for p in new if rank(p) == 0)["metadata"]["name"]
    seen.update(log_marks(c, ns, rank0, fault))
    return {phase: seen[phase] - fault for phase in NEW_POD_PHASES if phase in seen}  # a lost node's pod:
    # never torn down, unless force-deleted


def trial(c: RealCluster, name: str, work: Path) -> dict[str, Any]:
    ns = f"rec-{uuid.uuid4().hex[:6]}"
    store = work / ns
    store.mkdir(parents=True)
    store.chmod(0o777)  # the trainer runs as uid 1000; a hostPath keeps the host's owner
    c.kubectl("create", "namespace", ns)
    job = the_job(ns, store)
    try:
        case = CASES[name]
        for obj in jobset_of(job, work) if case.jobset else [job]:
            c.apply(obj, namespace=ns)
        before = wait_until(lambda: (p := pods_of(c, ns)) and len(p) == job["spec"]["nodes"]
                            and all(q["status"].get("phase") == "Running" for q in p) and p,
                            timeout=TIMEOUT_S, interval=2, what="the gang Running")
        rank0 = next(p for p in before if rank(p) == 0)["metadata"]["name"]
        wait_until(lambda: trained_past_a_checkpoint(c, ns, rank0), timeout=TIMEOUT_S, interval=2,
                   what="a step after the second checkpoint")
        if case.in_place:  # a failure long after the start, as most are: each node's spare is ready
            wait_until(lambda: all(READY in c.run_kubectl("logs", "-n", ns, p["metadata"]["name"], "-c",
                                                          "trainer").stdout for p in before),
                       timeout=TIMEOUT_S, interval=2, what="the spares ready")
        victim = next(p for p in before if rank(p) == 1)
        at = fault(c, ns, victim, case.fault)
        if case.in_place:
            phases = in_place(c, ns, before, at)
        elif case.fault == "lose-node":  # a system may never recover from it: say what is stuck
            try:
                phases = in_new_pods(c, ns, before, at, timeout=LOST_NODE_TIMEOUT_S)
            except TimeoutError:
                return {"case": name, "phases": {}, "checkpoint_bytes": checkpoint_bytes(store),
                        "stuck": stuck(c, ns, before, at)}
        else:
            phases = in_new_pods(c, ns, before, at)
        return {"case": name, "phases": phases, "checkpoint_bytes": checkpoint_bytes(store)}
    finally:
        if CASES[name].fault == "lose-node":  # its pod there stays Terminating: no kubelet confirms it
            c.run_kubectl("delete", "pods", "--all", "-n", ns, "--force", "--grace-period=0")
        c.run_kubectl("delete", "namespace", ns, "--wait=true", "--timeout=300s")


def report(results: list[dict[str, Any]], cases: list[str]) -> None:
    """A Markdown table of each case's medians, the in-place worker SIGKILL's first step the baseline."""
    print("\n| fault | system | " + " | ".join(NEW_POD_PHASES) + " | / in place |")
    print("|---|---|" + "---|" * (len(NEW_POD_PHASES) + 1))
    medians = {}
    for name in cases:
        if runs := [r["phases"] for r in results if r["case"] == name and "stuck" not in r]:
            medians[name] = {p: statistics.median(r[p] for r in runs) for p in runs[0]}
    base = medians.get("tetrad-in-place", {}).get("first_step")
    for name in cases:
        for r in results:
            if r["case"] == name and "stuck" in r:
                print(f"| {CASES[name].says} | no recovery within {LOST_NODE_TIMEOUT_S:.0f}s: {r['stuck']} |")
        if name not in medians:
            continue
        cells = [f"{medians[name][p]:.1f}" if p in medians[name] else "" for p in NEW_POD_PHASES]
        if "stopped" in medians[name]:
            cells[0] = f"stopped {medians[name]['stopped']:.1f}"
        each = " / ".join(f"{r['phases']['first_step']:.1f}" for r in results
                          if r["case"] == name and "stuck" not in r)
        cells[-1] = f"**{cells[-1]}** ({each})"
        ratio = f"{medians[name]['first_step'] / base:.2f}x" if base else ""
        print(f"| {CASES[name].says} | " + " | ".join(cells) + f" | {ratio} |")
    sizes = {r["checkpoint_bytes"] for r in results}
    print(f"\ncheckpoint: {min(sizes) / 2**20:.1f}-{max(sizes) / 2**20:.1f} MiB on disk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="of: " + ", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    parser.add_argument("--reuse", action="store_true", help="use the cluster a --keep left up")
    args = parser.parse_args()
    cases = [name for name in args.cases.split(",") if name]
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    if os.geteuid() != 0:
        sys.exit("real nodes need root (bridges, cgroups, containerd)")
    if not args.reuse:
        stop_cluster(NAME, missing_ok=True)
    t0 = time.monotonic()
    lost = args.rounds * sum(CASES[name].fault == "lose-node" for name in cases)
    c = RealCluster(**vars(start_cluster(NAME, extra_env={
        "TETRAD_NODES": "1", "TETRAD_REAL_NODES": str(REAL_NODES + lost),
        "TETRAD_NODE_TAINT": FAKE_NODE_TAINT})))
    try:
        subprocess.run([str(HACK / "e2e.sh"), "install"], check=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, "TETRAD_CLUSTER_NAME": NAME})
        if any(CASES[name].jobset for name in cases):
            up = cluster_script("peer", "jobset", name=NAME)
            if up.returncode:
                raise RuntimeError(f"hack/cluster.sh peer jobset: {up.stderr[-2000:]}")
        print(f"cluster, images, chart and peers ready in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        work = Path(c.env["TETRAD_CLUSTER_STATE"]) / "bench-recovery"
        results = []
        for round in range(args.rounds):
            for name in cases:
                result = trial(c, name, work)
                print(json.dumps({"round": round, **result}), flush=True)
                results.append(result)
        report(results, cases)
    finally:
        if not args.keep:
            stop_cluster(NAME)


if __name__ == "__main__":
    main()
