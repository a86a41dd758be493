"""What users bring, end to end on the real nodes, through the chart's operator: (a) a plain DDP script
in an image without Tetrad trains to Succeeded, and SIGKILLed workers restart the gang in its own pods,
resuming from the script's own checkpoint; (b) a script using the runtime library shows live figures in
`kubectl get ptj`, a deleted pod makes it save, exit 75 and resume without spending maxRestarts, and a
restart asked with `tetrad restart` (the tetrad.dev/restart-in-place annotation) makes it save and resume
in its own pods, spending nothing either;
(c) a model of one's own (the GPT-2 example) trains to `tetrad run`'s losses; (d) a Hugging Face
`Trainer` script with TetradCallback trains to Succeeded with live figures.

(a) and (d) run the images their examples' Dockerfiles build (hack/images.sh example, FROM the trainer's
dependencies and the trainer: thin archives on the trainer's layers); (b) and (c) run the stock trainer
image with the user's files from a ConfigMap, the way to try code before building an image.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster_fixtures import REPO, RealCluster, fresh_namespace, table_row, wait_until
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

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.xdist_group("real-nodes")]

EXAMPLES = REPO / "examples" / "bring-your-own"
VERSION = "0.1.0"
POD = {"cpu": "1", "memory": "3Gi"}
FAST = {"backoffSeconds": 2, "terminationGracePeriodSeconds": 30}


@pytest.fixture(scope="module")
def ns(installed: RealCluster) -> Iterator[str]:
    yield from fresh_namespace(installed, f"e2e-byo-{uuid.uuid4().hex[:6]}")


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory both real nodes mount (they are one machine): the jobs' checkpoints."""
    path = tmp_path_factory.mktemp(name)
    path.chmod(0o777)  # the pods run as uid 1000; a hostPath keeps the host's owner
    return path


def job(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"nodes": 2, "nprocPerNode": 1, "resources": POD, "preflight": {"allReduceMiB": 1},
                     **spec}}


def checkpoints_in(path: Path, mount: str = "/ckpt") -> dict[str, Any]:
    return {"path": mount, "volume": {"hostPath": {"path": str(path), "type": "Directory"}}}


def from_configmap(c: RealCluster, ns: str, name: str, files: dict[str, str], mount: str) -> dict[str, Any]:
    """`files` (a path under `mount`: its text) in a ConfigMap mounted at `mount`: the way to try code in the
    stock trainer image."""
    keys = {path: f"f{i}" for i, path in enumerate(files)}
    c.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
             "data": {keys[path]: text for path, text in files.items()}}, namespace=ns)
    items = [{"key": key, "path": path} for path, key in keys.items()]
    return {"volumes": [{"name": name, "configMap": {"name": name, "items": items}}],
            "volumeMounts": [{"name": name, "mountPath": mount}]}


def script_of(example: str) -> dict[str, str]:
    return {"train.py": (EXAMPLES / example / "train.py").read_text()}


def worker_pids(pod_uid: str) -> list[int]:
    """The training processes of the pod's container on this machine: the launcher's workers."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cgroups, cmdline = (proc / "cgroup").read_text(), (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if (f"pod{pod_uid}" in cgroups and b"tetrad-node.pyz\0worker" in cmdline
                    and b"torch.distributed.run" not in cmdline):
                found.append(int(proc.name))
    return found


def ptj_row(c: RealCluster, ns: str, name: str) -> dict[str, str]:
    """The job's row of `kubectl get ptj -o wide`, by column."""
    header, row = c.kubectl("get", "ptj", name, "-n", ns, "-o", "wide").splitlines()[:2]
    return table_row(header, row)


def rank0_steps(logs: PodLogs, restart: int) -> int:
    """The last `[train] step N` rank 0 of incarnation `restart` logged (level 1 prints no JSON)."""
    return max((int(n) for n in re.findall(r"\[train\] step (\d+) ", logs._rank0_log(restart))), default=0)


# ---------------------------------------------------------------- (a) level 1: a plain DDP script


def test_a_plain_ddp_script_without_tetrad_trains_and_a_killed_worker_restarts_the_gang_in_its_pods(
        installed: RealCluster, ns: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    c = installed
    store = shared_dir(tmp_path_factory, "ddp-ckpt")
    c.apply(job("ddp", image=f"tetrad/example-script:{VERSION}", checkpoint=checkpoints_in(store),
                script={"path": "/app/train.py",
                        "args": ["--steps", "40", "--save-every", "5", "--step-seconds", "0.5"]},
                runPolicy={**FAST, "maxRestarts": 1}), namespace=ns)
    logs = PodLogs(c, ns, "ddp", 2, tmp_path_factory.mktemp("ddp-logs"))

    def stepping(at_least: int) -> bool:
        status = job_status(c, ns, "ddp")
        assert status.get("phase") != "Failed", f"{status}\n{describe(c, ns)}"
        pods = trainer_pods(c, ns, "ddp", 0)
        if len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods):
            logs.follow(0)
        return rank0_steps(logs, 0) >= at_least

    wait_until(lambda: stepping(12), timeout=JOB_TIMEOUT, interval=2, what="the script's step 12")
    pods = trainer_pods(c, ns, "ddp", 0)
    no_tetrad = c.run_kubectl("exec", "-n", ns, pods[1]["metadata"]["name"], "-c", "trainer", "--",
                              "python3", "-c", "import tetrad")
    assert no_tetrad.returncode != 0 and "No module named 'tetrad'" in no_tetrad.stderr, no_tetrad
    pids = worker_pids(pods[1]["metadata"]["uid"])
    assert pids, "no worker process of ddp-r0-1 on the node"
    for pid in pids:  # the workers, not the node's supervisor: the pod lives on
        os.kill(pid, signal.SIGKILL)
    status = wait_for_phase(c, ns, "ddp", "Succeeded")
    # a failure, spending maxRestarts, restarted in the same pods: no new incarnation
    assert (status["restarts"], status.get("disruptions", 0), status["restartsInPlace"]) == (0, 0, 1), status
    uids = [p["metadata"]["uid"] for p in pods]
    assert [p["metadata"]["uid"] for p in trainer_pods(c, ns, "ddp", 0)] == uids, "the same pods"

    def events() -> list[dict[str, Any]]:
        listed = c.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=ddp")
        return list(listed["items"])

    # learned from the pods' termination messages (a script without the runtime library exports no round)
    (in_place,) = wait_until(lambda: [e for e in events() if e["reason"] == "RestartedInPlace"], timeout=60,
                             what="the RestartedInPlace Event")
    assert not [e for e in events() if e["reason"] == "PodFailed"]
    assert in_place["message"].startswith("the gang of restart 0 restarted in its own pods (round 1)"), (
        in_place)
    # both rounds in pod 0's log: the supervisor's word, then the script resuming from its own checkpoint
    text = c.kubectl("logs", "-n", ns, "ddp-r0-0", "-c", "trainer")
    said = re.search(r"\[tetrad\] node [01] exited -?\d+\b.*restarting the gang in place, round 1", text)
    assert said, text[-3000:]
    resumed = int(re.search(r"rank 0: resumed from step (\d+)", text)[1])  # type: ignore[index]
    assert resumed >= 10 and resumed % 5 == 0 and f"[train] step {resumed + 1} loss" in text, text[-3000:]
    assert "[train] step 40 loss" in text


# ---------------------------------------------------------------- (b) level 2: the runtime library


def test_a_runtime_library_script_shows_live_figures_and_saves_and_resumes_when_deleted_or_asked(
        installed: RealCluster, ns: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    c = installed
    steps = 80
    store = shared_dir(tmp_path_factory, "runtime-ckpt")
    template = from_configmap(c, ns, "runtime-script", script_of("runtime"), "/app")
    c.apply(job("runtime", image=f"tetrad/trainer:{VERSION}", template=template,
                checkpoint=checkpoints_in(store),
                script={"path": "/app/train.py", "args": ["--steps", str(steps), "--step-seconds", "0.5"]},
                runPolicy={**FAST, "maxRestarts": 0}), namespace=ns)
    logs = PodLogs(c, ns, "runtime", 2, tmp_path_factory.mktemp("runtime-logs"))

    def live() -> dict[str, str] | None:
        status = job_status(c, ns, "runtime")
        assert status.get("phase") != "Failed", f"{status}\n{describe(c, ns)}"
        if status.get("phase") == "Running":
            logs.follow(0)
        row = ptj_row(c, ns, "runtime")
        return row if row["TOKENS/S"] and row["STEP"] and int(row["STEP"]) >= 8 else None

    row = wait_until(live, timeout=JOB_TIMEOUT, interval=2, what="live TOKENS/S and STEP in kubectl get ptj")
    assert int(row["TOKENS/S"]) > 0 and float(row["LOSS"]) > 0 and 0 < float(row["MFU"]) <= 1, row
    watch = ExitWatch(c, ns, "runtime-r0-1")
    c.kubectl("delete", "pod", "runtime-r0-1", "-n", ns, "--wait=false", "--ignore-not-found")
    deleted = watch.terminated()
    assert deleted["exitCode"] == 75, deleted

    def trained_since_resuming(steps: int) -> bool:
        status = job_status(c, ns, "runtime")
        assert status.get("phase") != "Failed", f"{status}\n{describe(c, ns)}"
        text = c.run_kubectl("logs", "-n", ns, "runtime-r1-0", "-c", "trainer").stdout
        resumed = re.search(r"\[train\] resumed from step (\d+)", text)
        return resumed is not None and max((r["step"] for r in json_lines(text)), default=0) >= int(
            resumed[1]) + steps

    wait_until(lambda: trained_since_resuming(4), timeout=JOB_TIMEOUT, interval=1, what="restart 1 training")
    # `tetrad restart` sets the tetrad.dev/restart-in-place annotation and waits for the coordinator's yes
    said = subprocess.run([sys.executable, "-m", "tetrad.cli", "restart", "runtime", "-n", ns,
                           "--wait", "120"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KUBECONFIG": str(c.kubeconfig)})
    assert said.returncode == 0 and "accepted: the gang restarts in its own pods" in said.stdout, said
    token = said.stdout.splitlines()[0].removeprefix("asked: tetrad.dev/restart-in-place=")
    status = wait_for_phase(c, ns, "runtime", "Succeeded")
    # a disruption, then a restart asked in place: maxRestarts 0 unspent
    assert (status["restarts"], status["disruptions"], status["restartsInPlace"], status["askedInPlace"]) == (
        1, 1, 1, 1), status
    assert status["inPlaceAsk"]["token"] == token and status["inPlaceAsk"]["accepted"], status
    # on SIGTERM (the kubelet's, then the supervisors'), every rank agreeing; each step once
    saved = int(re.findall(r"\[train\] saved step (\d+)", logs.rank0()[0])[-1])
    resumed = c.kubectl("logs", "-n", ns, "runtime-r1-0", "-c", "trainer")
    assert f"[train] resumed from step {saved}" in resumed, resumed[-3000:]
    before, restarting, after = resumed.partition("restarting the gang in place, round 1")
    assert restarting and "(asked, saving first, spending no spec.runPolicy.maxRestarts)" in after, resumed
    again = int(re.findall(r"\[train\] saved step (\d+)", before)[-1])
    assert f"[train] resumed from step {again}" in after, resumed[-3000:]
    assert [r["step"] for r in json_lines(resumed)] == list(range(saved + 1, steps + 1)), resumed[-3000:]
    assert status["training"]["step"] == steps and status["checkpoint"]["step"] == steps, status


# ---------------------------------------------------------------- (c) level 3: a model of one's own


def test_a_model_of_ones_own_trains_on_two_nodes_to_the_loss_of_tetrad_run(
        installed: RealCluster, ns: str, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = installed
    model_dir = EXAMPLES / "model"
    template = from_configmap(c, ns, "gpt2-model",
                              {"gpt2_model.py": (model_dir / "gpt2_model.py").read_text()}, "/opt/models")
    template["env"] = [{"name": "PYTHONPATH", "value": "/opt/models"}]
    gpt2 = job("gpt2", nprocPerNode=2, image=f"tetrad/trainer:{VERSION}", template=template,
               parallelism={"dpShard": 2, "tp": 2},
               model={"module": "gpt2_model:definition", "dim": 64, "layers": 2, "heads": 4, "vocab": 256,
                      "seqLen": 64},
               training={"steps": 8, "globalBatch": 4, "precision": "fp32", "lr": 0.001, "warmupSteps": 2},
               resources={"cpu": "1", "memory": "3Gi"})
    c.apply(gpt2, namespace=ns)
    status = wait_for_phase(c, ns, "gpt2", "Succeeded")
    records = json_lines(c.kubectl("logs", "-n", ns, "gpt2-r0-0", "-c", "trainer"))
    assert [r["step"] for r in records] == list(range(1, 9)), records
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(model_dir), os.environ.get("PYTHONPATH", "")]))
    local = local_losses({**gpt2, "spec": {k: v for k, v in gpt2["spec"].items() if k != "template"}},
                         tmp_path_factory.mktemp("gpt2-local"))
    assert [r["loss"] for r in records] == pytest.approx(local, rel=1e-6)
    assert status["training"]["step"] == 8 and status["training"]["loss"] == pytest.approx(local[-1],
                                                                                          rel=1e-6)


# ---------------------------------------------------------------- (d) level 2: a Hugging Face Trainer script


def test_a_hugging_face_trainer_script_shows_live_figures_and_succeeds(
        installed: RealCluster, ns: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    c = installed
    store = shared_dir(tmp_path_factory, "hf-ckpt")
    steps = 200  # about a minute: the live figures show within seconds
    c.apply(job("hf", image=f"tetrad/example-hf-trainer:{VERSION}", checkpoint=checkpoints_in(store),
                script={"path": "/app/train.py", "args": ["--max-steps", str(steps)]},
                runPolicy={**FAST, "maxRestarts": 0}), namespace=ns)

    def live() -> dict[str, str] | None:
        status = job_status(c, ns, "hf")
        assert status.get("phase") not in ("Failed", "Succeeded"), f"no live figure before the end: {status}"
        row = ptj_row(c, ns, "hf")
        return row if row["TOKENS/S"] and row["STEP"] and int(row["STEP"]) > 0 else None

    row = wait_until(live, timeout=JOB_TIMEOUT, interval=1, what="live TOKENS/S and STEP in kubectl get ptj")
    assert int(row["TOKENS/S"]) > 0 and float(row["LOSS"]) > 0 and 0 < float(row["MFU"]) <= 1, row
    assert int(row["STEP"]) < steps, row
    status = wait_for_phase(c, ns, "hf", "Succeeded")
    assert status["restarts"] == 0 and status["training"]["step"] == steps, status
    assert status["training"]["tokensPerSecond"] > 0, status
    saved = sorted(int(p.name.removeprefix("checkpoint-")) for p in store.glob("checkpoint-*"))
    assert saved and saved[-1] == steps, saved  # the Trainer's own checkpoints, on the job's volume
