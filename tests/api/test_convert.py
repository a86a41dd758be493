"""`tetrad convert`: Kubeflow PyTorchJobs and TrainJobs to ParallelTrainingJob script jobs.

The fixtures in tests/api/kubeflow/ are shaped like the examples Kubeflow publishes (the training
operator's examples/pytorch, Trainer v2's examples/yaml). For each: the exact converted job, the
notes, and that the job validates, round-trips through the model and renders. Then the entry-point
parser on the commands users write, the refusals, hostile documents and the CLI.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tetrad.api.manifest import load_manifests
from tetrad.api.spec import ParallelTrainingJob
from tetrad.convert import EXIT_CODE_PERMANENT, Conversion, ConvertError, convert
from tetrad.render import render
from tetrad.resolve import resolve, validate_document

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "api" / "kubeflow"
MASTER = "spec.pytorchReplicaSpecs.Master"
MASTER_CTR = f"{MASTER}.template.spec.containers[0]"


def fixture(name: str) -> dict[str, Any]:
    (doc,) = load_manifests((FIXTURES / name).read_bytes())
    return doc


def notes(conversion: Conversion) -> list[tuple[str, str]]:
    return [(n.kind, n.field) for n in conversion.notes]


def message(conversion: Conversion, field: str) -> str:
    (found,) = [n.message for n in conversion.notes if n.field == field]
    return found


def assert_sound(job: dict[str, Any]) -> None:
    """Valid without a warning, the same after a trip through the model, and renders pods that run the
    script."""
    assert validate_document(job) == []
    model = ParallelTrainingJob.model_validate(job)
    assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == job
    pods = render(model).pods
    assert len(pods) == job["spec"]["nodes"]
    command = pods[0]["spec"]["containers"][0]["command"]
    script = job["spec"]["script"]
    args = script.get("args", [])
    if "command" in script:
        assert command[len(command) - len(args) - len(script["command"]) - 1:] == [
            "--", *script["command"], *args]
    else:
        assert command[len(command) - len(args) - 1:] == ["--", *args]
        assert script.get("path", script.get("module")) in command


RESTART_ON_FAILURE = ("changed", f"{MASTER}.restartPolicy")
CLEAN_POD_DEFAULT = ("assumed", "spec.runPolicy.cleanPodPolicy")


def test_pytorch_simple():
    c = convert(fixture("pytorch-simple.yaml"))
    assert c.source == "PyTorchJob kubeflow/pytorch-simple"
    assert c.job == {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
        "metadata": {"name": "pytorch-simple", "namespace": "kubeflow"},
        "spec": {"nodes": 2, "nprocPerNode": 1,
                 "script": {"path": "/opt/pytorch-mnist/mnist.py", "args": ["--epochs=1"]},
                 "image": "docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727",
                 "imagePullPolicy": "Always", "runPolicy": {"cleanPodPolicy": "None"}},
    }
    assert notes(c) == [RESTART_ON_FAILURE, CLEAN_POD_DEFAULT]
    assert "Tetrad restarts the whole gang" in message(c, f"{MASTER}.restartPolicy")
    assert "no backoffLimit: no limit" in message(c, f"{MASTER}.restartPolicy")
    assert_sound(c.job)


def test_torchrun_with_nproc_per_node_gpus_env_and_volumes():
    c = convert(fixture("torchrun-gpu.yaml"))
    assert c.job["metadata"] == {"name": "llama-finetune", "namespace": "team-a", "labels": {"team": "nlp"}}
    assert c.job["spec"] == {
        "nodes": 2, "nprocPerNode": 8,
        "script": {"path": "train.py",
                   "args": ["--config", "configs/llama3-8b.yaml", "--output-dir", "/data/out"],
                   "workingDir": "/workspace"},
        "image": "ghcr.io/example/llama-finetune:1.4.0", "imagePullPolicy": "IfNotPresent",
        "resources": {"cpu": "96", "memory": "1000Gi", "gpu": 8},
        "template": {
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "training-high",
            "annotations": {"sidecar.istio.io/inject": "false"},
        },
        "runPolicy": {"maxRestarts": 5, "activeDeadlineSeconds": 86400, "ttlSecondsAfterFinished": 3600,
                      "cleanPodPolicy": "All"},
    }
    assert notes(c) == [("changed", f"{MASTER_CTR}.command"), ("not carried over", f"{MASTER_CTR}.env"),
                        ("not carried over", f"{MASTER_CTR}.volumeMounts[1]"), RESTART_ON_FAILURE]
    assert message(c, f"{MASTER_CTR}.env").startswith(
        "PYTHONUNBUFFERED, MASTER_PORT: Tetrad or torchrun sets these")
    assert "Tetrad mounts its own dshm volume there" in message(c, f"{MASTER_CTR}.volumeMounts[1]")
    assert "at most runPolicy.maxRestarts: 5 times (backoffLimit)" in message(c, f"{MASTER}.restartPolicy")
    assert_sound(c.job)


def test_elastic_job_reports_the_elastic_policy():
    c = convert(fixture("elastic-imagenet.yaml"))
    worker = "spec.pytorchReplicaSpecs.Worker"
    assert c.job["spec"] == {
        "nodes": 2, "nprocPerNode": 1,
        "script": {"path": "/workspace/examples/imagenet.py",
                   "args": ["--arch=resnet18", "--epochs=1", "--batch-size=32", "--workers=0",
                            "/workspace/data/tiny-imagenet-200"]},
        "image": "quay.io/johnugeorge/pytorch-elastic-example-imagenet:0.1",
        "imagePullPolicy": "IfNotPresent", "resources": {"cpu": "4"},
        "template": {"env": [{"name": "LOGLEVEL", "value": "DEBUG"}]},
        "runPolicy": {"cleanPodPolicy": "None"},
    }
    ctr = f"{worker}.template.spec.containers[0]"
    assert notes(c) == [("changed", f"{ctr}.command"), ("changed", f"{ctr}.resources.requests.cpu"),
                        ("assumed", "spec.nprocPerNode"), ("not carried over", "spec.elasticPolicy"),
                        ("changed", f"{worker}.restartPolicy"), CLEAN_POD_DEFAULT]
    assert "the torch.distributed.run launcher is stripped" in message(c, f"{ctr}.command")
    assert message(c, "spec.elasticPolicy") == (
        "rdzvBackend: c10d, minReplicas: 1, maxReplicas: 3, maxRestarts: 100, metrics (an autoscaler): "
        "Tetrad runs a fixed gang of nodes: 2 pods and restarts it whole after a failure")
    assert "os.cpu_count()" in message(c, "spec.nprocPerNode")
    assert_sound(c.job)


def test_volcano_scheduling_policy_and_the_exit_code_policy():
    c = convert(fixture("volcano.yaml"))
    assert c.job["spec"] == {
        "nodes": 4, "nprocPerNode": 1,
        "script": {"module": "vision.train", "args": ["--model", "resnet50", "--epochs", "90"]},
        "image": "registry.example.com/resnet:2.1", "imagePullPolicy": "IfNotPresent",
        "resources": {"cpu": "8", "memory": "32Gi", "gpu": 1},
        "template": {"priorityClassName": "training-high"},
        "gang": {"scheduler": "volcano", "queue": "research", "timeoutSeconds": 600},
        "runPolicy": {"maxRestarts": 10, "permanentExitCodes": EXIT_CODE_PERMANENT, "cleanPodPolicy": "None"},
    }
    assert [c for c in range(1, 128) if c not in (69, 75, 79)] == EXIT_CODE_PERMANENT
    assert notes(c) == [("changed", f"{MASTER_CTR}.resources.requests.cpu"), RESTART_ON_FAILURE,
                        CLEAN_POD_DEFAULT]
    assert message(c, f"{MASTER}.restartPolicy").startswith("ExitCode: exit codes 1-127 fail the job at once")
    assert_sound(c.job)


def test_bash_c_keeps_the_shell_and_reports_what_it_cannot_carry():
    c = convert(fixture("bash-c.yaml"))
    assert c.job["metadata"] == {"name": "bash-train"}  # the queue label became the gang
    assert c.job["spec"] == {
        "nodes": 3, "nprocPerNode": 1,
        "script": {"command": ["bash"],
                   "args": ["-c",
                            "pip install -r /work/requirements.txt && python /work/train.py --epochs 3"]},
        "image": "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime", "imagePullPolicy": "IfNotPresent",
        "template": {"volumes": [{"name": "work", "emptyDir": {}}],
                     "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                     "labels": {"app": "bash-train"}},
        "gang": {"scheduler": "kueue", "queue": "user-queue"},
        "runPolicy": {"maxRestarts": 0, "cleanPodPolicy": "None"},
    }
    pod = f"{MASTER}.template.spec"
    assert notes(c) == [("changed", "spec.pytorchReplicaSpecs.Worker"),
                        ("not carried over", f"{pod}.containers"),
                        ("not carried over", f"{pod}.initContainers"), RESTART_ON_FAILURE, CLEAN_POD_DEFAULT]
    assert message(c, "spec.pytorchReplicaSpecs.Worker").startswith("its template differs from the Master's "
                                                                    "in args, initContainers")
    assert message(c, f"{pod}.containers").startswith("log-shipper: Tetrad's pods run one container")
    assert message(c, f"{pod}.initContainers").startswith("fetch: ")
    assert message(c, f"{MASTER}.restartPolicy").startswith("Never: a failure fails the job (maxRestarts: 0)")
    assert_sound(c.job)


def test_trainjob_of_the_torch_distributed_runtime():
    c = convert(fixture("trainjob-torch.yaml"))
    assert c.source == "TrainJob default/pytorch-mnist"
    assert c.job == {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
        "metadata": {"name": "pytorch-mnist", "namespace": "default", "labels": {"app": "pytorch-training"}},
        "spec": {
            "nodes": 2, "nprocPerNode": 2,
            "script": {"path": "/opt/pytorch-mnist/mnist.py", "args": ["--epochs=1", "--batch-size=64"]},
            "image": "docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727",
            "imagePullPolicy": "IfNotPresent", "resources": {"cpu": "8", "memory": "16Gi", "gpu": 2},
            "template": {
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "nodeSelector": {"node-type": "gpu"},
                "tolerations": [{"key": "training-workload", "operator": "Equal", "value": "true",
                                 "effect": "NoSchedule"}],
                "serviceAccountName": "training-sa",
                "labels": {"team": "ml-platform"},
            },
        },
    }
    assert notes(c) == [("assumed", "spec.runtimeRef"), ("changed", "spec.trainer.command"),
                        ("changed", "spec.trainer.resourcesPerNode.requests.cpu"),
                        ("not carried over", "spec.initializer.model")]
    assert "torch-distributed was not read" in message(c, "spec.runtimeRef")
    assert message(c, "spec.initializer.model").startswith(
        "hf://meta-llama/Llama-3.2-1B: Tetrad runs no initializer")
    assert_sound(c.job)


def test_trainjob_of_a_deepspeed_runtime_is_refused():
    with pytest.raises(ConvertError) as e:
        convert(fixture("trainjob-deepspeed.yaml"))
    assert e.value.lines == [
        "spec.runtimeRef.name: deepspeed-distributed is a DeepSpeed (launched by mpirun) runtime; Tetrad "
        "runs PyTorch jobs under torchrun, so only a TrainJob of a torch runtime (e.g. torch-distributed) "
        "converts"]


@pytest.mark.parametrize("runtime", ["mpi-distributed", "mlx-distributed", "jax-distributed"])
def test_other_runtimes_are_refused(runtime):
    doc = fixture("trainjob-deepspeed.yaml")
    doc["spec"]["runtimeRef"]["name"] = runtime
    with pytest.raises(ConvertError, match=f"{runtime} is a .* runtime; Tetrad runs PyTorch jobs"):
        convert(doc)


# --- the entry point ---------------------------------------------------------------------------------------

def pytorchjob(command: list[str] | None, args: list[str] | None = None, *, nproc: Any = None, gpus: int = 0,
               workers: int = 1, **container: Any) -> dict[str, Any]:
    ctr: dict[str, Any] = {"name": "pytorch", "image": "registry.example.com/train:1", **container}
    if command is not None:
        ctr["command"] = command
    if args is not None:
        ctr["args"] = args
    if gpus:
        ctr["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    template = {"spec": {"containers": [ctr]}}
    spec: dict[str, Any] = {"pytorchReplicaSpecs": {"Master": {"template": template},
                                                    "Worker": {"replicas": workers,
                                                               "template": copy.deepcopy(template)}}}
    if nproc is not None:
        spec["nprocPerNode"] = nproc
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "job"}, "spec": spec}


def entry_notes(c: Conversion) -> list[tuple[str, str]]:
    """The notes about the entry point and processes (the restart and cleanup ones are in every
    conversion)."""
    return [(n.kind, n.field) for n in c.notes
            if n.field not in (f"{MASTER}.restartPolicy", "spec.runPolicy.cleanPodPolicy")]


COMMAND = ("changed", f"{MASTER_CTR}.command")
STRIPPED = COMMAND
NPROC_AUTO_CPU = ("assumed", "spec.nprocPerNode")


@pytest.mark.parametrize("command, args, script, nproc, expected_notes", [
    (["python", "train.py"], None, {"path": "train.py"}, 1, []),
    (["python3", "-u", "train.py"], ["--lr", "3e-4"], {"path": "train.py", "args": ["--lr", "3e-4"]}, 1, []),
    (["python", "-m", "mypkg.train", "--steps=10"], None, {"module": "mypkg.train", "args": ["--steps=10"]},
     1, []),
    (["python", "-c", "import train; train.main()"], None,
     {"command": ["python"], "args": ["-c", "import train; train.main()"]}, 1, []),
    (["torchrun", "--nproc_per_node", "4", "--nnodes", "2", "train.py", "a"], None,
     {"path": "train.py", "args": ["a"]}, 4, [STRIPPED]),
    (["torchrun", "--standalone", "-m", "pkg.mod"], None, {"module": "pkg.mod"}, 1,
     [STRIPPED, NPROC_AUTO_CPU]),
    (["/usr/local/bin/torchrun", "--no-python", "--nproc-per-node=2", "/app/run.sh", "x"], None,
     {"command": ["/app/run.sh"], "args": ["x"]}, 2, [STRIPPED]),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py"], None, {"path": "train.py"},
     2, [STRIPPED]),
    (["python", "-m", "torch.distributed.launch", "--nproc_per_node=2", "train.py"], None,
     {"path": "train.py"}, 2, [STRIPPED, COMMAND]),
    (["bash", "-c", "python train.py --epochs=3"], None, {"path": "train.py", "args": ["--epochs=3"]}, 1, []),
    (["sh", "-c"], ["torchrun --nproc-per-node=2 train.py"], {"path": "train.py"}, 2, [STRIPPED]),
    (["bash", "-c", "cd /app && torchrun train.py"], None,
     {"command": ["bash"], "args": ["-c", "cd /app && torchrun train.py"]}, 1,
     [("not carried over", f"{MASTER_CTR}.command"), NPROC_AUTO_CPU]),
    (["accelerate", "launch", "train.py"], None, {"command": ["accelerate"], "args": ["launch", "train.py"]},
     1, [("not carried over", f"{MASTER_CTR}.command"), NPROC_AUTO_CPU]),
    (["/app/train.sh", "--fast"], None, {"command": ["/app/train.sh"], "args": ["--fast"]}, 1, []),
    (["sh", "-c", "exec ./train.sh --fast"], None, {"command": ["./train.sh"], "args": ["--fast"]}, 1, []),
    (["sh", "-c", "make train"], None, {"command": ["sh"], "args": ["-c", "make train"]}, 1, []),
    (None, ["python", "train.py"], {"path": "train.py"}, 1, [("assumed", f"{MASTER_CTR}.command")]),
])
def test_entry_points(command, args, script, nproc, expected_notes):
    c = convert(pytorchjob(command, args))
    assert c.job["spec"]["script"] == script
    assert c.job["spec"]["nprocPerNode"] == nproc
    assert entry_notes(c) == expected_notes
    assert_sound(c.job)


def test_python_options_become_environment_variables():
    c = convert(pytorchjob(["python", "-B", "-W", "ignore", "-X", "faulthandler", "-OO", "-E", "train.py"]))
    assert c.job["spec"]["script"] == {"path": "train.py"}
    assert c.job["spec"]["template"]["env"] == [
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, {"name": "PYTHONWARNINGS", "value": "ignore"},
        {"name": "PYTHONFAULTHANDLER", "value": "1"}, {"name": "PYTHONOPTIMIZE", "value": "2"}]
    assert entry_notes(c) == [("not carried over", f"{MASTER_CTR}.command"), COMMAND]
    assert c.notes[0].message.startswith("python option -E: Tetrad runs the script with the image's python3")


def test_torchrun_options_it_cannot_carry_and_conflicts_are_reported():
    c = convert(pytorchjob(["torchrun", "--nproc-per-node=2", "--nnodes=1:4", "--max-restarts=3", "--tee",
                            "3", "train.py"], nproc="4"))
    assert c.job["spec"]["nprocPerNode"] == 2
    assert entry_notes(c) == [STRIPPED, ("not carried over", f"{MASTER_CTR}.command"),
                              ("changed", "spec.nprocPerNode"), ("changed", f"{MASTER_CTR}.command --nnodes")]
    assert c.notes[1].message.startswith(
        "torchrun options --max-restarts=3, --tee=3: Tetrad sets torchrun's options")
    assert message(c, "spec.nprocPerNode") == (
        "'4' conflicts with the command's --nproc-per-node=2, which torchrun obeyed: nprocPerNode: 2")
    assert message(c, f"{MASTER_CTR}.command --nnodes").startswith("1:4 is an elastic range")


def test_an_unknown_torchrun_option_is_refused_with_the_fix():
    with pytest.raises(ConvertError,
                       match="torchrun option --fancy is not one the converter knows; remove it"):
        convert(pytorchjob(["torchrun", "--fancy", "train.py"]))


def test_nproc_per_node_from_gpus_and_the_once_per_pod_python():
    c = convert(pytorchjob(["python", "train.py"], gpus=4))
    assert (c.job["spec"]["nprocPerNode"], c.job["spec"]["resources"]) == (4, {"gpu": 4})
    assert entry_notes(c) == [COMMAND]
    assert "python ran once per pod; Tetrad runs it under torchrun 4 times per pod" in c.notes[0].message
    c = convert(pytorchjob(["torchrun", "--nproc-per-node=2", "train.py"], gpus=4))
    assert (c.job["spec"]["nprocPerNode"], c.job["spec"]["resources"]) == (2, {"gpu": 2})
    assert "4 GPUs for 2 processes per pod: Tetrad gives each process one GPU, gpu: 2" in c.notes[1].message
    c = convert(pytorchjob(["torchrun", "train.py"], nproc="gpu", gpus=8))
    assert c.job["spec"]["nprocPerNode"] == 8
    assert message(c, "spec.nprocPerNode") == (
        "gpu: one process per GPU, 8 (the container's nvidia.com/gpu limit)")
    c = convert(pytorchjob(["torchrun", "train.py"], nproc=3))  # an int, as the brief allows
    assert c.job["spec"]["nprocPerNode"] == 3


def test_the_kubeflow_sdks_shell_that_runs_torchrun_is_noted():
    script = ('read -r -d \'\' SCRIPT << EOM\ntrain()\nEOM\nprintf "%s" "$SCRIPT" > "train.py"\n'
              'torchrun "train.py"')
    c = convert(pytorchjob(["bash", "-c", script], gpus=1))
    assert c.job["spec"]["script"] == {"command": ["bash"], "args": ["-c", script]}
    assert c.notes[0].message.startswith(
        "the shell command runs torchrun, which starts worker processes of its own")


def test_references_to_kubeflow_variables_and_another_interpreter_are_noted():
    c = convert(pytorchjob(["/opt/conda/bin/python", "train.py", "--rank=$(RANK)"]))
    assert c.job["spec"]["script"] == {"path": "train.py", "args": ["--rank=$(RANK)"]}
    assert c.notes[0].message.startswith(
        "the pods ran /opt/conda/bin/python; Tetrad runs the image's python3")
    assert c.notes[1].message.startswith("$(RANK): Kubernetes expanded these from the variables Kubeflow set")


def test_a_container_without_a_command_runs_the_images_entrypoint_and_is_refused():
    # Kubeflow's pytorch_job_mnist_nccl.yaml: args only, for the image's ENTRYPOINT.
    with pytest.raises(ConvertError, match=r"command: not set, so the pods run the image's ENTRYPOINT with "
                                           r"args \['--backend', 'nccl'\].*add the command"):
        convert(pytorchjob(None, ["--backend", "nccl"]))


# --- pod fields --------------------------------------------------------------------------------------------

def test_kubectl_get_output_converts_without_noise():
    """What `kubectl get pytorchjob -o yaml` adds (server fields, status, Kubeflow's defaults) says
    nothing."""
    doc = pytorchjob(["python", "train.py"])
    doc["metadata"].update({"uid": "1234", "resourceVersion": "99", "generation": 1,
                            "creationTimestamp": "2025-01-01T00:00:00Z",
                            "managedFields": [{"manager": "kubectl"}],
                            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}})
    doc["status"] = {"conditions": [{"type": "Created", "status": "True"}]}
    doc["spec"].update({"nprocPerNode": "auto", "runPolicy": {"cleanPodPolicy": "None", "suspend": False}})
    for rs in doc["spec"]["pytorchReplicaSpecs"].values():
        rs.update({"replicas": rs.get("replicas", 1), "restartPolicy": "OnFailure"})
        rs["template"]["metadata"] = {"creationTimestamp": None}
        ctr = rs["template"]["spec"]["containers"][0]
        ctr.update({"ports": [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}],
                    "resources": {},
                    "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"})
    c = convert(doc)
    assert c.job["metadata"] == {"name": "job"}
    assert notes(c) == [RESTART_ON_FAILURE]
    assert c.job["spec"]["imagePullPolicy"] == "IfNotPresent"


def test_pod_fields_tetrad_has_no_place_for_are_reported():
    doc = pytorchjob(["python", "train.py"], envFrom=[{"configMapRef": {"name": "cfg"}}],
                     securityContext={"runAsUser": 0}, ports=[{"name": "tb", "containerPort": 6006}],
                     volumeMounts=[{"name": "cache", "mountPath": "/data/cache"},
                                   {"name": "scratch", "mountPath": "/tmp"}])
    pod = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    pod["metadata"] = {"labels": {"tetrad.dev/rank": "0", "app.kubernetes.io/managed-by": "me", "team": "a"}}
    pod["spec"].update({"hostNetwork": True, "imagePullSecrets": [{"name": "regcred"}],
                        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "c"}},
                                    {"name": "scratch", "emptyDir": {}}], "serviceAccount": "trainer"})
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] = copy.deepcopy(pod)
    c = convert(doc)
    assert c.job["spec"]["template"] == {
        "volumes": [{"name": "user-cache", "persistentVolumeClaim": {"claimName": "c"}}],
        "volumeMounts": [{"name": "user-cache", "mountPath": "/data/cache"}],
        "serviceAccountName": "trainer", "labels": {"team": "a"}}
    pod_where = f"{MASTER}.template.spec"
    assert notes(c) == [
        ("not carried over", f"{MASTER_CTR}.envFrom"), ("not carried over", f"{MASTER_CTR}.ports"),
        ("not carried over", MASTER_CTR), ("not carried over", f"{MASTER_CTR}.volumeMounts[1]"),
        ("changed", f"{pod_where}.volumes[0].name"),
        ("not carried over", f"{MASTER}.template.metadata.labels[tetrad.dev/rank]"),
        ("not carried over", f"{MASTER}.template.metadata.labels[app.kubernetes.io/managed-by]"),
        ("not carried over", f"{pod_where}.imagePullSecrets"), ("not carried over", pod_where),
        RESTART_ON_FAILURE, CLEAN_POD_DEFAULT]
    assert message(c, MASTER_CTR) == "securityContext: Tetrad's trainer container has no such field"
    assert message(c, pod_where) == "hostNetwork: Tetrad's pods have no such field"
    assert "add them to the ServiceAccount" in message(c, f"{pod_where}.imagePullSecrets")
    assert_sound(c.job)


def test_trainjob_overrides_patches_queues_and_assumptions():
    doc = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": "tj", "labels": {"kueue.x-k8s.io/queue-name": "team-q"},
                     "annotations": {"owner": "ml"}},
        "spec": {
            "runtimeRef": {"name": "torch-distributed", "kind": "TrainingRuntime"},
            "initializer": {"dataset": {"storageUri": "hf://tatsu-lab/alpaca"}},
            "trainer": {"image": "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime", "numProcPerNode": 4,
                        "command": ["torchrun", "/workspace/train.py"],
                        "resourcesPerNode": {"limits": {"nvidia.com/gpu": 4}}},
            "podTemplateOverrides": [
                {"targetJobs": [{"name": "node"}, {"name": "dataset-initializer"}],
                 "spec": {"volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
                          "containers": [
                              {"name": "node", "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}],
                          "imagePullSecrets": [{"name": "regcred"}]}}],
            "suspend": True,
        },
    }
    c = convert(doc)
    assert c.job["metadata"] == {"name": "tj", "annotations": {"owner": "ml"}}
    assert c.job["spec"] == {
        "nodes": 1, "nprocPerNode": 4, "script": {"path": "/workspace/train.py"},
        "image": "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime", "imagePullPolicy": "IfNotPresent",
        "resources": {"gpu": 4},
        "template": {"volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
                     "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]},
        "gang": {"scheduler": "kueue", "queue": "team-q"},
    }
    assert notes(c) == [
        ("assumed", "spec.runtimeRef"), ("not carried over", "spec.podTemplateOverrides[0].targetJobs"),
        ("changed", "spec.trainer.command"),
        ("not carried over", "spec.podTemplateOverrides[*].spec.imagePullSecrets"),
        ("assumed", "spec.trainer.numNodes"), ("not carried over", "spec.initializer.dataset"),
        ("changed", "spec.suspend")]
    assert message(c, "spec.suspend").startswith(
        "true: Kueue holds a Kubeflow job suspended until it admits it")
    assert message(c, "spec.podTemplateOverrides[0].targetJobs").startswith("dataset-initializer: ")
    assert_sound(c.job)


def test_trainjob_runtime_patches_and_a_volcano_queue():
    doc = yaml.safe_load("""
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata:
  name: patched
  annotations: {scheduling.volcano.sh/queue-name: research}
spec:
  runtimeRef: {name: torch-distributed}
  activeDeadlineSeconds: 7200
  trainer:
    numNodes: 2
    image: ghcr.io/example/train:1
    command: [python3, -m, example.train]
    env: [{name: PET_NNODES, value: "2"}, {name: WANDB_PROJECT, value: p}]
  runtimePatches:
    - manager: example.io/platform-team
      trainingRuntimeSpec:
        template:
          spec:
            replicatedJobs:
              - name: node
                template:
                  spec:
                    template:
                      metadata: {labels: {team: ml-platform}}
                      spec:
                        serviceAccountName: training-sa
                        nodeSelector: {node-type: training}
""")
    doc["spec"]["suspend"] = True  # held by its owner, not by Kueue: carried
    c = convert(doc)
    assert c.job["metadata"] == {"name": "patched"}
    assert c.job["spec"] == {
        "nodes": 2, "nprocPerNode": 1, "script": {"module": "example.train"},
        "image": "ghcr.io/example/train:1", "imagePullPolicy": "IfNotPresent",
        "template": {"env": [{"name": "WANDB_PROJECT", "value": "p"}],
                     "nodeSelector": {"node-type": "training"},
                     "serviceAccountName": "training-sa", "labels": {"team": "ml-platform"}},
        "gang": {"scheduler": "volcano", "queue": "research"},
        "runPolicy": {"activeDeadlineSeconds": 7200, "suspend": True},
    }
    assert notes(c) == [("assumed", "spec.runtimeRef"), ("not carried over", "spec.trainer.env"),
                        ("assumed", "metadata.annotations[scheduling.volcano.sh/queue-name]")]
    assert_sound(c.job)


# --- refusals ----------------------------------------------------------------------------------------------

def test_a_name_too_long_is_refused_with_the_fix_not_cut():
    doc = fixture("pytorch-simple.yaml")
    doc["metadata"]["name"] = "a" * 50 + "-mnist-training"
    with pytest.raises(ConvertError) as e:
        convert(doc)
    (line,) = e.value.lines
    assert line.startswith(f"metadata.name: {'a' * 50}-mnist-training is 65 characters; a "
                           "ParallelTrainingJob's name is at most 57")
    assert line.endswith(
        f"rename the PyTorchJob (e.g. to {'a' * 50}-mnist-) and convert again".replace("-mnist-)", "-mnist)"))


@pytest.mark.parametrize("change, expected", [
    (lambda d: d.update(kind="TFJob"), "kind: TFJob is not a PyTorch job; tetrad convert reads a PyTorchJob"),
    (lambda d: d.update(kind="ConfigMap", apiVersion="v1"), "kind: 'ConfigMap' is not a job to convert"),
    (lambda d: d.update(kind="ParallelTrainingJob", apiVersion="tetrad.dev/v1alpha1"),
     "kind: already a ParallelTrainingJob"),
    (lambda d: d.update(apiVersion="kubeflow.org/v1beta1"),
     "apiVersion: 'kubeflow.org/v1beta1' is not the supported"),
    (lambda d: d["metadata"].pop("name"), "metadata.name: required, but missing; set metadata.name"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),
     "Master.replicas: a PyTorchJob's Master has 1 replica, not 2"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"].update(Chief={}),
     "a PyTorchJob has Master and Worker replicas, not Chief"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(
        name="main"),
     "containers: no container named pytorch, the one a PyTorchJob trains in"),
    (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"].update(restartPolicy="Sometimes"),
     "Master.restartPolicy: 'Sometimes' is not Always, OnFailure, Never or ExitCode"),
    (lambda d: d["spec"].update(nprocPerNode="xpu"), "spec.nprocPerNode: 'xpu' is not a number of processes"),
    (lambda d: d["spec"].update(nprocPerNode="128"), "the converted job is not valid: spec.nprocPerNode:"),
])
def test_refusals_name_the_field(change, expected):
    doc = fixture("pytorch-simple.yaml")
    change(doc)
    with pytest.raises(ConvertError) as e:
        convert(doc)
    assert any(expected in line for line in e.value.lines), e.value.lines


def test_a_trainjob_without_image_or_command_is_refused_with_the_fix():
    doc = fixture("trainjob-torch.yaml")
    del doc["spec"]["trainer"]["image"]
    with pytest.raises(ConvertError, match="spec.trainer.image: not set, so the pods run the image of the "
                                           "runtime torch-distributed, which the converter cannot read; set "
                                           "spec.trainer.image"):
        convert(doc)
    doc = fixture("trainjob-torch.yaml")
    del doc["spec"]["trainer"]["command"]
    with pytest.raises(ConvertError, match="spec.trainer.command: not set"):
        convert(doc)


# --- hostile documents -------------------------------------------------------------------------------------

@pytest.mark.parametrize("document, expected", [
    ([1, 2], "expected a YAML mapping (a PyTorchJob or TrainJob), got a list"),
    ("PyTorchJob", "got a string"),
    (7, "got an integer"),
])
def test_a_document_that_is_not_a_mapping(document, expected):
    with pytest.raises(ConvertError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        convert(document)


@pytest.mark.parametrize("change, expected", [
    (lambda c: c.update(command="python train.py"), "containers[0].command: expected a list, got a string"),
    (lambda c: c.update(command=["python", 3]),
     "containers[0].command[1]: expected a string, got an integer"),
    (lambda c: c.update(env={"A": "1"}), "containers[0].env: expected a list, got a mapping"),
    (lambda c: c.update(resources={"limits": {"nvidia.com/gpu": "1.5"}}),
     "'1.5' is not a whole number of GPUs"),
    (lambda c: c.update(resources={"limits": {"cpu": [4]}}), "limits.cpu: expected a quantity"),
    (lambda c: c.update(env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]),
     "the converted job is not valid: spec.template.env[0]: set value or valueFrom, not both"),
])
def test_wrong_types_name_the_field(change, expected):
    doc = fixture("pytorch-simple.yaml")
    change(doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0])
    with pytest.raises(ConvertError) as e:
        convert(doc)
    assert any(expected in line for line in e.value.lines), e.value.lines


def test_a_huge_args_list_and_awkward_strings_round_trip():
    from tetrad.cli.convert import render as render_yaml

    awkward = ["y", "no", "on", "1", "1.5", "- x", "a: b", "#c", "x\ny", "\u2028", "", "null", "~", "$(HOME)",
               "'", '"']
    args = [f"--shard={i}" for i in range(20_000)] + awkward
    c = convert(pytorchjob(["python", "train.py"], args))
    assert c.job["spec"]["script"]["args"] == args
    assert all(len(str(n)) < 600 for n in c.notes)  # no note quotes the list
    (back,) = [d for d in yaml.safe_load_all(render_yaml([c])) if d]
    assert back == c.job
    assert validate_document(back) == []
    assert resolve(ParallelTrainingJob.model_validate(back)).script is not None


def test_names_with_line_breaks_stay_on_one_line():
    from tetrad.cli.convert import header, note_line

    doc = pytorchjob(["python", "train.py"])
    doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"].append(
        {"name": "side\ncar\u2028x", "image": "busybox"})
    c = convert(doc)
    assert all("\n" not in note_line(c, n) and "\u2028" not in note_line(c, n) for n in c.notes)
    assert all(line.startswith("#") for line in header(c).splitlines())
    assert "side\\u000acar\\u2028x" in header(c)


# --- the CLI -----------------------------------------------------------------------------------------------

def tetrad(*args: str, stdin: str | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrad.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, input=stdin)


CONVERTIBLE = ["pytorch-simple.yaml", "torchrun-gpu.yaml", "elastic-imagenet.yaml", "volcano.yaml",
               "bash-c.yaml", "trainjob-torch.yaml"]


def test_cli_converts_every_fixture_and_tetrad_validate_passes_the_output(tmp_path):
    stream = "---\n".join((FIXTURES / name).read_text() for name in CONVERTIBLE)
    src = tmp_path / "kubeflow.yaml"
    src.write_text(stream)
    r = tetrad("convert", str(src))
    assert r.returncode == 0, r.stderr
    jobs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert jobs == [convert(fixture(name)).job for name in CONVERTIBLE]
    assert r.stdout.startswith(
        "# Converted by `tetrad convert` from PyTorchJob kubeflow/pytorch-simple (kubeflow.org/v1).\n")
    assert "# not carried over:\n#   spec.elasticPolicy: rdzvBackend: c10d" in r.stdout
    expected = [
        f"{n.kind}: {c.source}: {n}" for c in map(convert, map(fixture, CONVERTIBLE)) for n in c.notes]
    assert r.stderr.splitlines() == expected
    out = tmp_path / "tetrad.yaml"
    out.write_text(r.stdout)
    v = tetrad("validate", str(out))
    assert v.returncode == 0 and v.stderr == "" and v.stdout.count("ok: ") == len(CONVERTIBLE), (
        v.stdout + v.stderr)


def test_cli_output_file_stdin_and_refusals(tmp_path):
    simple = (FIXTURES / "pytorch-simple.yaml").read_text()
    out = tmp_path / "job.yaml"
    r = tetrad("convert", "-", "-o", str(out), stdin=simple)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert r.stderr.splitlines()[-1] == f"wrote {out}: 1 ParallelTrainingJob"
    assert [d for d in yaml.safe_load_all(out.read_text()) if d] == [
        convert(fixture("pytorch-simple.yaml")).job]
    out.write_text("keep me\n")
    r = tetrad("convert", str(FIXTURES / "pytorch-simple.yaml"), "-o", str(out))
    assert r.returncode == 1 and "already exists; choose a new file, or add --force" in r.stderr
    assert out.read_text() == "keep me\n"
    r = tetrad("convert", str(FIXTURES / "pytorch-simple.yaml"), "-o", str(out), "--force")
    assert r.returncode == 0 and out.read_text().startswith("# Converted by"), r.stderr
    src = tmp_path / "src.yaml"
    src.write_text(simple)
    r = tetrad("convert", str(src), "-o", str(src), "--force")
    assert r.returncode == 1 and "is the input file" in r.stderr and src.read_text() == simple
    # A file with something else in it: nothing is written, every refusal said.
    r = tetrad("convert", "-",
               stdin=simple + "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n---\n[1]\n")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "error: <stdin>[1]: ConfigMap c: kind: 'ConfigMap' is not a job to convert; tetrad convert reads a "
        "PyTorchJob (kubeflow.org/v1) or a TrainJob (trainer.kubeflow.org/v1alpha1); apply other objects as "
        "they are",
        "error: <stdin>[2]: a list: expected a YAML mapping (a PyTorchJob or TrainJob), got a list"]
    for text, expected in (("", "empty file, expected a PyTorchJob or TrainJob"),
                           ("a: [\n", "invalid YAML at line")):
        r = tetrad("convert", "-", stdin=text)
        assert r.returncode == 1 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = tetrad("convert", str(FIXTURES / "trainjob-deepspeed.yaml"))
    assert r.returncode == 1 and "is a DeepSpeed (launched by mpirun) runtime" in r.stderr and r.stdout == ""


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    return [path] + [p for key, child in children for p in _paths(child, (*path, key))]


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.yaml")))
def test_any_value_anywhere_converts_or_is_refused_never_crashes(name):
    """Every field of every fixture replaced by a value of each other type: a valid job, or a ConvertError."""
    original = fixture(name)
    for path in _paths(original)[1:]:
        for value in (None, -1, 10**30, True, "x", "x\ny", [], [None], {"a": 1}):
            doc = copy.deepcopy(original)
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = value
            try:
                c = convert(doc)
            except ConvertError as e:
                assert e.lines and all(isinstance(line, str) and line for line in e.lines), (path, value)
                continue
            assert [p for p in validate_document(c.job) if p.severity == "error"] == [], (path, value)
