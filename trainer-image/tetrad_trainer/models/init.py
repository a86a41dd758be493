"""Layout-independent initialization, for every model definition.

The model is built on the meta device, parallelized there, then materialized with `init_weights`:
each rank draws only the values it holds, every value a function of (seed, parameter name, its
global index) (`initial_slice`); the definition's `init` rule says which distribution a parameter's
values come from. Hence the same seed gives the same model, bit for bit, for every layout, and no
rank ever holds a whole parameter it does not own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tetrad.api.resolved import ModelConfig
from tetrad_trainer.models.interface import ModelDefinition
from tetrad_trainer.models.loader import definition_of


def canonical_name(fqn: str) -> str:
    """The parameter's name in the plain model, without wrapper prefixes of compile or checkpointing."""
    return ".".join(p for p in fqn.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module"))


TILE = (256, 1024)  # rows x columns of one independently drawn piece of a parameter


def _tile_generator(seed: int, name: str, tile: tuple[int, int]) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{tile[0]}/{tile[1]}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_slice(name: str, shape: Sequence[int], offset: Sequence[int], size: Sequence[int],
                  cfg: ModelConfig, seed: int, definition: ModelDefinition | None = None) -> torch.Tensor:
    """The box [offset, offset+size) of the initial value of the parameter called name (full shape
    `shape`), on the CPU in fp32, computed without the rest of the parameter.

    The parameter is cut into TILE-sized tiles, each drawn from its own generator seeded by
    (seed, name, tile index): a value depends only on (seed, name, its global index), whatever box
    it is computed in. Only the tiles the box touches are drawn, one at a time. The definition
    (default: the one cfg names) gives the distribution; a tied parameter is drawn as its source.
    """
    if len(shape) not in (1, 2):
        raise ValueError(f"{name}: initial_slice takes 1-D or 2-D parameters, got shape {tuple(shape)}")
    out = torch.empty(tuple(size), dtype=torch.float32)
    if out.numel() == 0:
        return out
    definition = definition or definition_of(cfg)
    name = definition.source_name(name)
    draw = definition.init(name, cfg)
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    (r0, c0), (nr, nc) = ((0, offset[0]), (1, size[0])) if len(shape) == 1 else (offset, size)
    box = out.view(nr, nc)
    tr, tc = TILE
    for i in range(r0 // tr, (r0 + nr - 1) // tr + 1):
        for j in range(c0 // tc, (c0 + nc - 1) // tc + 1):
            top, left = i * tr, j * tc
            tile = draw(torch.empty(min(tr, rows - top), min(tc, cols - left)),
                        _tile_generator(seed, name, (i, j)))
            # the part of the tile inside the box, in tile and in box coordinates
            a, b = max(r0, top), min(r0 + nr, top + tile.shape[0])
            c, d = max(c0, left), min(c0 + nc, left + tile.shape[1])
            box[a - r0:b - r0, c - c0:d - c0] = tile[a - top:b - top, c - left:d - left]
    return out


def initial_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int,
                  definition: ModelDefinition | None = None) -> torch.Tensor:
    """The full, layout-independent initial value of the parameter called name (on the CPU, fp32)."""
    return initial_slice(name, shape, [0] * len(shape), shape, cfg, seed, definition)


def local_box(param: torch.Tensor) -> tuple[list[int], list[int]]:
    """(global offset, local size) of this rank's piece of param (a plain tensor or a DTensor)."""
    if not isinstance(param, DTensor):
        return [0] * param.dim(), list(param.shape)
    size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return list(offset), list(size)


@torch.no_grad()
def init_weights(model: nn.Module, device: torch.device, seed: int, params_device: torch.device | None = None,
                 positions: torch.Tensor | None = None, definition: ModelDefinition | None = None) -> None:
    """Materialize a meta-device (possibly parallelized) model on device with its initial weights.

    params_device: where the parameters live instead (the host, under FSDP's CPU offload); buffers stay
    on device. positions: of the local sequence (default 0..seq_len-1; this rank's chunks under CP).
    definition: default the one model.cfg names.
    """
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    definition = definition or definition_of(cfg)
    model.to_empty(device=params_device or device)
    definition.tie(model)  # to_empty gives each module a parameter of its own
    for fqn, param in model.named_parameters():
        offset, size = local_box(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(initial_slice(canonical_name(fqn), param.shape, offset, size, cfg, seed, definition))
    positions = torch.arange(cfg.seq_len) if positions is None else positions
    model.set_positions(positions.to(device))  # type: ignore[operator]
