"""AdamW, the learning-rate schedule and gradient clipping across every mesh dim.

AdamW runs as one fused kernel per device when the parameters allow it (`adamw_implementation`),
as torch's foreach (multi-tensor) kernels otherwise; both compute the same update as the plain
per-parameter loop, up to float rounding. `clip_and_step` folds the clipping into the fused kernel
where it can: the kernel divides each gradient by its `grad_scale` as it reads it, which saves a
pass over every gradient.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tetrad.api.spec import LRSchedule, Training

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtensor_has_fused_adamw() -> bool:
    """Whether this torch's DTensor shards `aten._fused_adamw_` (older versions lack the rule)."""
    op = torch.ops.aten._fused_adamw_.default
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(prop, table, {}) for table in tables)


def adamw_implementation(params: list[nn.Parameter]) -> str:
    """"fused" when every parameter is a floating tensor of a dtype the fused kernel takes, all on
    one device type that has the kernel, and either no parameter or every parameter is a DTensor
    (FSDP, TP) of a torch whose DTensor runs the kernel; "foreach" otherwise."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    if not params:
        return "foreach"
    device_types = {p.device.type for p in params}
    if len(device_types) != 1 or device_types.pop() not in _get_fused_kernels_supported_devices():
        return "foreach"
    if any(p.dtype not in FUSED_DTYPES for p in params):
        return "foreach"
    dtensors = sum(isinstance(p, DTensor) for p in params)
    if dtensors and (dtensors < len(params) or not _dtensor_has_fused_adamw()):
        return "foreach"
    return "fused"


def build_optimizer(params: list[nn.Parameter], training: Training) -> torch.optim.AdamW:
    params = list(params)
    implementation = adamw_implementation(params)
    return torch.optim.AdamW(params, lr=lr_at(1, training), betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=training.weight_decay, **{implementation: True})


def lr_at(step: int, training: Training) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup to lr, then decay from lr at the
    first step after warmup to min_lr at the last step."""
    t = training
    if step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.lr_schedule == LRSchedule.CONSTANT:
        return t.lr
    progress = min(1.0, (step - t.warmup_steps - 1) / max(1, t.steps - t.warmup_steps - 1))
    if t.lr_schedule == LRSchedule.LINEAR:
        return t.min_lr + (t.lr - t.min_lr) * (1.0 - progress)
    return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None,
                    uncounted: Collection[nn.Parameter] = ()) -> torch.Tensor:
    """The global L2 norm of all gradients; scales them down to max_norm when max_norm > 0.

    Gradients are DTensors sharded over FSDP and TP dims: full_tensor() of the DTensor norm sums
    the squares over those. Pipeline stages hold disjoint parameters: add their squares across pp.
    `uncounted` (the second copy of a tied parameter split over two stages) is clipped, not counted:
    the first copy holds the same gradient.
    """
    skip = {id(p) for p in uncounted}
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm**2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def folds_clipping(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step can apply the clipping: fused AdamW over plain tensors (with
    DTensor parameters grad_scale would be a plain tensor among DTensors, which is not relied on)."""
    return bool(optimizer.defaults.get("fused")) and not any(
        isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


@torch.no_grad()
def clip_and_step(optimizer: torch.optim.Optimizer, max_norm: float, pp_group: dist.ProcessGroup | None,
                  uncounted: Collection[nn.Parameter] = ()) -> torch.Tensor:
    """One optimizer step on gradients clipped to max_norm (clip_grad_norm_); returns the norm before
    clipping. Where the step folds the clipping in, it scales by the same factor torch's clipping uses."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if max_norm <= 0 or not folds_clipping(optimizer):
        norm = clip_grad_norm_(params, max_norm, pp_group, uncounted)
        optimizer.step()
        return norm
    norm = clip_grad_norm_(params, 0.0, pp_group, uncounted)
    # torch's clip multiplies by min(max_norm / (norm + 1e-6), 1); the kernel divides by its inverse
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
    return norm
