"""The torchrun environment of one node (pod or local agent).

The operator's pods and `tetrad run`'s local agents both get exactly this, so a job behaves the
same locally and in the cluster. With it, a node's command is `render.objects.TRAIN_COMMAND`: the
exit-code supervisor around `torchrun -m tetrad_trainer.train --config CONFIG`.
"""

from __future__ import annotations

from tetrad.api.contract import ENV_CONFIG, ENV_JOB, ENV_METRICS_PORT, ENV_RDZV_TIMEOUT, ENV_RESTART
from tetrad.api.resolved import ResolvedConfig


def torchrun_env(cfg: ResolvedConfig, *, node_rank: int, master_addr: str, master_port: int,
                 rdzv_id: str, restart: int, config_path: str, rdzv_timeout: int,
                 metrics_port: int | None = None, shutdown_timeout: int | None = None) -> dict[str, str]:
    endpoint = f"{master_addr}:{master_port}"
    env = {
        "PET_NNODES": str(cfg.nodes),
        "PET_NPROC_PER_NODE": str(cfg.nproc_per_node),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port),
        # Static rendezvous: node ranks are the pod indices, the store lives on node 0.
        "PET_RDZV_ID": rdzv_id,
        "PET_RDZV_BACKEND": "static",
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_RDZV_CONF": f"join_timeout={rdzv_timeout},timeout={rdzv_timeout}",
        # The operator restarts the whole gang; a local torchrun restart would split it.
        "PET_MAX_RESTARTS": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(cfg.world_size),
        ENV_CONFIG: config_path,
        ENV_RESTART: str(restart),
        ENV_METRICS_PORT: str(metrics_port if metrics_port is not None else cfg.metrics.port),
        ENV_JOB: cfg.job_name,
        ENV_RDZV_TIMEOUT: str(rdzv_timeout),
        "PYTHONUNBUFFERED": "1",
    }
    if shutdown_timeout is not None:
        # How long torchrun lets workers save a checkpoint after SIGTERM before it SIGKILLs them.
        env["PET_SHUTDOWN_TIMEOUT"] = str(shutdown_timeout)
    return env
