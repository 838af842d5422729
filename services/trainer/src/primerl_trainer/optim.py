"""AdamW, the learning-rate schedule and gradient clipping (plain and FSDP2-sharded parameters alike)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch.distributed.tensor import DTensor

from primerl_common.config import Section

__all__ = [
    "LRScheduleConfig",
    "OptimizerConfig",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_",
    "lr_factor",
]


class OptimizerConfig(Section):
    lr: float = Field(default=1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0, description="applied to matrices only, not to norms or biases")
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradients are clipped to this global L2 norm")


class LRScheduleConfig(Section):
    """Linear warmup from lr / warmup_steps to lr, then constant or a decay to min_lr_ratio * lr at total_steps."""

    decay: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, gt=0, description="required by the linear and cosine decays")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _check_total_steps(self) -> LRScheduleConfig:
        if self.decay != "constant":
            if self.total_steps is None:
                raise ValueError(f"decay {self.decay!r} needs total_steps")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(f"total_steps {self.total_steps} must exceed warmup_steps {self.warmup_steps}")
        return self


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices (ndim >= 2) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed, "weight_decay": config.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [group for group in groups if group["params"]], lr=config.lr, betas=config.betas, eps=config.eps
    )


def lr_factor(step: int, config: LRScheduleConfig) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay == "constant":
        return 1.0
    assert config.total_steps is not None
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    shape = 1.0 - progress if config.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step.

    The schedule is a closure, not an object: LambdaLR's state dict then saves only the step
    count, so a resumed run follows the schedule of its (possibly edited) config.
    """

    def factor(step: int) -> float:
        return lr_factor(step, config)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm; return the norm before clipping (a plain 0-d tensor).

    With FSDP2 the gradients are shards (DTensors) and their norm is a DTensor: `full_tensor()`
    reduces it across ranks so every rank clips by the same global norm. A non-finite norm is
    returned as is (the caller skips the update) and the gradients are left untouched.
    """
    params = [p for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    # A device-to-host sync, needed anyway: the norm is a metric of every step.
    if torch.isfinite(total_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
