"""Learning-rate schedules and gradient clipping (single process; the distributed norm is covered by the equivalence matrix)."""

from __future__ import annotations

import math

import pytest
import torch
from tetrad_trainer.optim import build_optimizer, clip_grad_norm_, lr_at

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
    assert group["weight_decay"] == 0.05 and group["betas"] == (0.9, 0.95) and group["lr"] == pytest.approx(1e-4)
