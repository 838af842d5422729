"""Learning-rate schedules, AdamW parameter groups and gradient clipping."""

import math

import pytest
import torch
from pydantic import ValidationError

from primerl_trainer.optim import (
    LRScheduleConfig,
    OptimizerConfig,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    lr_factor,
)


def _factors(config: LRScheduleConfig, num_steps: int) -> list[float]:
    return [lr_factor(step, config) for step in range(num_steps)]


def test_constant_schedule_with_and_without_warmup() -> None:
    assert _factors(LRScheduleConfig(), 3) == [1.0, 1.0, 1.0]
    assert _factors(LRScheduleConfig(warmup_steps=4), 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_after_warmup_to_the_floor() -> None:
    config = LRScheduleConfig(decay="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    expected = [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    assert _factors(config, 8) == pytest.approx(expected)


def test_cosine_decay_after_warmup_to_the_floor() -> None:
    config = LRScheduleConfig(decay="cosine", warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
    # Progress 0, 1/4, 1/2, 3/4, 1 after the warmup step.
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    expected = [1.0] + [0.2 + 0.8 * c for c in cosine] + [0.2]
    assert _factors(config, 7) == pytest.approx(expected)
    assert expected[3] == pytest.approx(0.6)


def test_scheduler_sets_the_optimizer_learning_rate_each_step() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, OptimizerConfig(lr=0.1))
    scheduler = build_lr_scheduler(optimizer, LRScheduleConfig(decay="linear", warmup_steps=2, total_steps=4))
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.05, 0.0])
    # The schedule is a closure: the state dict holds the step count, not the config.
    assert scheduler.state_dict()["lr_lambdas"] == [None, None]  # one per parameter group


def test_schedule_config_errors() -> None:
    with pytest.raises(ValidationError, match="total_steps"):
        LRScheduleConfig(decay="cosine")
    with pytest.raises(ValidationError, match="must exceed warmup_steps"):
        LRScheduleConfig(decay="linear", warmup_steps=5, total_steps=5)
    with pytest.raises(ValidationError, match="min_lr_ratio"):
        LRScheduleConfig(min_lr_ratio=1.5)
    with pytest.raises(ValidationError, match="lr"):
        OptimizerConfig(lr=0)


def test_weight_decay_applies_to_matrices_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1, betas=(0.8, 0.95)))
    decayed, others = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 3])]
    assert decayed["weight_decay"] == 0.1 and others["weight_decay"] == 0.0
    assert len(others["params"]) == 3  # the linear bias, the norm's weight and bias
    assert decayed["betas"] == (0.8, 0.95)


def test_clip_grad_norm_scales_to_the_max_norm_and_returns_the_norm_before() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.8]))
    # Under the max: untouched.
    assert clip_grad_norm_([a, b], max_norm=10.0).item() == pytest.approx(1.0)
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.8]))


def test_clip_grad_norm_leaves_non_finite_gradients_to_the_caller() -> None:
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, float("inf")])
    assert not torch.isfinite(clip_grad_norm_([a], max_norm=1.0))
    assert a.grad[0].item() == 1.0
