"""What a node's launcher and workers read of their environment, read once into typed objects: `NodeEnv`
(the node's supervisor) and `WorkerEnv` (each worker process: the trainer, a user's script).

tetrad.render.env writes these variables (the pods' and `tetrad run`'s); torchrun adds the per-worker
ones (RANK, LOCAL_RANK, WORLD_SIZE, PET_SHUTDOWN_TIMEOUT, ...). Nothing else in tetrad.node or the
trainer reads os.environ for them.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tetrad.api.contract import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_REQUEST_FILE,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_CONFIG,
    ENV_CONTRACT,
    ENV_CPUS,
    ENV_EXIT_DIR,
    ENV_GPUS,
    ENV_JSONL,
    ENV_MESH,
    ENV_METRICS_PORT,
    ENV_NODE_NAME,
    ENV_PREFLIGHT,
    ENV_RDZV_TIMEOUT,
    ENV_RESTART,
    ENV_ROUND,
    ENV_ROUND_CAUSE,
    ENV_ROUNDS,
    ENV_SPARE,
    ENV_TERMINATION_LOG,
    ENV_TEST_FAULT,
    ENV_TEST_FAULTS_ALLOWED,
    ENV_TEST_OOM_AT_STEP,
    ENV_TORCHRUN_SHUTDOWN_TIMEOUT,
    TERMINATION_LOG,
)

DEFAULT_RDZV_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class PreflightSettings:
    """spec.preflight, as the gang check needs it."""

    timeout_seconds: float = 120.0
    all_reduce_mib: int = 64
    slow_node_fraction: float = 0.5


@dataclass(frozen=True)
class RoundSettings:
    """Restarts in place (tetrad.node.rounds): where node 0's coordinator listens, how many restarts the
    budget has left, and spec.runPolicy's exit-code lists (tetrad.api.restart_policy)."""

    host: str
    port: int
    left: int
    retryable: tuple[int, ...] = ()
    permanent: tuple[int, ...] = ()
    backoff_s: float = 0.0  # spec.runPolicy.backoffSeconds
    backoff_max_s: float = 0.0  # spec.runPolicy.backoffMaxSeconds
    restarts: int = 0  # the gang's restarts before these rounds (the backoff doubles with each)
    token: str = ""  # only the gang's nodes have it: the coordinator turns away anyone else

    def encode(self) -> str:
        return json.dumps({"address": f"{self.host}:{self.port}", "left": self.left,
                           "retryable": list(self.retryable), "permanent": list(self.permanent),
                           "backoff": [self.backoff_s, self.backoff_max_s], "restarts": self.restarts,
                           "token": self.token})

    @classmethod
    def parse(cls, text: str) -> RoundSettings:
        doc = json.loads(text)
        host, _, port = str(doc["address"]).rpartition(":")
        backoff, backoff_max = doc.get("backoff", (0.0, 0.0))
        return cls(host, int(port), int(doc["left"]), tuple(int(c) for c in doc.get("retryable", ())),
                   tuple(int(c) for c in doc.get("permanent", ())), float(backoff), float(backoff_max),
                   int(doc.get("restarts", 0)), str(doc.get("token", "")))


@dataclass(frozen=True)
class NodeEnv:
    node_rank: int  # PET_NODE_RANK: the pod's index in the gang
    nodes: int  # PET_NNODES: the gang's nodes
    rdzv_id: str  # PET_RDZV_ID: this incarnation's rendezvous
    nproc: int | None  # PET_NPROC_PER_NODE
    master_addr: str | None  # PET_MASTER_ADDR: pod 0's stable DNS name (127.0.0.1 under `tetrad run`)
    rdzv_timeout_s: float
    restart: int
    node_name: str  # the Kubernetes node (downward API), else this host's name
    in_pod: bool  # a pod of a cluster, not a node of `tetrad run` (those share one machine)
    gpus: int  # GPUs each node requests: the devices it must see; 0 runs on CPUs
    cpus: float | None  # CPUs each node requests; None: no request
    preflight: PreflightSettings | None  # None: the gate is off
    collective_timeout_s: int | None
    checkpoint_dir: str | None
    mesh: tuple[tuple[str, int], ...]  # (dim, degree), outermost first; empty when not given
    contract: int | None
    exit_dir: Path | None  # where the node's workers leave their reports for its supervisor
    rounds: RoundSettings | None  # restarts in place; None: off (a failed node exits)
    spare: bool  # a spare interpreter readies each next round (tetrad.node.spare), unless TETRAD_SPARE=0
    round: int  # the round of restarts in place (a worker's; 0 for the supervisor)
    round_cause: str | None  # the failure that began that round (from round 1 on)
    termination_log: Path | None  # where the node's termination message goes; None: nowhere
    shutdown_timeout_s: float | None  # torchrun's wait for its workers after SIGTERM; None: not known

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> NodeEnv:
        preflight = env.get(ENV_PREFLIGHT)
        settings = None
        if preflight:
            doc = json.loads(preflight)
            settings = PreflightSettings(float(doc.get("timeoutSeconds", 120)),
                                         int(doc.get("allReduceMiB", 64)),
                                         float(doc.get("slowNodeFraction", 0.5)))
        log = env.get(ENV_TERMINATION_LOG)
        shutdown = env.get(ENV_TORCHRUN_SHUTDOWN_TIMEOUT, "")
        return cls(
            node_rank=_int(env.get("PET_NODE_RANK")) or 0,
            nodes=_int(env.get("PET_NNODES")) or 1,
            rdzv_id=env.get("PET_RDZV_ID", ""),
            nproc=_int(env.get("PET_NPROC_PER_NODE")),
            master_addr=env.get("PET_MASTER_ADDR") or None,
            rdzv_timeout_s=float(env.get(ENV_RDZV_TIMEOUT) or DEFAULT_RDZV_TIMEOUT_S),
            restart=_int(env.get(ENV_RESTART)) or 0,
            node_name=env.get(ENV_NODE_NAME) or socket.gethostname(),
            in_pod=bool(env.get(ENV_NODE_NAME)),
            gpus=_int(env.get(ENV_GPUS)) or 0,
            cpus=float(env[ENV_CPUS]) if env.get(ENV_CPUS) else None,
            preflight=settings,
            collective_timeout_s=_int(env.get(ENV_COLLECTIVE_TIMEOUT)),
            checkpoint_dir=env.get(ENV_CHECKPOINT_DIR) or None,
            mesh=parse_mesh(env.get(ENV_MESH, "")),
            contract=_int(env.get(ENV_CONTRACT)),
            exit_dir=_path(env.get(ENV_EXIT_DIR)),
            rounds=RoundSettings.parse(env[ENV_ROUNDS]) if env.get(ENV_ROUNDS) else None,
            spare=env.get(ENV_SPARE, "1").strip() != "0",
            round=_int(env.get(ENV_ROUND)) or 0,
            round_cause=env.get(ENV_ROUND_CAUSE) or None,
            # Kubernetes' file exists only in a container; elsewhere nothing is written unless asked.
            termination_log=Path(log) if log else (Path(TERMINATION_LOG) if Path(TERMINATION_LOG).exists()
                                                   else None),
            shutdown_timeout_s=float(shutdown) if shutdown.replace(".", "", 1).isdigit() else None,
        )


@dataclass(frozen=True)
class WorkerEnv:
    """One worker process's environment: torchrun's per-worker variables, its node's, and the trainer's
    own settings. Read once per process (`read`) and handed to what needs it."""

    node: NodeEnv
    rank: int  # RANK; 0 outside torchrun
    local_rank: int  # LOCAL_RANK: the device index on the node
    world_size: int  # WORLD_SIZE
    local_world_size: int  # LOCAL_WORLD_SIZE: the workers on this node
    config: Path | None  # ENV_CONFIG: the resolved trainer config
    jsonl: Path | None  # ENV_JSONL: where rank 0 appends its JSON lines (`tetrad run`)
    metrics_port: int | None  # ENV_METRICS_PORT: rank r serves Prometheus on this port + local_rank
    checkpoint_request_file: Path | None  # ENV_CHECKPOINT_REQUEST_FILE (checkpoint-now)
    test_fault: str | None  # ENV_TEST_FAULT, as given (tetrad_trainer.faults parses it)
    test_faults_allowed: bool  # ENV_TEST_FAULTS_ALLOWED=1: test faults act
    test_oom_at_step: int | None  # ENV_TEST_OOM_AT_STEP (tests only)

    @property
    def restart(self) -> int:
        return self.node.restart

    @property
    def exit_dir(self) -> Path | None:
        return self.node.exit_dir

    @property
    def shutdown_timeout_s(self) -> float | None:
        return self.node.shutdown_timeout_s

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> WorkerEnv:
        return cls(
            node=NodeEnv.read(env),
            rank=_int(env.get("RANK")) or 0,
            local_rank=_int(env.get("LOCAL_RANK")) or 0,
            world_size=_int(env.get("WORLD_SIZE")) or 1,
            local_world_size=_int(env.get("LOCAL_WORLD_SIZE")) or 1,
            config=_path(env.get(ENV_CONFIG)),
            jsonl=_path(env.get(ENV_JSONL)),
            metrics_port=_int(env.get(ENV_METRICS_PORT)),
            checkpoint_request_file=_path(env.get(ENV_CHECKPOINT_REQUEST_FILE)),
            test_fault=env.get(ENV_TEST_FAULT) or None,
            test_faults_allowed=env.get(ENV_TEST_FAULTS_ALLOWED) == "1",
            test_oom_at_step=_int(env.get(ENV_TEST_OOM_AT_STEP)),
        )


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None


def format_mesh(dims: Mapping[str, int]) -> str:
    """ENV_MESH's value: `dim=degree` pairs, outermost first."""
    return ",".join(f"{d}={n}" for d, n in dims.items())


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in filter(None, text.split(",")):
        name, _, degree = item.partition("=")
        pairs.append((name.strip(), int(degree)))
    return tuple(pairs)
