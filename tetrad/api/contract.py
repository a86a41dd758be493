"""The pod contract: every name shared by the renderer, the trainer and the operator.

One definition each, imported by all three, so a rename cannot leave one side behind:
the API identity, the environment a node gets, the labels and the scheduling gate, the exit codes
of a trainer pod, and the metric names the trainer exports and the operator scrapes.
"""

from __future__ import annotations

from typing import Final

# API identity.
GROUP: Final = "tetrad.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "tetrad.dev/v1alpha1"  # GROUP/VERSION
KIND: Final = "ParallelTrainingJob"
PLURAL: Final = "paralleltrainingjobs"
SHORT_NAME: Final = "ptj"

# Environment of a node (pod or local agent), set by the renderer, read by the trainer.
ENV_CONFIG: Final = "TETRAD_CONFIG"  # path of the resolved trainer config (JSON)
ENV_RESTART: Final = "TETRAD_RESTART"  # the operator's restart count of this gang
# Restarts in place (tetrad.node.rounds) as JSON: {"address": node 0's coordinator host:port, "left": restarts
# left in the budget, "retryable": [...], "permanent": [...]} (spec.runPolicy's exit codes); unset: off.
ENV_ROUNDS: Final = "TETRAD_ROUNDS"
ENV_SPARE: Final = "TETRAD_SPARE"  # "0": no spare interpreter for the next round (tetrad.node.spare)
ENV_ROUND: Final = "TETRAD_ROUND"  # the round of restarts in place this worker runs in (0: the first)
ENV_ROUND_CAUSE: Final = "TETRAD_ROUND_CAUSE"  # from round 1 on: the failure that restarted the gang in place
# In a pod, node 0's coordinator of restarts in place listens on spec.rendezvous.port + this.
ROUNDS_PORT_OFFSET: Final = 1
ENV_METRICS_PORT: Final = "TETRAD_METRICS_PORT"  # rank r serves Prometheus on this port + LOCAL_RANK
ENV_JOB: Final = "TETRAD_JOB"
ENV_RDZV_TIMEOUT: Final = "TETRAD_RDZV_TIMEOUT"  # seconds to wait for the rendezvous peers
ENV_JSONL: Final = "TETRAD_JSONL"  # rank 0 appends its JSON lines there (`tetrad run`)
ENV_EXIT_DIR: Final = "TETRAD_EXIT_DIR"  # where workers leave their exit codes for the supervisor
ENV_NODE_NAME: Final = "TETRAD_NODE_NAME"  # the Kubernetes node the pod runs on (downward API spec.nodeName)
# where the node writes its termination message (default below)
ENV_TERMINATION_LOG: Final = "TETRAD_TERMINATION_LOG"
# rank 0 reads checkpoint-now tokens there
ENV_CHECKPOINT_REQUEST_FILE: Final = "TETRAD_CHECKPOINT_REQUEST_FILE"
# The resolved layout, outermost dim first, e.g. pp=1,dp_replicate=1,dp_shard=4,cp=1,tp=2: a script
# builds the same DeviceMesh with these names and degrees (docs/bring-your-own.md).
ENV_MESH: Final = "TETRAD_MESH"
ENV_GPUS: Final = "TETRAD_GPUS"  # GPUs each node requests (resources.gpu); 0: the job runs on CPUs
ENV_CPUS: Final = "TETRAD_CPUS"  # CPUs each node requests (resources.cpu), when it does
# spec.preflight as JSON ({"timeoutSeconds", "allReduceMiB", "slowNodeFraction"}); unset: the gate is off.
ENV_PREFLIGHT: Final = "TETRAD_PREFLIGHT"
ENV_COLLECTIVE_TIMEOUT: Final = "TETRAD_COLLECTIVE_TIMEOUT"  # spec.runPolicy.collectiveTimeoutSeconds
# spec.checkpoint.path: where a script keeps its checkpoints
ENV_CHECKPOINT_DIR: Final = "TETRAD_CHECKPOINT_DIR"
# The version of this contract (the environment, the exit codes, the metric names, the exit directory's
# files): a runtime library (tetrad_trainer.runtime) refuses to run under a version it does not speak.
ENV_CONTRACT: Final = "TETRAD_CONTRACT"
CONTRACT_VERSION: Final = 1
# tests only: the trainer raises torch.OutOfMemoryError at this step
ENV_TEST_OOM_AT_STEP: Final = "TETRAD_TEST_OOM_AT_STEP"
# Tests only: a fault the trainer injects (tetrad_trainer.faults), e.g. hang-rank:1:step:3; ignored unless
# ENV_TEST_FAULTS_ALLOWED=1 is set too, so a stray variable can never hang a real job.
ENV_TEST_FAULT: Final = "TETRAD_TEST_FAULT"
ENV_TEST_FAULTS_ALLOWED: Final = "TETRAD_TEST_FAULTS_ALLOWED"
# torchrun's own setting (--shutdown-timeout): how long it waits for its workers after SIGTERM.
ENV_TORCHRUN_SHUTDOWN_TIMEOUT: Final = "PET_SHUTDOWN_TIMEOUT"

# Labels, annotations and the scheduling gate of the objects Tetrad creates.
LABEL_JOB: Final = "tetrad.dev/job-name"
LABEL_RANK: Final = "tetrad.dev/node-rank"
LABEL_RESTART: Final = "tetrad.dev/restart"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "tetrad"
GANG_GATE: Final = "tetrad.dev/gang"
# A token (any string, e.g. a timestamp) on a job: save a checkpoint at the next step without
# stopping. The operator copies a new token onto rank 0's pod, whose POD_INFO volume projects it
# into CHECKPOINT_REQUEST_FILE (ENV_CHECKPOINT_REQUEST_FILE names the path).
ANNOTATION_CHECKPOINT_NOW: Final = "tetrad.dev/checkpoint-now"
# A token on a job: restart the gang in its own pods, every worker saving a checkpoint first. The
# operator asks pod 0's coordinator of restarts in place once per new token.
ANNOTATION_RESTART_IN_PLACE: Final = "tetrad.dev/restart-in-place"

# Where a pod finds its resolved config and the node launcher (a zip of tetrad.node that runs with the
# image's python3 alone), and its own annotations the trainer reads (downward API).
CONFIG_DIR: Final = "/etc/tetrad"
CONFIG_FILE: Final = "config.json"
LAUNCHER_FILE: Final = "tetrad-node.pyz"
POD_INFO_DIR: Final = "/etc/tetrad-pod"
CHECKPOINT_REQUEST_FILE: Final = "checkpoint-now"

# The volumes every trainer pod gets (name -> mount path): the config and the writable scratch
# paths under a read-only root filesystem; CHECKPOINT_VOLUME is mounted at checkpoint.path when
# checkpoint.volume is set. A spec's own volumes and mounts may not reuse these names or paths.
POD_VOLUMES: Final[dict[str, str]] = {"config": CONFIG_DIR, "podinfo": POD_INFO_DIR, "tmp": "/tmp",
                                      "cache": "/home/tetrad/.cache", "dshm": "/dev/shm"}
# The scratch volumes among them: emptyDirs, wiped with the pod (dshm in memory).
SCRATCH_VOLUMES: Final = ("tmp", "cache", "dshm")
CHECKPOINT_VOLUME: Final = "checkpoints"

# Environment a spec's template.env may not set: torchrun's (PET_*), Tetrad's (TETRAD_*), what the
# renderer sets besides (tests/api/test_hostile.py checks every name it renders is covered) and
# what torchrun sets in each worker.
RESERVED_ENV_PREFIXES: Final = ("PET_", "TETRAD_", "TORCHELASTIC_")
RESERVED_ENV: Final = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "POD_IP", "PYTHONUNBUFFERED",
    "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
    "ROLE_WORLD_SIZE",
})

# Exit codes of a trainer pod, read by the operator's restart policy.
EXIT_PREEMPTED: Final = 75  # EX_TEMPFAIL: SIGTERM received, checkpoint saved; always retryable
EXIT_CONFIG_ERROR: Final = 78  # EX_CONFIG: the resolved config cannot run; retrying cannot help
EXIT_OOM: Final = 77  # device out of memory: permanent by default, retrying the same layout cannot help
# A collective did not complete within spec.runPolicy.collectiveTimeoutSeconds (a peer hung or is gone);
# retryable: the rank logged the collective and the peers that did not answer first.
EXIT_COLLECTIVE_TIMEOUT: Final = 79
# EX_UNAVAILABLE: a node failed the preflight gate; the termination message names it
EXIT_PREFLIGHT: Final = 69
# EX_IOERR: a restart in place found workers it could not kill (stuck in the kernel, as in uninterruptible
# I/O): the node ends its rounds, and the gang restarts in new pods.
EXIT_WORKERS_STUCK: Final = 74
# Disruptions, not the job's failures: the operator retries them whatever runPolicy's exit-code lists say.
EXIT_ALWAYS_RETRIED: Final = (EXIT_PREFLIGHT, EXIT_PREEMPTED)

# A node's termination message (tetrad.api.termination: JSON, read by the operator from the pod's status),
# written by the node's launcher only. Kubernetes keeps at most 4096 bytes of it.
TERMINATION_LOG: Final = "/dev/termination-log"
TERMINATION_MESSAGE_MAX: Final = 4096
# Its keys of rank 0's state when it finished or stopped on SIGTERM: the last committed step (null: none)
# and its Unix commit time (when this process committed it), which a suspend records in the job's status,
# and its last figures (the SCRAPED and SCRAPED_CHECKPOINT gauges as exposition text), read as a scrape is
# (a finished job's status shows its last step, not the last one a scrape happened to catch).
TERMINATION_CHECKPOINT_STEP: Final = "checkpointStep"
TERMINATION_CHECKPOINT_TIME: Final = "checkpointTime"
TERMINATION_FIGURES: Final = "figures"
# ... and, from every node, the round of restarts in place it ended in (left out in round 0)
TERMINATION_ROUND: Final = "round"
# Causes a node names in its termination message (`reason`), with the exit code it exits with.
# spec.script's path, module or command is not in the image (78)
REASON_ENTRY_POINT: Final = "EntryPointNotFound"
REASON_CONFIG: Final = "ConfigError"  # the config cannot run (78)
REASON_OUT_OF_MEMORY: Final = "DeviceOutOfMemory"  # (77)
REASON_HOST_OUT_OF_MEMORY: Final = "HostOutOfMemory"  # the kernel's OOM killer ended a worker (77)
REASON_WORKERS_STUCK: Final = "WorkersStuck"  # (74)
# the operator asked to restart a stalled gang in place and the round did not come (1): a disruption
REASON_STALLED: Final = "Stalled"
# ... likewise a restart asked with ANNOTATION_RESTART_IN_PLACE (1): a disruption
REASON_RESTART_ASKED: Final = "RestartAsked"
REASON_CONTRACT: Final = "ContractMismatch"  # the runtime library does not speak this contract's version (78)

# Prometheus gauges every trainer rank exports (name -> help). The operator reads some of them
# from rank 0 into status.training (SCRAPED).
METRIC_STEP: Final = "tetrad_step"
METRIC_LOSS: Final = "tetrad_loss"
METRIC_GRAD_NORM: Final = "tetrad_grad_norm"
METRIC_LEARNING_RATE: Final = "tetrad_learning_rate"
METRIC_STEP_TIME: Final = "tetrad_step_time_seconds"
METRIC_TOKENS_PER_SECOND: Final = "tetrad_tokens_per_second"
METRIC_TOKENS_PER_SECOND_PER_DEVICE: Final = "tetrad_tokens_per_second_per_device"
METRIC_TFLOPS: Final = "tetrad_tflops"
METRIC_MFU: Final = "tetrad_mfu"
METRIC_PEAK_MEMORY: Final = "tetrad_peak_memory_bytes"
METRIC_PEAK_MEMORY_RESERVED: Final = "tetrad_peak_memory_reserved_bytes"
METRIC_STARTUP: Final = "tetrad_startup_seconds"
METRIC_LAST_STEP_TIME: Final = "tetrad_last_step_timestamp_seconds"
METRIC_TRAIN_SECONDS: Final = "tetrad_train_seconds"
METRIC_CHECKPOINT_STALL: Final = "tetrad_checkpoint_stall_seconds"
METRIC_CHECKPOINT_STEP: Final = "tetrad_checkpoint_step"
METRIC_CHECKPOINT_TIME: Final = "tetrad_checkpoint_timestamp_seconds"
METRIC_RESUMED_FROM: Final = "tetrad_resumed_from_step"
METRIC_REQUEST_STEP: Final = "tetrad_checkpoint_request_step"  # labelled token=<the checkpoint-now token>
METRIC_REQUEST_TIME: Final = "tetrad_checkpoint_request_timestamp_seconds"  # likewise
LABEL_REQUEST_TOKEN: Final = "token"
METRIC_INFO: Final = "tetrad_info"
METRIC_ROUND: Final = "tetrad_round"  # labelled cause=<the failure that began the round; "" in round 0>
LABEL_ROUND_CAUSE: Final = "cause"
# The preflight gate's figures, labelled node and node_rank: rank 0 exports every node's, the
# others their own.
METRIC_PREFLIGHT_BUS_BANDWIDTH: Final = "tetrad_preflight_bus_bandwidth_bytes_per_second"
METRIC_PREFLIGHT_SECONDS: Final = "tetrad_preflight_seconds"
# Stragglers (tetrad.api.stragglers), rank 0 only: the slowest ranks, labelled rank and node, and the
# median rank's own time; the largest lag also goes in the JSON line and its own gauge (StepRecord).
METRIC_SLOWEST_RANK: Final = "tetrad_slowest_rank"
METRIC_SLOWEST_RANK_LAG: Final = "tetrad_slowest_rank_lag"
METRIC_RANK_LAG: Final = "tetrad_rank_lag"
METRIC_RANK_OWN: Final = "tetrad_rank_own_seconds"
METRIC_RANK_OWN_MEDIAN: Final = "tetrad_rank_own_median_seconds"

TRAINER_GAUGES: Final[dict[str, str]] = {
    METRIC_STEP: "Last completed optimizer step.",
    METRIC_LOSS: "Training loss of the last logged step (mean over the global batch).",
    METRIC_GRAD_NORM: "Global gradient L2 norm before clipping.",
    METRIC_LEARNING_RATE: "Learning rate of the last step.",
    METRIC_STEP_TIME: "Mean wall time of the steps since the last log.",
    METRIC_TOKENS_PER_SECOND: "Global training throughput in tokens per second.",
    METRIC_TOKENS_PER_SECOND_PER_DEVICE: "Throughput per process/GPU.",
    METRIC_TFLOPS: "Achieved model TFLOPS per device (6N + attention FLOPs per token).",
    METRIC_MFU: "Model FLOPs utilization per device, 0..1.",
    METRIC_PEAK_MEMORY: "Peak device memory allocated (CUDA) or peak RSS (CPU).",
    METRIC_PEAK_MEMORY_RESERVED: "Peak device memory reserved by the allocator.",
    METRIC_STARTUP: "Seconds from the worker's start to the end of its first step (model build, "
                    "checkpoint load).",
    METRIC_LAST_STEP_TIME: "Unix time at which the last optimizer step completed, set on every step: the "
                           "heartbeat the operator's stall detection reads.",
    METRIC_TRAIN_SECONDS: "Seconds from the end of this process's first step to its last log, checkpoint "
                          "stalls excluded.",
    METRIC_CHECKPOINT_STALL: "Seconds this process's training loop blocked on checkpoint saves after its "
                             "first step.",
    METRIC_CHECKPOINT_STEP: "Step of the last checkpoint this process committed; NaN until its first commit.",
    METRIC_CHECKPOINT_TIME: "Unix time at which that checkpoint was committed; NaN until then.",
    METRIC_RESUMED_FROM: "Step this process resumed from (0: no checkpoint, a fresh start); NaN until it "
                         "decided.",
    METRIC_REQUEST_STEP: "Step of the checkpoint that served the last checkpoint-now request (label token); "
                         "exported once that checkpoint committed.",
    METRIC_REQUEST_TIME: "Unix time at which that checkpoint committed (label token).",
    METRIC_SLOWEST_RANK: "Rank 0: the rank with the largest own time per step (-1: not gathered).",
    METRIC_SLOWEST_RANK_LAG: "Rank 0: that rank's lag, the share of every step the gang waits for it.",
}
ROUND_HELP: Final = ("The round of restarts in place this process runs in (0: the first), labelled with the "
                     "failure that began it.")
STRAGGLER_GAUGES: Final[dict[str, str]] = {
    METRIC_RANK_LAG: "Rank 0: the lag of each of the slowest ranks (labels rank, node).",
    METRIC_RANK_OWN: "Rank 0: the own time per step (compute and data wait, not waits for peers) of each of "
                     "the slowest ranks (labels rank, node).",
    METRIC_RANK_OWN_MEDIAN: "Rank 0: the median rank's own time per step.",
}
PREFLIGHT_GAUGES: Final[dict[str, str]] = {
    METRIC_PREFLIGHT_BUS_BANDWIDTH: "Bus bandwidth of the preflight all-reduce across the whole gang, as the "
                                    "node's ranks measured it (the slowest of them): "
                                    "2(n-1)/n x bytes / time.",
    METRIC_PREFLIGHT_SECONDS: "Wall time of the preflight gang check on the node (the slowest of its ranks).",
}

# Trainer gauge -> the status field it fills, as a path of the status model's field names
# (tetrad.api.spec.ParallelTrainingJobStatus): the operator writes each under the field's camelCase
# alias, as the field's type (a gauge filling a text field is a Unix time, stored as RFC 3339).
SCRAPED: Final[dict[str, str]] = {
    METRIC_STEP: "training.step",
    METRIC_LOSS: "training.loss",
    METRIC_TOKENS_PER_SECOND: "training.tokens_per_second",
    METRIC_MFU: "training.mfu",
    METRIC_PEAK_MEMORY: "training.peak_memory_bytes",
    METRIC_STEP_TIME: "training.step_time_seconds",
    METRIC_LAST_STEP_TIME: "training.last_step_time",
    METRIC_STARTUP: "training.startup_seconds",
}
# ... and into status.checkpoint; these are NaN until set, and a NaN is left out of a scrape, so a
# restart keeps the last committed step until its own first commit.
SCRAPED_CHECKPOINT: Final[dict[str, str]] = {
    METRIC_CHECKPOINT_STEP: "checkpoint.step",
    METRIC_CHECKPOINT_TIME: "checkpoint.time",
    METRIC_RESUMED_FROM: "checkpoint.resumed_from",
}
# ... and into status.trainerTime, written whole at each scrape (a field not read is removed), with the
# slowest node's METRIC_PREFLIGHT_SECONDS as its preflightSeconds.
SCRAPED_TRAINER_TIME: Final[dict[str, str]] = {
    METRIC_STEP: "trainer_time.step",
    METRIC_STARTUP: "trainer_time.startup_seconds",
    METRIC_TRAIN_SECONDS: "trainer_time.train_seconds",
    METRIC_CHECKPOINT_STALL: "trainer_time.checkpoint_stall_seconds",
    METRIC_RESUMED_FROM: "trainer_time.resumed_from",
    METRIC_ROUND: "trainer_time.round",
}
# 0 until the trainer first sets them: a 0 is left out, so the last incarnation's figure stays.
SCRAPED_UNSET_AT_ZERO: Final = frozenset({METRIC_LAST_STEP_TIME, METRIC_STEP_TIME, METRIC_STARTUP,
                                          METRIC_TOKENS_PER_SECOND, METRIC_MFU})


# status.checkpoint.requestCommitted: the checkpoint-now request rank 0 served (with its token, the label).
SCRAPED_REQUEST: Final[dict[str, str]] = {METRIC_REQUEST_STEP: "checkpoint.request_committed.step",
                                          METRIC_REQUEST_TIME: "checkpoint.request_committed.time"}


def step_dir_name(step: int) -> str:
    """The directory, under spec.checkpoint.path, of the checkpoint of `step` (the trainer's store
    writes it; the operator names it in status.checkpoint.path)."""
    return f"step-{step:08d}"


def step_path(checkpoint_path: str, step: int) -> str:
    """status.checkpoint.path of `step`: its directory inside the pod."""
    return f"{checkpoint_path.rstrip('/')}/{step_dir_name(step)}"
