"""Configuration of the orchestrator (flags > PRIMERL_ORCHESTRATOR_* > TOML > defaults)."""

from __future__ import annotations

import pathlib
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings
from primerl_orchestrator.environments import EXTERNAL, environment_class

__all__ = [
    "AdvantageConfig",
    "EnvironmentConfig",
    "ModelConfig",
    "OrchestratorConfig",
    "OutputConfig",
    "PeersConfig",
    "RunConfig",
    "SamplingDefaults",
]


class PeersConfig(Section):
    router: str = Field(default="localhost:50054", description="host:port of the router (router.v1 Generate)")
    trainer: str = Field(default="localhost:50052", description="host:port of the trainer (trainer.v1 PushBatch)")
    weight_broadcaster: str | None = Field(
        default=None,
        description="host:port of the weight broadcaster, whose published versions open dispatch; unset: the "
        "trainer's completed steps are taken as the published versions (nothing checks that inference serves them)",
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        description="with a weight broadcaster: a version counts once this many replicas serve it (0: once published)",
    )
    generate_timeout_s: float = Field(default=600.0, gt=0, description="deadline of one model turn")
    router_retry_s: float = Field(
        default=60.0,
        ge=0,
        description="how long a model turn is tried again while the router is unavailable (e.g. restarting)",
    )
    poll_interval_s: float = Field(default=0.5, gt=0, description="how often the trainer's status is polled")


class ModelConfig(Section):
    path: pathlib.Path = Field(description="model folder with the tokenizer and its chat template (config.json)")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="prompt + completion tokens of one turn, as the inference engines are set up; "
        "unset: max_position_embeddings of config.json",
    )

    @field_validator("path")
    @classmethod
    def _has_a_tokenizer(cls, path: pathlib.Path) -> pathlib.Path:
        if not (path / "tokenizer_config.json").is_file():
            raise ValueError(f"{path} holds no tokenizer (tokenizer_config.json)")
        return path


class SamplingDefaults(Section):
    """Sampling of the environment's turns; a Generate call may override each field."""

    temperature: float = Field(
        default=1.0, gt=0, le=2, description="in (0, 2] (vLLM's range): the trainer divides its logits by it"
    )
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="0: no top-k filtering")
    max_tokens: int = Field(default=256, ge=1, description="new tokens per turn (capped by the context)")


class EnvironmentConfig(Section):
    name: str = Field(min_length=1, description="unique; what NextEpisode and the metrics call it")
    kind: str = Field(
        default=EXTERNAL,
        description="'external' (played by a program through the API) or a built-in environment, which "
        "the orchestrator plays itself: reverse_text, sort_letters",
    )
    weight: float = Field(default=1.0, gt=0, description="relative share of the episodes started")
    group_size: int = Field(default=8, ge=1, description="episodes per task; advantages are computed per group")
    sampling: SamplingDefaults = SamplingDefaults()
    tasks_file: pathlib.Path | None = Field(
        default=None,
        description='external environments: JSONL of {"task_id": str, "data": {...}}, the task stream '
        "NextEpisode hands out in order (cycling); unset: the environment brings its tasks (StartEpisode)",
    )
    # The built-in environment's own settings (see its Options).
    options: dict[str, Any] = {}

    @model_validator(mode="after")
    def _check_kind(self) -> EnvironmentConfig:
        if self.kind == EXTERNAL:
            if self.options:
                raise ValueError(f"environment {self.name!r}: options are for built-in environments")
            if self.tasks_file is not None and not self.tasks_file.is_file():
                raise ValueError(f"environment {self.name!r}: tasks_file {self.tasks_file} does not exist")
            return self
        cls = environment_class(self.kind)  # ValueError naming the known kinds
        if self.tasks_file is not None:
            raise ValueError(f"environment {self.name!r}: a built-in environment makes its own tasks (no tasks_file)")
        try:
            cls.Options.model_validate(self.options)
        except ValidationError as exc:
            fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"options of environment {self.name!r} ({self.kind}): {fields}") from None
        return self

    @property
    def builtin(self) -> bool:
        return self.kind != EXTERNAL


class RunConfig(Section):
    max_steps: int = Field(default=100, ge=1, description="trainer steps to feed; the run finishes after the last")
    batch_size: int = Field(
        default=64, ge=1, description="rollouts (episodes) per step; whole groups are taken until it is reached"
    )
    max_async_level: int = Field(
        default=1,
        ge=1,
        description="a group collected for step n starts only once policy version >= n - max_async_level",
    )
    max_off_policy_steps: int = Field(
        default=8,
        ge=1,
        description="a rollout goes into step n's batch only if its oldest token's version >= n - max_off_policy_steps",
    )
    max_concurrent_episodes: int = Field(default=64, ge=1, description="episodes started and not yet finished")
    episode_timeout_s: float = Field(
        default=1800.0, gt=0, description="an episode not finished this long after its start is dropped"
    )
    seed: int = Field(default=0, description="seed of the built-in environments' tasks")


class AdvantageConfig(Section):
    std_normalize: bool = Field(default=False, description="divide by the group's reward std")
    filter_zero_advantage: bool = Field(default=True, description="drop groups whose rewards are all equal")


class OutputConfig(Section):
    metrics_jsonl: pathlib.Path | None = Field(default=None, description="one JSON line of metrics per step")
    checkpoint_dir: pathlib.Path | None = Field(
        default=None, description="orchestrator checkpoint (resumed from when present); unset: no checkpoint"
    )
    batches_dir: pathlib.Path | None = Field(
        default=None, description="debugging: each batch pushed, as step_<n>.safetensors; unset: off"
    )


class OrchestratorConfig(ServiceConfig):
    """primerl orchestrator: the RL loop and the API environments call: tasks, episodes, rewards,
    advantages, staleness control, batches to the trainer.
    """

    service_name = "orchestrator"
    model_config = service_settings("orchestrator")

    server: ServerConfig = ServerConfig(port=50051)
    peers: PeersConfig = PeersConfig()
    model: ModelConfig
    environments: list[EnvironmentConfig] = Field(min_length=1)
    run: RunConfig = RunConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _check_combinations(self) -> OrchestratorConfig:
        names = [env.name for env in self.environments]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"environments: duplicate name {', '.join(duplicates)}")
        largest = max(env.group_size for env in self.environments)
        if largest > self.run.max_concurrent_episodes:
            raise ValueError(
                f"run.max_concurrent_episodes {self.run.max_concurrent_episodes} is below the largest group_size "
                f"{largest}: that group could never start"
            )
        if self.run.max_off_policy_steps < self.run.max_async_level:
            raise ValueError(
                f"run.max_off_policy_steps {self.run.max_off_policy_steps} < run.max_async_level "
                f"{self.run.max_async_level}: rollouts started at the allowed lag would be dropped"
            )
        return self
