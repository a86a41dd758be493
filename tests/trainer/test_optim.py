"""Learning-rate schedules, gradient clipping and the fused step (single process; the distributed norm is
covered by the equivalence matrix)."""

from __future__ import annotations

import math

import pytest
import torch
from tetrad_trainer.optim import (
    adamw_implementation,
    build_optimizer,
    clip_and_step,
    clip_grad_norm_,
    folds_clipping,
    lr_at,
)

from tetrad.api.spec import Training


def training(schedule: str, **kw: object) -> Training:
    return Training(steps=111, lr=1e-3, min_lr=1e-4, warmup_steps=10, lr_schedule=schedule, **kw)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_is_linear_to_the_peak(schedule: str) -> None:
    t = training(schedule)
    assert [lr_at(s, t) for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])


def test_cosine_and_linear_decay_to_min_lr_at_the_last_step() -> None:
    cos, lin = training("cosine"), training("linear")
    assert lr_at(11, cos) == pytest.approx(1e-3) and lr_at(11, lin) == pytest.approx(1e-3)
    assert lr_at(111, cos) == pytest.approx(1e-4) and lr_at(111, lin) == pytest.approx(1e-4)
    assert lr_at(36, cos) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(61, lin) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(61, training("constant")) == 1e-3
    lrs = [lr_at(s, cos) for s in range(10, 112)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_no_warmup_starts_at_the_peak() -> None:
    assert lr_at(1, Training(steps=10, lr=1e-3, min_lr=0.0, warmup_steps=0)) == pytest.approx(1e-3)


def test_clipping_scales_to_max_norm_and_returns_the_norm_before() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.tensor([3.0, 0, 0]), torch.tensor([0, 4.0, 0, 0])
    norm = clip_grad_norm_([a, b], 1.0, None)
    assert norm.item() == pytest.approx(5.0)
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_([a, b], 0.0, None).item() == pytest.approx(1.0, rel=1e-5)  # 0 disables clipping


def test_adamw_uses_the_configured_hyperparameters() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer([p], training("cosine", weight_decay=0.05))
    group = opt.param_groups[0]
    assert (group["weight_decay"] == 0.05 and group["betas"] == (0.9, 0.95)
            and group["lr"] == pytest.approx(1e-4))


def params_on(device: str, dtype: torch.dtype = torch.float32, n: int = 3) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4, 4, device=device, dtype=dtype)) for _ in range(n)]


def test_fused_adamw_where_the_parameters_allow_it() -> None:
    assert adamw_implementation(params_on("cpu")) == "fused"  # torch's fused AdamW runs on CPU and CUDA
    assert adamw_implementation(params_on("cpu", torch.bfloat16)) == "fused"
    assert adamw_implementation(params_on("meta")) == "foreach"  # no fused kernel for the device
    assert adamw_implementation(params_on("cpu") + params_on("meta")) == "foreach"  # two device types
    assert adamw_implementation(params_on("cpu", torch.complex64)) == "foreach"  # a dtype the kernel lacks
    assert adamw_implementation([]) == "foreach"


def test_dtensor_parameters_get_fused_only_when_dtensor_runs_the_kernel(one_rank_mesh, monkeypatch) -> None:
    from tetrad_trainer import optim
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = [torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), one_rank_mesh, [Shard(0)]))
               for _ in range(2)]
    assert optim.adamw_implementation(sharded) == "fused"
    # DTensors mixed with plain tensors
    assert optim.adamw_implementation(sharded + params_on("cpu")) == "foreach"
    monkeypatch.setattr(optim, "_dtensor_has_fused_adamw", lambda: False)  # as in a torch without the rule
    assert optim.adamw_implementation(sharded) == "foreach"
    assert optim.adamw_implementation(params_on("cpu")) == "fused"


def test_fused_foreach_and_plain_adamw_take_the_same_steps() -> None:
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(33, 17, generator=g) for _ in range(3)]
    grads = [[torch.randn(33, 17, generator=g) for _ in range(3)] for _ in range(4)]
    results = {}
    for implementation in ("plain", "foreach", "fused"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        kw = {"foreach": False} if implementation == "plain" else {implementation: True}
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.clone()
            opt.step()
        results[implementation] = torch.cat([p.detach().flatten() for p in params])
    moved = (results["plain"] - torch.cat([t.flatten() for t in start])).abs().max().item()
    assert moved > 1e-2  # the steps did move the weights
    for implementation in ("foreach", "fused"):
        assert torch.allclose(results[implementation], results["plain"], rtol=0, atol=1e-6), implementation


def test_build_optimizer_picks_the_fused_kernel_on_cpu() -> None:
    opt = build_optimizer(params_on("cpu"), training("cosine"))
    assert opt.param_groups[0]["fused"] is True and not opt.param_groups[0]["foreach"]


@pytest.mark.parametrize("max_norm", [0.5, 100.0, 0.0])
def test_clipping_folded_into_the_fused_step_equals_clipping_then_stepping(max_norm: float) -> None:
    """The fused kernel's grad_scale scales by torch's clip factor: the same parameters after three
    steps as clipping the gradients and then stepping with the foreach kernels."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(5, 7, generator=g) for _ in range(3)]
    grads = [[torch.randn(5, 7, generator=g) * 3 for _ in range(3)] for _ in range(3)]
    results = []
    for fold in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                **{"fused" if fold else "foreach": True})
        assert folds_clipping(opt) is fold
        norms = []
        for step in grads:
            for p, grad in zip(params, step, strict=True):
                p.grad = grad.clone()
            norms.append(clip_and_step(opt, max_norm, None).item())
            assert not hasattr(opt, "grad_scale")  # set for one step only
        results.append((params, norms))
    (folded, folded_norms), (plain, plain_norms) = results
    assert folded_norms == pytest.approx(plain_norms, rel=1e-6)
    for a, b in zip(folded, plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    moved = max((a - s).abs().max().item() for a, s in zip(folded, start, strict=True))
    assert moved > 1e-3  # the steps did something to compare
