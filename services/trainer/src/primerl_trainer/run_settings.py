"""A run's settings (trainer.v1 RunSpec), how they make its RunConfig over the trainer's own
settings, and the run as trainer.v1's Run shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from primerl_common.config import Section
from primerl_common.errors import InvalidArgument, ResourceExhausted
from primerl_trainer.batch import TrainingMode
from primerl_trainer.config import TrainerConfig
from primerl_trainer.runs import RunConfig

__all__ = ["RunSettings", "RunState", "RunView", "run_config"]

RunState = Literal["active", "paused", "failed"]


@dataclass(frozen=True)
class RunSettings:
    """What a run trains with (trainer.v1 RunSpec); None: the trainer's setting."""

    lora_rank: int
    lora_alpha: float = 0.0
    seed: int = 0
    mode: TrainingMode = "rl"
    learning_rate: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    warmup_steps: int | None = None

    @property
    def alpha(self) -> float:
        return self.lora_alpha or 2.0 * self.lora_rank


@dataclass(frozen=True)
class RunView:
    """A run as trainer.v1's Run shows it."""

    run_id: str
    owner: str
    settings: RunSettings
    state: RunState
    step: int
    next_step: int
    num_queued_batches: int
    published_version: int
    last_checkpoint_step: int
    error: str
    created_at: float


def run_config(settings: RunSettings, config: TrainerConfig, owner: str, *, quota: bool = True) -> RunConfig:
    """The run's RunConfig from its settings and the trainer's `config`; refusals name the
    RunSpec field. `quota`: check the owner's rank quota (not for a run restored from its checkpoint: the
    quota it was created under may have been lowered since)."""
    max_rank = config.lora.rank
    if not 0 < settings.lora_rank <= max_rank:
        raise InvalidArgument(
            f"must be in [1, {max_rank}] (the trainer's lora.rank), got {settings.lora_rank}",
            field="spec.lora_rank",
        )
    limits, where = config.runs.quota_of(owner)
    if quota and settings.lora_rank > limits.max_lora_rank:
        raise ResourceExhausted(
            f"rank {settings.lora_rank} is above {owner}'s quota ({where}.max_lora_rank = {limits.max_lora_rank})",
            reason="QUOTA_EXCEEDED",
            metadata={"quota": f"{where}.max_lora_rank"},
        )
    if settings.lora_alpha < 0:
        raise InvalidArgument(
            f"must be positive (0: twice the rank), got {settings.lora_alpha}", field="spec.lora_alpha"
        )
    if settings.mode not in ("rl", "sft"):
        raise InvalidArgument("must be TRAINING_MODE_RL or TRAINING_MODE_SFT", field="spec.mode")
    optimizer = _validated(
        config.optimizer,
        {
            "lr": settings.learning_rate,
            "weight_decay": settings.weight_decay,
            "max_grad_norm": settings.max_grad_norm,
        },
    )
    schedule = _validated(config.schedule, {"warmup_steps": settings.warmup_steps})
    return RunConfig(
        rank=settings.lora_rank,
        alpha=settings.alpha,
        seed=settings.seed,
        optimizer=optimizer,
        schedule=schedule,
        mode=settings.mode,
        loss=config.loss,
    )


_SPEC_FIELDS = {"lr": "learning_rate"}


def _validated(base: Section, overrides: dict[str, Any]) -> Any:
    """`base` with the run's overrides (None: kept), validated; InvalidArgument names the
    RunSpec field at fault."""
    updates = {name: value for name, value in overrides.items() if value is not None}
    try:
        return type(base).model_validate(base.model_dump() | updates)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else next(iter(updates), "")
        raise InvalidArgument(str(error["msg"]), field=f"spec.{_SPEC_FIELDS.get(name, name)}") from None
