"""Tetrad end to end on real nodes: the chart's operator in its container, trainer pods that
rendezvous over the pod network, train, report, survive a SIGKILL and a preemption, and match
`tetrad run` on this machine.

The session's real-node cluster (``real_nodes``) gets both images and the chart through
``hack/e2e.sh install``, the same path as ``make e2e``. Each job runs once, in a module
fixture that records what a user would watch while it runs (kubectl, Prometheus, a bad
manifest applied beside it); the tests assert on those records.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from tetrad_operator.settings import OperatorSettings

from tests.cluster_fixtures import (
    REPO,
    KubectlError,
    RealCluster,
    fresh_namespace,
    node_processes,
    table_row,
    wait_until,
)
from tetrad.node.rounds import RESTARTING

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.xdist_group("real-nodes")]

QUICKSTART = REPO / "examples" / "quickstart.yaml"
OPERATOR_NS = "tetrad-system"
JOB_TIMEOUT = 1200.0
# the interrupted job: three incarnations and a round in place, each saving at least once, the third with
# steps left to stall in
STEPS = 48
# seconds without a rank-0 step: steps take about 2 s here, and up to a minute when the other lane's
# 16-process tests run beside them (a shorter timeout restarted a healthy gang as stalled)
STALL_TIMEOUT = 90
RESYNC = OperatorSettings().resync_seconds  # the chart's operator runs with the defaults
SCRAPE = OperatorSettings().scrape_interval_seconds
# What a reconcile itself may take on the loaded CI machine (a stall decided 120.5 s after the freeze
# failed a bound of timeout + resync = 120 s there); two resyncs would still fail the bound.
RECONCILE_LATENCY = 10
# The interrupted job's fixture: four runs of the workers on two real nodes and the local reference run, about
# 10 minutes alone on two cores, 30 beside the other lane's 16-process tests.
RESUME_TIMEOUT = pytest.mark.timeout(3600)


def quickstart(**changes: Any) -> dict[str, Any]:
    """examples/quickstart.yaml with `changes` merged into its spec (one level deep)."""
    job = yaml.safe_load(QUICKSTART.read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            job["spec"].setdefault(key, {}).update(value)
        else:
            job["spec"][key] = value
    return job


def local_losses(job: dict[str, Any], work: Path) -> list[float]:
    """`tetrad run` of the same job on this machine, uninterrupted: the loss of every step, in order."""
    spec = copy.deepcopy(job)
    spec["spec"].pop("checkpoint", None)  # its path is the pods' volume; saving changes no loss
    job_file = work / "job.yaml"
    work.mkdir(parents=True, exist_ok=True)
    job_file.write_text(yaml.safe_dump(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "tetrad.cli", "run", str(job_file), "--workdir", str(work / "run")],
        capture_output=True, text=True, timeout=JOB_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, (work / "run" / "metrics.jsonl").read_text().splitlines())]


def json_lines(text: str) -> list[dict[str, Any]]:
    """Rank 0's step records among a pod log's lines."""
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "step" in record and "loss" in record:
                records.append(record)
    return records


def job_status(c: RealCluster, ns: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = c.kubectl_json("get", "ptj", name, "-n", ns).get("status") or {}
    return status


def wait_for_phase(c: RealCluster, ns: str, name: str, phase: str,
                   timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        status = job_status(c, ns, name)
        assert status.get("phase") != "Failed", f"{name} failed: {status.get('message')}\n{describe(c, ns)}"
        return status if status.get("phase") == phase else None

    return wait_until(reached, timeout=timeout, interval=2, what=f"{name} {phase}")


def describe(c: RealCluster, ns: str) -> str:
    pods = c.run_kubectl("get", "pods", "-n", ns, "-o", "wide").stdout
    events = c.run_kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp").stdout[-4000:]
    operator = c.run_kubectl("logs", "-n", OPERATOR_NS, "deploy/tetrad", "--tail", "60").stdout
    return f"{pods}\n{events}\n{operator}"


def trainer_pods(c: RealCluster, ns: str, name: str, restart: int) -> list[dict[str, Any]]:
    selector = f"tetrad.dev/job-name={name},tetrad.dev/restart={restart}"
    pods: list[dict[str, Any]] = c.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]
    return sorted(pods, key=lambda p: int(p["metadata"]["labels"]["tetrad.dev/node-rank"]))


def rank0_log(c: RealCluster, ns: str, name: str, restart: int) -> str:
    return c.kubectl("logs", "-n", ns, f"{name}-r{restart}-0", "-c", "trainer")


class PodLogs:
    """`kubectl logs -f` of every pod of every incarnation, from when it runs until its container
    exits (a restart deletes the old incarnation's pods, and their logs with them), each into a
    file under `into` that outlives the test for whoever reads a failure."""

    def __init__(self, c: RealCluster, ns: str, name: str, nodes: int, into: Path):
        self.c, self.ns, self.name, self.nodes, self.into = c, ns, name, nodes, into
        self.streams: dict[int, list[subprocess.Popen[str]]] = {}

    def follow(self, restart: int) -> None:
        """Start following incarnation `restart` (call it while its containers run)."""
        if restart in self.streams:
            return
        self.streams[restart] = []
        for node in range(self.nodes):
            pod = f"{self.name}-r{restart}-{node}"
            with (self.into / f"{pod}.log").open("w") as out:
                self.streams[restart].append(subprocess.Popen(
                    [str(self.c.kubectl_path), "--kubeconfig", str(self.c.kubeconfig), "logs", "-f", "-n",
                     self.ns, pod, "-c", "trainer"], stdout=out, stderr=subprocess.STDOUT))

    def _rank0_log(self, restart: int) -> str:
        """Rank 0's log of incarnation `restart`, as far as its stream has brought it in ("": none yet)."""
        path = self.into / f"{self.name}-r{restart}-0.log"
        return path.read_text() if path.exists() else ""

    def last_step(self, restart: int) -> int:
        """The last step record of rank 0 that its stream has brought in so far (0: none)."""
        return max((r["step"] for r in json_lines(self._rank0_log(restart).rpartition("\n")[0])), default=0)

    def checkpoints(self, restart: int) -> tuple[int, int]:
        """(the step rank 0 resumed from, the last step it committed) in incarnation `restart`, as
        far as its log has come in (0 for none)."""
        text = self._rank0_log(restart)
        resumed = [int(n) for n in re.findall(r"checkpoint: resumed step (\d+)", text)]
        committed = [int(n) for n in re.findall(r"checkpoint: committed step (\d+)", text)]
        return max(resumed, default=0), max(committed, default=0)

    def rank0(self) -> dict[int, str]:
        """Rank 0's whole log of each followed incarnation, once every stream has ended with its container."""
        for procs in self.streams.values():
            for proc in procs:
                proc.wait(timeout=120)
        return {r: self._rank0_log(r) for r in self.streams}


# ---------------------------------------------------------------- the chart's operator


def test_the_chart_runs_the_operator_in_its_container_with_its_service_account(
        installed: RealCluster) -> None:
    deploy = installed.kubectl_json("get", "deploy", "tetrad", "-n", OPERATOR_NS)
    available = {c["type"]: c["status"] for c in deploy["status"]["conditions"]}["Available"]
    assert available == "True"
    (pod,) = installed.kubectl_json("get", "pods", "-n", OPERATOR_NS, "-l",
                                    "app.kubernetes.io/name=tetrad")["items"]
    assert pod["spec"]["nodeName"] in installed.node_names
    assert pod["spec"]["serviceAccountName"] == "tetrad"
    (container,) = pod["status"]["containerStatuses"]
    assert container["ready"] and container["image"].startswith("docker.io/tetrad/operator:")
    # Its ServiceAccount may do what the operator needs, and no more than the chart grants.
    sa = f"system:serviceaccount:{OPERATOR_NS}:tetrad"
    assert installed.kubectl("auth", "can-i", "patch", "paralleltrainingjobs/status", "--as",
                             sa).strip() == "yes"
    assert installed.kubectl("auth", "can-i", "create", "pods", "--as", sa).strip() == "yes"
    assert installed.run_kubectl("auth", "can-i", "create", "secrets", "--as", sa).stdout.strip() == "no"


# ---------------------------------------------------------------- Prometheus


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never through a proxy


@dataclass
class Prometheus:
    url: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with DIRECT.open(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


@pytest.fixture(scope="module")
def prometheus(installed: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus (hack/k8s-tools.sh, Kubernetes discovery only) on loopback, finding the trainer and
    operator pods through the apiserver as it would in a cluster."""
    work = tmp_path_factory.mktemp("prometheus")
    pki = installed.state / "pki"
    sd = {
        "role": "pod",
        "api_server": installed.api_url,
        "tls_config": {"ca_file": str(pki / "ca.crt"), "cert_file": str(pki / "admin.crt"),
                       "key_file": str(pki / "admin.key")},
    }

    def keep_port(name_regex: str) -> dict[str, Any]:
        return {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": name_regex,
                "action": "keep"}

    as_labels = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {"job_name": "tetrad-trainers", "kubernetes_sd_configs": [sd],
             "relabel_configs": [{"source_labels": ["__meta_kubernetes_pod_label_tetrad_dev_job_name"],
                                  "regex": ".+", "action": "keep"}, keep_port("metrics-[0-9]+"), *as_labels]},
            {"job_name": "tetrad-operator",
             "kubernetes_sd_configs": [{**sd, "namespaces": {"names": [OPERATOR_NS]}}],
             "relabel_configs": [keep_port("metrics"), *as_labels]},
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen(
        [str(installed.bin_dir / "prometheus"), f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=(work / "prometheus.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        wait_until(lambda: _quietly(prom.query, "up{job='tetrad-operator'} == 1"), timeout=120,
                   what=f"Prometheus scraping the operator (log: {work / 'prometheus.log'})")
        yield prom
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _quietly(query: Any, promql: str) -> list[dict[str, Any]] | None:
    """A query's result, or None while Prometheus is not listening yet."""
    try:
        result: list[dict[str, Any]] = query(promql)
        return result
    except OSError:  # urllib's URLError included
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- the quickstart


@dataclass
class QuickstartRun:
    """What a user saw while examples/quickstart.yaml ran, and how it ended."""

    ns: str
    status: dict[str, Any]
    pods: list[dict[str, Any]]
    rows: list[dict[str, str]] = field(default_factory=list)  # `kubectl get ptj` while Running
    promql: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    rejection: KubectlError | None = None
    pods_around_rejection: tuple[list[str], list[str]] = ([], [])
    log: str = ""
    local: list[float] = field(default_factory=list)


BAD = quickstart(parallelism={"dpShard": 3})  # 2 x 3 x 2 = 12 processes for a world of 8


@pytest.fixture(scope="module")
def quickstart_ns(installed: RealCluster) -> Iterator[str]:
    yield from fresh_namespace(installed, f"e2e-quickstart-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def quickstart_run(installed: RealCluster, prometheus: Prometheus, quickstart_ns: str,
                   tmp_path_factory: pytest.TempPathFactory) -> QuickstartRun:
    c, ns = installed, quickstart_ns
    c.kubectl("apply", "-n", ns, "-f", str(QUICKSTART))
    run = QuickstartRun(ns=ns, status={}, pods=[])
    deadline = time.monotonic() + JOB_TIMEOUT
    while (phase := job_status(c, ns, "quickstart").get("phase")) not in ("Succeeded", "Failed"):
        assert time.monotonic() < deadline, (f"quickstart still {phase} after {JOB_TIMEOUT}s\n"
                                             f"{describe(c, ns)}")
        if phase == "Running":
            header, *rows = c.kubectl("get", "ptj", "quickstart", "-n", ns).splitlines()
            run.rows += [table_row(header, row) for row in rows]
            if not run.promql and (
                    tps := prometheus.query(f"tetrad_tokens_per_second{{namespace='{ns}'}} > 0")):
                run.promql["tokens"] = tps
                run.promql["running"] = prometheus.query("tetrad_operator_jobs{phase='Running'}")
                before = [p["metadata"]["uid"] for p in trainer_pods(c, ns, "quickstart", 0)]
                try:
                    c.kubectl("apply", "-n", ns, "-f", "-",
                              input=json.dumps(BAD | {"metadata": {"name": "bad"}}))
                except KubectlError as e:
                    run.rejection = e
                after = [p["metadata"]["uid"] for p in trainer_pods(c, ns, "quickstart", 0)]
                run.pods_around_rejection = (before, after)
        time.sleep(2)
    run.status = job_status(c, ns, "quickstart")
    assert run.status["phase"] == "Succeeded", f"{run.status}\n{describe(c, ns)}"
    run.pods = trainer_pods(c, ns, "quickstart", 0)
    run.log = rank0_log(c, ns, "quickstart", 0)
    run.local = local_losses(yaml.safe_load(QUICKSTART.read_text()), tmp_path_factory.mktemp("local"))
    return run


def test_quickstart_trains_on_two_real_nodes_to_the_loss_of_tetrad_run(
        installed: RealCluster, quickstart_run: QuickstartRun) -> None:
    run = quickstart_run
    assert run.status["restarts"] == 0 and run.status["mesh"] == "pp2.dpr1.dps2.cp1.tp2"
    assert sorted(p["spec"]["nodeName"] for p in run.pods) == installed.node_names  # one pod per node
    for pod in run.pods:
        (trainer,) = pod["status"]["containerStatuses"]
        assert trainer["image"].startswith("docker.io/tetrad/trainer:")
        assert trainer["state"]["terminated"]["exitCode"] == 0
    steps = json_lines(run.log)
    assert [s["step"] for s in steps] == list(range(1, 21))
    assert len(run.local) == 20
    assert steps[-1]["loss"] == pytest.approx(run.local[-1], rel=1e-6)
    assert run.status["training"]["step"] == 20
    assert run.status["training"]["loss"] == pytest.approx(run.local[-1], rel=1e-6)


def test_kubectl_get_showed_tokens_per_second_while_it_ran(quickstart_run: QuickstartRun) -> None:
    figures = [float(row["TOKENS/S"]) for row in quickstart_run.rows if row.get("TOKENS/S")]
    assert figures and all(f > 0 for f in figures), quickstart_run.rows


def test_prometheus_scrapes_the_trainers_and_the_operator(quickstart_run: QuickstartRun) -> None:
    tokens = quickstart_run.promql["tokens"]
    assert {s["metric"]["pod"] for s in tokens} <= {"quickstart-r0-0", "quickstart-r0-1"}
    assert all(float(s["value"][1]) > 0 for s in tokens)
    (running,) = quickstart_run.promql["running"]
    assert float(running["value"][1]) >= 1  # the operator's own gauge saw the job Running


def test_a_bad_manifest_is_rejected_at_admission_while_the_job_runs_on(installed: RealCluster,
                                                                       quickstart_run: QuickstartRun) -> None:
    err = quickstart_run.rejection
    assert err is not None, "kubectl apply of the bad manifest succeeded"
    assert "spec.parallelism" in err.stderr and "12" in err.stderr, err.stderr
    assert installed.run_kubectl("get", "ptj", "bad", "-n", quickstart_run.ns).returncode != 0
    before, after = quickstart_run.pods_around_rejection
    assert before and before == after  # the running job's pods were not touched


def test_kubectl_logs_of_a_trainer_pod_show_rank0s_json_lines(quickstart_run: QuickstartRun) -> None:
    steps = json_lines(quickstart_run.log)
    assert steps and {"step", "loss", "tokens_per_second", "mfu", "peak_memory_bytes"} <= steps[0].keys()


# ---------------------------------------------------------------- a preemption and a SIGKILL


@dataclass
class InterruptedRun:
    status: dict[str, Any]
    preempted: dict[str, Any]  # the deleted pod as it terminated
    after_preemption: dict[str, Any]  # the job's status once the next incarnation was Running
    killed: dict[str, Any]  # the SIGKILLed pod as it terminated
    stalled: dict[str, Any]  # the job's status once the operator saw the frozen gang's round in place
    frozen: float  # when the test froze a pod's workers
    events: list[dict[str, Any]]
    logs: dict[int, str]  # rank 0's log of each incarnation
    local: list[float]

    def runs(self) -> list[list[dict[str, Any]]]:
        """Rank 0's step records of each run of the workers: each incarnation's, split at its rounds of
        restarts in place."""
        return [json_lines(part) for r in sorted(self.logs) for part in self.logs[r].split(RESTARTING)]


class ExitWatch:
    """A pod's container exit, seen through a watch started before the fault: a pod deleted with its
    grace period, or deleted by the operator's restart, can be gone before a poll sees it terminated."""

    def __init__(self, c: RealCluster, ns: str, pod: str):
        self.proc = subprocess.Popen(
            [str(c.kubectl_path), "--kubeconfig", str(c.kubeconfig), "get", "pod", pod, "-n", ns, "-w", "-o",
             "json"],
            stdout=subprocess.PIPE, text=True)
        self.seen: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        text, decoder = "", json.JSONDecoder()
        for line in self.proc.stdout:  # kubectl writes one indented JSON object per change
            text += line
            try:
                pod, end = decoder.raw_decode(text.lstrip())
            except ValueError:
                continue
            text = text.lstrip()[end:]
            self.seen.put(pod)

    def terminated(self, timeout: float = 120) -> dict[str, Any]:
        """The container's terminated state (exit code, reason, message) once the watch shows it."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    pod = self.seen.get(timeout=left)
                except queue.Empty:
                    break
                for s in pod["status"].get("containerStatuses", []):
                    if "terminated" in s["state"]:
                        return dict(s["state"]["terminated"])
            raise TimeoutError(f"no container exit seen within {timeout}s")
        finally:
            self.proc.kill()


def signal_pod(c: RealCluster, ns: str, job: str, restart: int, sig: signal.Signals,
               workers_only: bool = False) -> None:
    """`sig` from the node to every trainer process of the job's second pod in that incarnation (or to its
    workers only: not its supervisor, not torchrun)."""
    victim = trainer_pods(c, ns, job, restart)[1]
    pids = node_processes(victim["metadata"]["uid"], workers_only)
    assert pids, f"no trainer process of {victim['metadata']['name']} found on the node"
    for pid in pids:
        os.kill(pid, sig)


@pytest.fixture(scope="module")
def resume_ns(installed: RealCluster) -> Iterator[str]:
    yield from fresh_namespace(installed, f"e2e-resume-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def interrupted_run(installed: RealCluster, resume_ns: str,
                    tmp_path_factory: pytest.TempPathFactory) -> InterruptedRun:
    c, ns = installed, resume_ns
    store = tmp_path_factory.mktemp("checkpoints")
    store.chmod(0o777)  # the trainer runs as uid 1000; a hostPath keeps the host's owner
    job = quickstart(
        training={"steps": STEPS},
        checkpoint={"enabled": True, "interval": 4,
                    "volume": {"hostPath": {"path": str(store), "type": "Directory"}}},
        # The stall detector fires before a collective times out (a warning at apply, on purpose).
        runPolicy={"maxRestarts": 1, "terminationGracePeriodSeconds": 30, "backoffSeconds": 2,
                   "stallTimeoutSeconds": STALL_TIMEOUT, "collectiveTimeoutSeconds": 300},
    )
    job["metadata"]["name"] = "resume"
    c.apply(job, namespace=ns)

    logs = PodLogs(c, ns, "resume", 2, tmp_path_factory.mktemp("logs"))

    def saved_since_start(restart: int) -> bool:
        """Incarnation `restart` runs, its rank 0 has logged a commit of its own, and the job's status
        tells where it resumed from."""
        status = job_status(c, ns, "resume")
        assert status.get("phase") != "Failed", f"{status}\n{describe(c, ns)}"
        running = [p for p in trainer_pods(c, ns, "resume", restart) if p["status"].get("phase") == "Running"]
        if len(running) == 2:
            logs.follow(restart)
        # The commit is read from rank 0's log, not from the status the operator scrapes every 15 s:
        # each scrape's lag let an incarnation train on, and a fault could come so late that the
        # last incarnation had no steps left to stall in.
        resumed, committed = logs.checkpoints(restart)
        ckpt = status.get("checkpoint") or {}
        return (len(running) == 2 and (ckpt.get("resumedAtRestart") or 0) == restart
                and committed >= resumed + 4)

    def room_to_fail(restart: int) -> None:
        """Steps left after the fault: a frozen rank 1 stalls rank 0 only before its last step."""
        step = logs.last_step(restart)
        assert step <= STEPS - 6, f"incarnation {restart} reached step {step} of {STEPS} before its fault"

    def in_place(rounds: int) -> dict[str, Any] | None:
        status = job_status(c, ns, "resume")
        assert status.get("phase") != "Failed", f"{status}\n{describe(c, ns)}"
        assert status.get("restarts", 0) == 2, f"the stalled gang got new pods: {status}\n{describe(c, ns)}"
        return status if status.get("restartsInPlace", 0) >= rounds else None

    # A preemption: the pod is deleted, its trainer saves on SIGTERM and exits 75.
    wait_until(lambda: saved_since_start(0), timeout=JOB_TIMEOUT, interval=2,
               what="a checkpoint in incarnation 0")
    room_to_fail(0)
    watch = ExitWatch(c, ns, "resume-r0-1")
    c.kubectl("delete", "pod", "resume-r0-1", "-n", ns, "--wait=false", "--ignore-not-found")
    preempted = watch.terminated()
    # A SIGKILL from the node to every process of one trainer container, as the OOM killer would.
    wait_until(lambda: saved_since_start(1), timeout=JOB_TIMEOUT, interval=2,
               what="a new checkpoint in incarnation 1")
    after_preemption = job_status(c, ns, "resume")
    room_to_fail(1)
    watch = ExitWatch(c, ns, "resume-r1-1")
    signal_pod(c, ns, "resume", 1, signal.SIGKILL)
    killed = watch.terminated()
    # A hang: the workers of one trainer container stopped (SIGSTOP; its supervisor and torchrun go on),
    # so their peers wait in a collective and rank 0 completes no step. The operator asks pod 0's
    # coordinator to restart the gang in place: every node's supervisor kills its workers, and the gang
    # resumes in its own pods, round 1 of incarnation 2.
    wait_until(lambda: saved_since_start(2), timeout=JOB_TIMEOUT, interval=2,
               what="a new checkpoint in incarnation 2")
    room_to_fail(2)
    signal_pod(c, ns, "resume", 2, signal.SIGSTOP, workers_only=True)
    frozen = time.time()
    stalled = wait_until(lambda: in_place(1), timeout=STALL_TIMEOUT + 300, interval=1,
                         what="the stall's restart in place")
    status = wait_for_phase(c, ns, "resume", "Succeeded")
    events = c.kubectl_json("get", "events", "-n", ns, "--field-selector",
                            "involvedObject.name=resume")["items"]
    return InterruptedRun(status, preempted, after_preemption, killed, stalled, frozen, events,
                          logs.rank0(), local_losses(job, tmp_path_factory.mktemp("local-resume")))


@RESUME_TIMEOUT
def test_a_deleted_pod_saves_exits_75_and_the_gang_resumes_without_spending_max_restarts(
        interrupted_run: InterruptedRun) -> None:
    run = interrupted_run
    assert run.preempted["exitCode"] == 75
    after = run.after_preemption
    assert after["restarts"] >= 1 and after["disruptions"] == after["restarts"]  # a disruption, not a failure
    resumed = after["checkpoint"]["resumedFrom"]
    assert resumed >= 4
    steps = [s["step"] for s in json_lines(run.logs[1])]
    assert steps[0] == resumed + 1  # nothing trained twice, nothing skipped


@RESUME_TIMEOUT
def test_a_sigkilled_trainer_restarts_the_gang_from_the_last_checkpoint(
        interrupted_run: InterruptedRun) -> None:
    run = interrupted_run
    assert run.killed["exitCode"] == 137
    assert run.status["phase"] == "Succeeded"
    assert run.status["restarts"] - run.status["disruptions"] == 1  # the one failure, within maxRestarts 1
    resumed = [s["step"] for s in json_lines(run.logs[2])][0]
    assert resumed >= 9  # after the preemption's save and one of its own, at least


def epoch(stamp: str) -> float:
    """An API timestamp (whole seconds, rounded down) as seconds since the epoch."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


@RESUME_TIMEOUT
def test_a_stalled_gang_restarts_in_its_own_pods_as_a_disruption(interrupted_run: InterruptedRun) -> None:
    run = interrupted_run
    st = run.status
    # no new pods: a disruption in place, which spends neither maxRestarts (1, spent by the SIGKILL) nor
    # the pods' budget of restarts in place (0 left)
    counts = (st["restarts"], st["disruptions"], st["restartsInPlace"], st["disruptionsInPlace"])
    assert counts == (2, 1, 1, 1), st
    assert run.stalled["phase"] == "Running", run.stalled  # the gang trained on in its pods
    asked = st["inPlaceAsk"]
    assert (asked["restart"], asked["round"], asked["accepted"]) == (2, 0, True), asked
    # Asked within the timeout plus a resync, counted from rank 0's last step, which came just before the
    # freeze; timed by the operator's Event (whole seconds, rounded down), not by this test's poll.
    (stall,) = [e for e in run.events if e["reason"] == "Stalled"]
    assert stall["type"] == "Warning" and f"over the stall timeout of {STALL_TIMEOUT}s" in stall["message"]
    assert "asked pod 0's coordinator to restart the gang in its own pods (round 1)" in stall["message"]
    asked_seconds = epoch(stall["firstTimestamp"]) - run.frozen
    assert asked_seconds <= STALL_TIMEOUT + RESYNC + RECONCILE_LATENCY, asked_seconds
    (told,) = [e for e in run.events if e["reason"] == "RestartedInPlace"]
    assert "the gang of restart 2 restarted in its own pods (round 1)" in told["message"]
    if " after " in told["message"]:  # the round's cause, as a scrape of rank 0 read it
        assert f"after {asked['cause']}" in told["message"]
    assert "round 1 the operator asked for after a stall, a disruption" in told["message"]
    # every node's supervisor killed its workers (node 1's stopped ones too) and began round 1
    said = re.escape(f"{asked['cause']}: {RESTARTING}, round 1, in ") + r"\d+s \(a disruption, spending no"
    assert re.search(said, run.logs[2]), run.logs[2]


@RESUME_TIMEOUT
def test_the_job_resumed_across_three_incarnations_and_a_round_in_place_to_the_uninterrupted_loss(
        interrupted_run: InterruptedRun) -> None:
    run = interrupted_run
    runs = run.runs()
    assert len(runs) == 4
    last = runs[-1]
    round_1 = run.logs[2].split(RESTARTING)[1]
    resumed = [int(n) for n in re.findall(r"checkpoint: resumed step (\d+)", round_1)]
    assert last[0]["step"] == resumed[0] + 1 and last[-1]["step"] == STEPS
    # Every step's loss, across the four runs, equals the uninterrupted local run's.
    by_step = {s["step"]: s["loss"] for steps in runs for s in steps}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert [by_step[s] for s in range(1, STEPS + 1)] == pytest.approx(run.local, rel=1e-6)


@RESUME_TIMEOUT
def test_goodput_accounts_for_the_wall_time_across_the_faults(interrupted_run: InterruptedRun,
                                                              installed: RealCluster, resume_ns: str) -> None:
    """status.goodput against rank 0's own logs and the job's times. Tolerance: the operator splits an
    incarnation cut short by its last scrape of rank 0's account, which lags rank 0's last log by at
    most one scrape interval (SCRAPE) plus a step; the last incarnation's account is exact (its
    termination message)."""
    run = interrupted_run
    g = run.status["goodput"]
    seconds = g["seconds"]
    assert sum(seconds.values()) == pytest.approx(g["wallSeconds"], abs=1.0)
    assert g["fraction"] == pytest.approx(seconds["productive"] / g["wallSeconds"], abs=1e-3)
    assert g["asOf"] == run.status["completionTime"]
    started, ended = (datetime.strptime(run.status[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("startTime",
                                                                                     "completionTime"))
    active = (ended - started).total_seconds()
    assert active <= g["wallSeconds"] <= active + 10  # from creation, a moment before the first pass
    rows = run.runs()
    final = rows[3][-1]
    step_s = max(r["step_time_s"] for incarnation in rows for r in incarnation)
    # Training: no more than rank 0's steps, and at least the last incarnation's whole training
    trained = sum(incarnation[-1]["train_s"] for incarnation in rows)
    counted = seconds["productive"] + seconds["recomputed"]
    assert final["train_s"] - 1 <= counted <= trained + 3 * (SCRAPE + step_s) + 30, (seconds, trained)
    # The steps the faults cut after the last checkpoint, trained again: what separates each cut
    # incarnation's last logged step from where the next one resumed, give or take a scrape interval's
    resumed = [incarnation[0]["step"] - 1 for incarnation in rows]
    lost = sum(rows[r][-1]["step"] - resumed[r + 1] for r in range(3))
    assert 0 <= seconds["recomputed"] <= lost * step_s + 3 * (SCRAPE + step_s), (seconds, lost)
    # Checkpoint stalls: rank 0's, the last incarnation's final save included
    stalls = sum(incarnation[-1]["checkpoint_stall_s"] for incarnation in rows)
    assert final["checkpoint_stall_s"] - 0.1 <= seconds["checkpoint"] <= stalls + 10, (seconds, stalls)
    assert seconds["startup"] + seconds["preflight"] >= rows[3][0]["startup_s"] - 5
    # The frozen gang's time from its last step to the round in place is lost to the restart
    assert seconds["restarts"] >= STALL_TIMEOUT - SCRAPE - step_s, seconds
    assert seconds["suspended"] == 0 and 0 < g["fraction"] < 1
    header, row = installed.kubectl("get", "ptj", "resume", "-n", resume_ns, "-o", "wide").splitlines()
    assert float(table_row(header, row)["GOODPUT"]) == pytest.approx(g["fraction"]), (header, row)
