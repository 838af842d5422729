"""Configuration of the orchestrator (flags > PRIMERL_ORCHESTRATOR_* > TOML > defaults)."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings
from primerl_common.lora import adapter_name_problem
from primerl_orchestrator.environments import EXTERNAL, ProcessEnvironment, environment_class, environment_kinds
from primerl_orchestrator.tool_calls import FORMATS

__all__ = [
    "AdvantageConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "EvalSampling",
    "ModelConfig",
    "OrchestratorConfig",
    "OutputConfig",
    "PeersConfig",
    "RunConfig",
    "SamplingDefaults",
    "TensorBoardConfig",
    "TrackingConfig",
    "WandbConfig",
]


class PeersConfig(Section):
    router: str = Field(default="localhost:50054", description="host:port of the router (router.v1 Generate)")
    trainer: str = Field(default="localhost:50052", description="host:port of the trainer (trainer.v1 PushBatch)")
    run_id: str = Field(
        default="",
        description="the run this orchestrator feeds on a trainer with runs (trainer.v1 CreateRun): every trainer "
        "call names it, and its LoRA adapter (named by the run id) is what turns are generated with and whose "
        "versions are the policy versions; empty: a trainer of one run",
    )
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
    kv_cache_pool: str | None = Field(
        default=None,
        description="host:port of the KV pool's kvstore (metadata role) the replicas use: the orchestrator removes "
        "the namespace of a policy version once no replica serves it and no turn in flight may use it; unset: "
        "none is removed (old versions leave the pool only by eviction)",
    )
    kv_cache_pool_model: str = Field(
        default="", description="the model name the replicas' [kv_cache_pool] sections give ('' : every model)"
    )
    kv_namespace_sweep_s: float = Field(default=5.0, gt=0, description="how often namespaces are checked for removal")

    @field_validator("run_id")
    @classmethod
    def _run_id_names_an_adapter(cls, run_id: str) -> str:
        # The run id names the run's adapter on the replicas (primerl_common.lora.check_adapter_name).
        if run_id and (problem := adapter_name_problem(run_id)) is not None:
            raise ValueError(problem)
        return run_id


class ModelConfig(Section):
    path: pathlib.Path = Field(description="model folder with the tokenizer and its chat template (config.json)")
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="prompt + completion tokens of one turn, as the inference engines are set up; "
        "unset: max_position_embeddings of config.json",
    )
    tool_call_format: str = Field(
        default="auto",
        description="how the model writes tool calls, parsed from its answers when a turn offers tools: 'auto' "
        "(the format its chat template writes; a template that takes no tools gets the text fallback, the "
        f"tools described in the system message and calls in the hermes layout) or one of: {', '.join(FORMATS)}",
    )
    image_uri_roots: list[pathlib.Path] = Field(
        default=[],
        description="folders whose images a chat message may name by a file:// URI (vision-language models); "
        "empty: only images sent as bytes or data: URIs",
    )
    lora_adapter: str = Field(
        default="",
        description="the LoRA adapter the run trains (the trainer's publish.adapter_name, publish.kind 'adapter'): "
        "every turn is generated with it and policy versions are its versions; empty: the base model's whole "
        "weights (the trainer must publish those), or with peers.run_id set the run's adapter (the run id, the "
        "only other value allowed then)",
    )

    @field_validator("tool_call_format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        if name != "auto" and name not in FORMATS:
            raise ValueError(f"unknown tool-call format {name!r}; known: auto, {', '.join(FORMATS)}")
        return name

    @field_validator("lora_adapter")
    @classmethod
    def _adapter_name(cls, name: str) -> str:
        if name and (problem := adapter_name_problem(name)) is not None:
            raise ValueError(problem)
        return name

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
        description="'external' (played by a program through the API that the user runs), or a kind the "
        "orchestrator knows: one it plays itself (built in) or one played by a program of its own that it runs "
        f"(verifiers); known: {', '.join(environment_kinds())}",
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
    max_episodes_per_caller: int | None = Field(
        default=None,
        ge=1,
        description="episodes one environment caller (its identity, or its address without mTLS) may hold "
        "started and not finished, counting those it waits for; past it NextEpisode/StartEpisode answer "
        "RESOURCE_EXHAUSTED with a retry hint; unset: max_concurrent_episodes alone bounds them",
    )
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
    samples_dir: pathlib.Path | None = Field(
        default=None,
        description="each step's rollouts as text (prompt, completion, reward, advantage, versions), "
        "step_<n>.jsonl, what `primerl samples` shows; unset: off",
    )
    evals_jsonl: pathlib.Path | None = Field(
        default=None,
        description="one JSON line per finished evaluation; unset: evals.jsonl beside metrics_jsonl (if set)",
    )

    @property
    def evals_path(self) -> pathlib.Path | None:
        if self.evals_jsonl is not None:
            return self.evals_jsonl
        return self.metrics_jsonl.with_name("evals.jsonl") if self.metrics_jsonl is not None else None


class EvalSampling(Section):
    """Overrides of the evaluated environment's sampling (unset: the environment's own)."""

    temperature: float | None = Field(default=None, gt=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)

    def over(self, defaults: SamplingDefaults) -> SamplingDefaults:
        return defaults.model_copy(update=self.model_dump(exclude_none=True))


class EvalConfig(Section):
    """An evaluation run on the current policy every `interval_steps` policy versions, never trained on.

    Its tasks are the first `num_tasks` of the environment's task stream under `seed` (the same
    tasks each time, so that versions compare); each is sampled `num_samples` times (the n of
    pass@k)."""

    name: str = Field(min_length=1, description="unique; the metrics call it eval/<name>/...")
    environment: str | None = Field(
        default=None, description="an [[environments]] name: its kind, options and sampling (unset: `kind`)"
    )
    kind: str | None = Field(
        default=None, description="a built-in environment kind evaluated without training on it (unset: `environment`)"
    )
    options: dict[str, Any] = Field(
        default={},
        description="options of `kind`, or overrides of the named environment's options (of an environment "
        "played by its own process, only those of its task stream, e.g. verifiers' split)",
    )
    sampling: EvalSampling = EvalSampling()
    num_tasks: int = Field(default=32, ge=1, description="tasks per evaluation")
    num_samples: int = Field(default=1, ge=1, description="samples per task (the n of pass@k)")
    pass_at_k: list[int] = Field(
        default=[], description="the k reported as pass@k (each <= num_samples); empty: 1 and num_samples"
    )
    pass_threshold: float = Field(default=1.0, description="a sample with a reward >= this passes")
    interval_steps: int = Field(default=10, ge=1, description="every this many policy versions")
    at_start: bool = Field(default=True, description="also evaluate the initial policy (version 0)")
    seed: int | None = Field(
        default=None, description="seed of the evaluated task stream; unset: run.seed + 1000 (apart from training's)"
    )
    max_concurrent: int = Field(
        default=8, ge=1, description="eval episodes in flight, started only while training cannot start a group"
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if (self.environment is None) == (self.kind is None):
            raise ValueError(f"eval {self.name!r}: set one of environment (a configured one) or kind")
        if self.kind is not None:
            if self.kind == EXTERNAL:
                raise ValueError(f"eval {self.name!r}: an external environment has nobody to play its evaluations")
            if issubclass(environment_class(self.kind), ProcessEnvironment):
                raise ValueError(
                    f"eval {self.name!r}: environments of kind {self.kind!r} are played by their process: name a "
                    "configured one (environment = ...), whose process plays its evaluations too"
                )
        too_large = [k for k in self.pass_at_k if not 1 <= k <= self.num_samples]
        if too_large:
            raise ValueError(f"eval {self.name!r}: pass_at_k {too_large} not in [1, num_samples {self.num_samples}]")
        return self

    @property
    def ks(self) -> list[int]:
        return sorted(set(self.pass_at_k or [1, self.num_samples]))


class WandbConfig(Section):
    enabled: bool = Field(default=False, description="log to Weights & Biases (needs primerl-orchestrator[tracking])")
    mode: str = Field(
        default="offline", pattern="^(offline|online)$", description="offline: a local run folder (`wandb sync` later)"
    )
    project: str = Field(default="primerl", min_length=1)
    entity: str | None = None
    name: str | None = Field(default=None, description="the run's name; unset: W&B picks one")
    group: str | None = None
    tags: list[str] = []
    dir: pathlib.Path | None = Field(
        default=None, description="where the wandb/ folder goes; unset: beside metrics_jsonl"
    )


class TensorBoardConfig(Section):
    enabled: bool = Field(
        default=False, description="write TensorBoard event files (needs primerl-orchestrator[tracking])"
    )
    log_dir: pathlib.Path | None = Field(default=None, description="unset: tensorboard/ beside metrics_jsonl")


class TrackingConfig(Section):
    """Experiment trackers, beside metrics.jsonl: each step's metrics, the trainer's step metrics,
    eval results, the config and a table of sample rollouts."""

    wandb: WandbConfig = WandbConfig()
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    num_sample_rows: int = Field(default=8, ge=0, description="rollouts per step in the samples table (0: none)")
    sample_interval_steps: int = Field(default=1, ge=1, description="log the samples table every this many steps")
    trainer_metrics: bool = Field(default=True, description="also log the trainer's step metrics (WatchSteps)")
    config_dir: pathlib.Path | None = Field(
        default=None, description="a folder of the run's other service configs (*.toml) logged with this one"
    )

    @model_validator(mode="after")
    def _installed(self) -> TrackingConfig:
        for name, enabled in (("wandb", self.wandb.enabled), ("tensorboard", self.tensorboard.enabled)):
            if enabled and importlib.util.find_spec(name) is None:
                raise ValueError(
                    f"tracking.{name}.enabled needs the {name} package: pip install 'primerl-orchestrator[tracking]'"
                )
        return self

    @property
    def enabled(self) -> bool:
        return self.wandb.enabled or self.tensorboard.enabled


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
    evals: list[EvalConfig] = Field(
        default=[],
        description="held-out evaluations ([[evals]]: name, environment or kind, num_tasks, num_samples, "
        "pass_at_k, interval_steps, sampling; see EvalConfig)",
    )
    tracking: TrackingConfig = TrackingConfig()

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
        run_id, adapter = self.peers.run_id, self.model.lora_adapter
        if run_id and adapter and adapter != run_id:
            raise ValueError(
                f"model.lora_adapter {adapter!r} is not peers.run_id {run_id!r}: a run on a trainer with runs "
                "trains the adapter named by its run id; leave model.lora_adapter unset or set it to the run id"
            )
        self._check_evals(names)
        if self.output.metrics_jsonl is None:
            if self.tracking.wandb.enabled and self.tracking.wandb.dir is None:
                raise ValueError("tracking.wandb.dir is unset and so is output.metrics_jsonl (its default's folder)")
            if self.tracking.tensorboard.enabled and self.tracking.tensorboard.log_dir is None:
                raise ValueError(
                    "tracking.tensorboard.log_dir is unset and so is output.metrics_jsonl (its default's folder)"
                )
        return self

    @property
    def lora_adapter(self) -> str:
        """The LoRA adapter every turn is generated with, whose published versions are the policy
        versions: the run's (named by peers.run_id) on a trainer with runs, else model.lora_adapter
        ('' : the base model's whole weights)."""
        return self.peers.run_id or self.model.lora_adapter

    def _check_evals(self, environments: list[str]) -> None:
        names = [e.name for e in self.evals]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"evals: duplicate name {', '.join(duplicates)}")
        by_name = {env.name: env for env in self.environments}
        for evaluation in self.evals:
            if evaluation.environment is None:
                continue
            env = by_name.get(evaluation.environment)
            if env is None:
                raise ValueError(
                    f"eval {evaluation.name!r}: no environment {evaluation.environment!r}; "
                    f"configured: {', '.join(environments)}"
                )
            if not env.builtin:
                raise ValueError(
                    f"eval {evaluation.name!r}: environment {env.name!r} is external: nobody plays its evaluations"
                )
            cls = environment_class(env.kind)
            if issubclass(cls, ProcessEnvironment):
                fixed = sorted(set(evaluation.options) - cls.eval_options)
                if fixed:
                    raise ValueError(
                        f"eval {evaluation.name!r}: options {', '.join(fixed)} of environment {env.name!r} are its "
                        f"process's, the same for its evaluations; an eval may set only "
                        f"{', '.join(sorted(cls.eval_options)) or 'none'}"
                    )
        for evaluation in self.evals:
            try:
                self.eval_environment(evaluation)
            except ValidationError as exc:
                errors = "; ".join(e["msg"] for e in exc.errors())
                raise ValueError(f"eval {evaluation.name!r}: {errors}") from None

    def eval_environment(self, evaluation: EvalConfig) -> EnvironmentConfig:
        """The environment `evaluation` plays: the named one with its overrides, or one of its kind."""
        if evaluation.environment is not None:
            base = next(env for env in self.environments if env.name == evaluation.environment)
            fields = base.model_dump() | {
                "options": {**base.options, **evaluation.options},
                "sampling": evaluation.sampling.over(base.sampling).model_dump(),
            }
        else:
            fields = {
                "name": evaluation.name,
                "kind": evaluation.kind,
                "options": evaluation.options,
                "sampling": evaluation.sampling.over(SamplingDefaults()).model_dump(),
            }
        return EnvironmentConfig.model_validate(fields)
