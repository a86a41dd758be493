"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    """A gloo world of this one process and its 1-D CPU mesh, for DTensor and FSDP in-process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
