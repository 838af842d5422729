"""The value types and sections of the trainer's config that belong to modules importing torch.

They live here, torch-free, so that `primerl-trainer --check-config` (and `primerl-trainer plan`)
validate a config in well under a second: config.py imports only this module, and the modules
that use these types (batch, losses, optim, process_group, models) import them from here.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from primerl_common.config import Section

__all__ = [
    "ATTENTION_BACKENDS",
    "EXPERTS_IMPLS",
    "IMPLS",
    "AttentionBackend",
    "DeviceType",
    "ExpertsImpl",
    "Impl",
    "LRScheduleConfig",
    "OptimizerConfig",
    "RLLossConfig",
    "TrainingMode",
]

TrainingMode = Literal["rl", "sft"]
DeviceType = Literal["auto", "cpu", "cuda"]
# "custom": the own implementation, "hf": transformers', "auto": own where registered.
Impl = Literal["auto", "custom", "hf"]
IMPLS: tuple[str, ...] = get_args(Impl)
AttentionBackend = Literal["sdpa", "flex"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
ExpertsImpl = Literal["auto", "grouped_mm", "loop"]
EXPERTS_IMPLS: tuple[str, ...] = get_args(ExpertsImpl)


class RLLossConfig(Section):
    """The default RL loss (prime-rl's "DPPO + KL") and its symmetric-mask variant.

    Per loss token, with p and q the trainer's and the inference engine's probabilities of the
    token, r = p / q and A the advantage: loss = -A * r over the tokens the trust region keeps
    + kl_coef * (log p - log q)^2 over all loss tokens. The trust region drops a token when
    p - q > mask_high or p - q < -mask_low; with mask="advantage_sign" only in the direction the
    advantage pushes p (A > 0 and up, A < 0 and down), with "symmetric" either way (IPO-style).
    """

    mask: Literal["advantage_sign", "symmetric"] = "advantage_sign"
    mask_high: float = Field(default=0.2, ge=0, description="mask tokens whose p - q exceeds this")
    mask_low: float = Field(default=0.2, ge=0, description="mask tokens whose p - q is below minus this")
    kl_coef: float = Field(default=1e-3, ge=0, description="weight of (log p - log q)^2")


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
