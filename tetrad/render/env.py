"""The torchrun environment of one node (pod or local agent).

The operator's pods and `tetrad run`'s local agents both get exactly this, so a job behaves the
same locally and in the cluster. With it, a node's command is `render.objects.TRAIN_COMMAND`: the
exit-code supervisor around `torchrun -m tetrad_trainer.train --config CONFIG`.

Two parts: `job_env`, the same on every node of every incarnation (a pod takes it from the job's
environment ConfigMap through envFrom), and `node_env`, what sets one node of one incarnation
apart (in the pod's own env).
"""

from __future__ import annotations

from tetrad.api.contract import ENV_CONFIG, ENV_JOB, ENV_METRICS_PORT, ENV_RDZV_TIMEOUT, ENV_RESTART
from tetrad.api.resolved import ResolvedConfig


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
        "PYTHONUNBUFFERED": "1",
    }
    if shutdown_timeout is not None:
        # How long torchrun lets workers save a checkpoint after SIGTERM before it SIGKILLs them.
        env["PET_SHUTDOWN_TIMEOUT"] = str(shutdown_timeout)
    return env


def node_env(*, node_rank: int, rdzv_id: str, restart: int) -> dict[str, str]:
    """What sets one node of one incarnation apart."""
    return {"PET_NODE_RANK": str(node_rank), "PET_RDZV_ID": rdzv_id, ENV_RESTART: str(restart)}


def torchrun_env(cfg: ResolvedConfig, *, node_rank: int, master_addr: str, master_port: int,
                 rdzv_id: str, restart: int, config_path: str, rdzv_timeout: int,
                 metrics_port: int | None = None, shutdown_timeout: int | None = None) -> dict[str, str]:
    """A node's whole environment: `job_env` and `node_env` together."""
    return {**job_env(cfg, master_addr=master_addr, master_port=master_port, config_path=config_path,
                      rdzv_timeout=rdzv_timeout, metrics_port=metrics_port, shutdown_timeout=shutdown_timeout),
            **node_env(node_rank=node_rank, rdzv_id=rdzv_id, restart=restart)}
