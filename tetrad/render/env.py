"""The torchrun environment of one node (pod or local agent).

The operator's pods and `tetrad run`'s local agents both get exactly this, so a job behaves the
same locally and in the cluster. With it, a node runs `tetrad.render.command.node_command`: the
launcher's supervisor around torchrun around each worker's entry point. The TETRAD_* variables a
script may read are listed in docs/bring-your-own.md.

Two parts: `job_env`, the same on every node of every incarnation (a pod takes it from the job's
environment ConfigMap through envFrom), and `node_env`, what sets one node of one incarnation
apart (in the pod's own env).
"""

from __future__ import annotations

import json

from tetrad.api.contract import (
    CONTRACT_VERSION,
    ENV_CHECKPOINT_DIR,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_CONFIG,
    ENV_CONTRACT,
    ENV_CPUS,
    ENV_GPUS,
    ENV_JOB,
    ENV_MESH,
    ENV_METRICS_PORT,
    ENV_PREFLIGHT,
    ENV_RDZV_TIMEOUT,
    ENV_RESTART,
    ENV_ROUNDS,
    ENV_TORCHRUN_SHUTDOWN_TIMEOUT,
)
from tetrad.api.resolved import MESH_DIMS, ResolvedConfig
from tetrad.api.spec import RunPolicy
from tetrad.node.environment import RoundSettings, format_mesh


def job_env(cfg: ResolvedConfig, *, master_addr: str, master_port: int, config_path: str, rdzv_timeout: int,
            metrics_port: int | None = None, shutdown_timeout: int | None = None) -> dict[str, str]:
    """What every node of the job gets, in every incarnation."""
    env = {
        "PET_NNODES": str(cfg.nodes),
        "PET_NPROC_PER_NODE": str(cfg.nproc_per_node),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port),
        # Static rendezvous: node ranks are the pod indices, the store lives on node 0.
        "PET_RDZV_BACKEND": "static",
        "PET_RDZV_ENDPOINT": f"{master_addr}:{master_port}",
        "PET_RDZV_CONF": f"join_timeout={rdzv_timeout},timeout={rdzv_timeout}",
        # The operator restarts the whole gang; a local torchrun restart would split it.
        "PET_MAX_RESTARTS": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(cfg.world_size),
        ENV_CONFIG: config_path,
        ENV_METRICS_PORT: str(metrics_port if metrics_port is not None else cfg.metrics.port),
        ENV_JOB: cfg.job_name,
        ENV_RDZV_TIMEOUT: str(rdzv_timeout),
        ENV_CONTRACT: str(CONTRACT_VERSION),
        ENV_MESH: format_mesh({d: getattr(cfg.layout, d) for d in MESH_DIMS}),
        ENV_GPUS: str(cfg.nproc_per_node if cfg.use_gpu else 0),
        ENV_COLLECTIVE_TIMEOUT: str(cfg.collective_timeout_seconds),
        ENV_CHECKPOINT_DIR: cfg.checkpoint.path,
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.cpus is not None:
        env[ENV_CPUS] = f"{cfg.cpus:g}"
    if cfg.preflight.enabled:
        p = cfg.preflight
        env[ENV_PREFLIGHT] = json.dumps({"timeoutSeconds": p.timeout_seconds,
                                         "allReduceMiB": p.all_reduce_mi_b,
                                         "slowNodeFraction": p.slow_node_fraction})
    if shutdown_timeout is not None:
        # How long torchrun lets workers save a checkpoint after SIGTERM before it SIGKILLs them.
        env[ENV_TORCHRUN_SHUTDOWN_TIMEOUT] = str(shutdown_timeout)
    return env


def node_env(*, node_rank: int, rdzv_id: str, restart: int) -> dict[str, str]:
    """What sets one node of one incarnation apart."""
    return {"PET_NODE_RANK": str(node_rank), "PET_RDZV_ID": rdzv_id, ENV_RESTART: str(restart)}


def torchrun_env(cfg: ResolvedConfig, *, node_rank: int, master_addr: str, master_port: int,
                 rdzv_id: str, restart: int, config_path: str, rdzv_timeout: int,
                 metrics_port: int | None = None, shutdown_timeout: int | None = None) -> dict[str, str]:
    """A node's whole environment: `job_env` and `node_env` together."""
    return {**job_env(cfg, master_addr=master_addr, master_port=master_port, config_path=config_path,
                      rdzv_timeout=rdzv_timeout, metrics_port=metrics_port,
                      shutdown_timeout=shutdown_timeout),
            **node_env(node_rank=node_rank, rdzv_id=rdzv_id, restart=restart)}


def rounds_env(policy: RunPolicy, *, host: str, port: int, left: int, token: str,
               restarts: int = 0) -> dict[str, str]:
    """Restarts in place (tetrad.node.rounds): where node 0's coordinator listens, the restarts `left` in
    spec.runPolicy.maxRestarts, the gang's `restarts` so far (its backoff doubles with each), and the
    `token` that only its nodes have."""
    settings = RoundSettings(host, port, left, tuple(policy.retryable_exit_codes),
                             tuple(policy.permanent_exit_codes), policy.backoff_seconds,
                             policy.backoff_max_seconds, restarts, token)
    return {ENV_ROUNDS: settings.encode()}
