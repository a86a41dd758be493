"""The device mesh: (pp, dp_replicate, dp_shard, cp, tp), outermost first, plus flattened views.

Every dim exists even at degree 1, so the rest of the trainer never asks whether a dim is there.
The flattened views are the groups the trainer reduces over:

  dp           dp_replicate x dp_shard       ranks that load different data
  dp_shard_cp  dp_shard x cp                 FSDP shards parameters over these
  dp_cp        dp_replicate x dp_shard x cp  the loss is averaged over these
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tetrad.api.resolved import MESH_DIMS, Layout
from tetrad.node import collective
from tetrad.node.environment import WorkerEnv
from tetrad_trainer.config import ConfigError


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(collective_timeout_s: int | None = None, local_rank: int | None = None) -> torch.device:
    """Join the process group torchrun describes in the environment; return this rank's device (GPU
    `local_rank`, by default the environment's). With `collective_timeout_s`, every process group gets it
    as its collective timeout (tetrad_trainer.collective); without, torch's defaults apply."""
    if local_rank is None:
        local_rank = WorkerEnv.read().local_rank
    timeout = collective.configure(collective_timeout_s) if collective_timeout_s is not None else None
    if device_type() == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible;"
                              " set nprocPerNode to the number of GPUs per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo for the few CPU-side collectives (object gathers), NCCL for everything else.
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


@dataclass(frozen=True)
class Mesh:
    """The world mesh and the views the trainer uses, named as in the module docstring."""

    world: DeviceMesh
    dp: DeviceMesh
    dp_shard_cp: DeviceMesh
    dp_cp: DeviceMesh
    hsdp: DeviceMesh  # (dp_replicate, dp_shard_cp): the 2D mesh of HSDP

    def __getitem__(self, dim: str) -> DeviceMesh:
        return self.world[dim]

    def local_rank(self, dim: str) -> int:
        return self.world[dim].get_local_rank()


def build_mesh(layout: Layout, device: torch.device) -> Mesh:
    world_size = dist.get_world_size()
    degrees = " x ".join(f"{d}={getattr(layout, d)}" for d in MESH_DIMS)
    if layout.world_size != world_size:
        raise ConfigError(f"cannot build the device mesh {degrees} = {layout.world_size} ranks"
                          f" on a world of {world_size} processes;"
                          " the degrees must multiply to the world size")
    try:
        world = init_device_mesh(device.type, layout.shape, mesh_dim_names=MESH_DIMS)
    except Exception as e:  # noqa: BLE001 - torch raises assorted types; the message is what matters
        raise ConfigError(f"cannot build the device mesh {degrees} on {world_size} {device.type} "
                          f"processes: {e}") from e
    dp = world["dp_replicate", "dp_shard"]._flatten("dp")
    dp_shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    # HSDP needs (dp_replicate, dp_shard_cp) as one 2D mesh: flatten dp_cp, then split it again.
    hsdp = dp_cp._unflatten(0, (layout.dp_replicate, layout.dp_shard * layout.cp),
                            ("dp_replicate", "dp_shard_cp"))
    return Mesh(world=world, dp=dp, dp_shard_cp=dp_shard_cp, dp_cp=dp_cp, hsdp=hsdp)
