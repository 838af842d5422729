"""The launch file: one TOML with a table per service ([orchestrator], [trainer],
[inference] or [[inference]], [router], [weight_broadcaster], [kvstore]), each holding
that service's own config, plus [launcher], an optional [warm_start] and an optional
[inference.deployment] (the shape of the inference fleet: primerl_launcher.deployment), and
an optional array [[runs]]: many LoRA runs on one trainer, each created by the launcher and fed
by its own orchestrator (the file's [orchestrator] is then the template of theirs).

Only the launcher's own tables are validated here; each service table is validated by
the service itself (`--check-config`) once the launcher has filled in what links them.
"""

from __future__ import annotations

import copy
import pathlib
import tomllib
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from primerl.trainer.v1 import trainer_pb2
from primerl_common.config import is_loopback
from primerl_common.lora import adapter_name_problem
from primerl_launcher.deployment import DeploymentConfig, apply_settings, replica_settings, router_settings

__all__ = [
    "SERVICES",
    "LaunchConfigError",
    "LaunchFile",
    "LauncherConfig",
    "RunLaunch",
    "ServiceSpec",
    "WarmStartConfig",
    "deep_merge",
    "parse_launch_file",
    "read_launch_file",
]

# In start order: the orchestrator drives the run and needs the others up.
SERVICES = ("kvstore", "inference", "weight_broadcaster", "router", "trainer", "orchestrator")
# Launcher model name -> primerl_launcher.tiny_model family.
TINY_MODELS = {"tiny-dense": "qwen3", "tiny-moe": "qwen3-moe", "tiny-vl": "qwen3-vl", "tiny-vl-moe": "qwen3-vl-moe"}


class LaunchConfigError(ValueError):
    """A launch file that cannot be used; the message names the table and the field."""


class LauncherConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None,
        description="'tiny-dense', 'tiny-moe', 'tiny-vl' or 'tiny-vl-moe' (made locally, cached; the -vl ones "
        "take images) or a Hugging Face model folder; "
        "filled into every service that needs a model and does not name one",
    )
    tiny_model: dict[str, Any] = Field(
        default={}, description="make_tiny_model arguments (seed, dtype) and the family's TinyModelSpec fields"
    )
    run_dir: pathlib.Path | None = Field(default=None, description="unset: runs/<date-time>")
    cache_dir: pathlib.Path = Field(default=pathlib.Path(".cache/primerl"), description="where tiny models are kept")
    host: str = Field(default="127.0.0.1", description="interface the services listen on, unless they say")
    tls: Literal["plaintext", "mtls"] = Field(
        default="plaintext",
        validate_default=True,
        description="mtls: a development CA and one certificate per service are made in <run_dir>/certs, every "
        "service gets its [tls] table and the launcher calls them as an operator; plaintext (loopback hosts only): "
        "the local demo, no identities",
    )
    inference_replicas: int = Field(
        default=1, ge=1, description="copies of a single [inference] table; [inference.deployment] says it better"
    )
    check_config: bool = Field(
        default=True,
        description="validate every service's config, and the trainer/inference dtype rule, before starting any",
    )
    allow_dtype_mismatch: bool = Field(
        default=False,
        description="start inference in a dtype other than the trainer's model.compute_dtype (mismatch_kl > 0)",
    )
    start_timeout_s: float = Field(default=300.0, gt=0, description="per service, until it is SERVING")
    finish_timeout_s: float = Field(
        default=300.0, gt=0, description="after the last batch: until it is trained and served by every replica"
    )
    stop_grace_s: float = Field(default=30.0, gt=0, description="after SIGTERM, before SIGKILL")
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="times each service is started again after it dies while the run goes on (on the same address, "
        "config and state folders); one more death stops the run; 0: the first death stops it",
    )
    restart_backoff_s: float = Field(
        default=1.0, gt=0, description="wait before a service's first restart; doubled at each of its next ones"
    )
    restart_backoff_max_s: float = Field(default=30.0, gt=0, description="the longest wait before a restart")
    poll_interval_s: float = Field(default=1.0, gt=0, description="progress refresh")
    log_tail_lines: int = Field(default=30, ge=1, description="lines of a dead service's log to show")
    env: dict[str, str] = Field(default={}, description="extra environment variables of every service")

    @field_validator("tls")
    @classmethod
    def _plaintext_on_loopback_only(cls, value: str, info: ValidationInfo) -> str:
        host = info.data.get("host")
        if value == "plaintext" and host is not None and not is_loopback(host):
            raise ValueError(f'plaintext is allowed only on a loopback host, not {host!r}: set tls = "mtls"')
        return value

    @field_validator("restart_backoff_max_s")
    @classmethod
    def _backoff_max_not_below_first(cls, value: float, info: ValidationInfo) -> float:
        first = info.data.get("restart_backoff_s")
        if first is not None and value < first:
            raise ValueError(f"must be at least restart_backoff_s ({first}), got {value}")
        return value


class WarmStartConfig(BaseModel):
    """SFT before RL: data from an environment's tasks and answers, then the trainer in SFT mode."""

    model_config = ConfigDict(extra="forbid")

    environment: str | None = Field(default=None, description="an [[orchestrator.environments]] name; unset: the first")
    num_samples: int = Field(default=512, ge=1)
    timeout_s: float = Field(default=3600.0, gt=0, description="the whole SFT phase")
    trainer: dict[str, Any] = Field(default={}, description="overrides of [trainer] for the SFT job")


@dataclass
class ServiceSpec:
    """One process to run: `name` is unique (inference-0, inference-1, ...), `service`
    the kind (its module is primerl_<service>), `table` its config."""

    name: str
    service: str
    table: dict[str, Any]
    where: str  # how the launch file calls this table, for error messages

    @property
    def module(self) -> str:
        return f"primerl_{self.service}"


@dataclass
class RunLaunch:
    """One [[runs]] table: a run the launcher creates on the trainer (CreateRun, as the operator,
    for `owner`) and feeds with its own orchestrator (`orchestrator`: the file's [orchestrator]
    with the run's own table laid over it)."""

    id: str
    owner: str | None
    spec: trainer_pb2.RunSpec
    orchestrator: dict[str, Any]
    where: str  # "[[runs]] #<i>", for error messages

    @property
    def max_steps(self) -> int:
        return int(self.orchestrator["run"]["max_steps"])


@dataclass
class LaunchFile:
    launcher: LauncherConfig
    warm_start: WarmStartConfig | None
    services: dict[str, ServiceSpec]
    path: pathlib.Path | None = None
    # The inference fleet's shape; None when [[inference]] lists the replicas one by one.
    deployment: DeploymentConfig | None = None
    # Tables the file leaves out that the run needs, started with their defaults (said at start).
    added: list[str] = field(default_factory=list)
    # [[runs]]: the trainer's runs, each with its own orchestrator (then no [orchestrator] service).
    runs: list[RunLaunch] = field(default_factory=list)


def read_launch_file(path: pathlib.Path) -> LaunchFile:
    if not path.is_file():
        raise LaunchConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LaunchConfigError(f"config file {path} is not valid TOML: {exc}") from None
    launch = parse_launch_file(data)
    launch.path = path
    return launch


def parse_launch_file(data: dict[str, Any]) -> LaunchFile:
    data = copy.deepcopy(data)
    known = {*SERVICES, "launcher", "warm_start", "runs"}
    for key, value in data.items():
        if key not in known:
            raise LaunchConfigError(f"[{key}]: unknown table; known: {', '.join(sorted(known))}")
        if key not in ("inference", "runs") and not isinstance(value, dict):
            raise LaunchConfigError(f"{key}: must be a table ([{key}])")
    launcher = _model(LauncherConfig, data.pop("launcher", {}), "launcher")
    warm_start = _model(WarmStartConfig, data.pop("warm_start"), "warm_start") if "warm_start" in data else None
    if warm_start is not None and "trainer" not in data:
        raise LaunchConfigError("[warm_start] needs a [trainer] table (the SFT job is the trainer in SFT mode)")
    if warm_start is not None and "orchestrator" not in data:
        raise LaunchConfigError("[warm_start] needs an [orchestrator] table (its environments make the data)")
    if not any(service in data for service in SERVICES):
        raise LaunchConfigError(f"no service table; add some of: {', '.join(f'[{s}]' for s in SERVICES)}")
    deployment = _deployment(data, launcher)
    runs = _runs(data, launcher, warm_start) if "runs" in data else []
    added = _add_needed_tables(data, launcher, deployment)
    if runs:
        # The template of the runs' orchestrators, not a service of its own.
        data.pop("orchestrator")
    if deployment is not None:
        added += _apply_deployment(data, deployment)
    elif "inference" in data and not isinstance(data["inference"], list):
        deployment = DeploymentConfig.from_replicas(launcher.inference_replicas)
    services: dict[str, ServiceSpec] = {}
    for service in SERVICES:
        if service not in data:
            continue
        if service == "inference":
            services.update(_inference_replicas(data["inference"], deployment))
        else:
            services[service] = ServiceSpec(service, service, data[service], f"[{service}]")
    if launcher.model is not None and launcher.model not in TINY_MODELS:
        model = pathlib.Path(launcher.model)
        if not (model / "config.json").is_file():
            raise LaunchConfigError(
                f"[launcher] model: {launcher.model!r} is neither a tiny model ({', '.join(TINY_MODELS)}) "
                "nor a model folder (no config.json)"
            )
    return LaunchFile(launcher, warm_start, services, added=added, deployment=deployment, runs=runs)


_RUN_KEYS = ("id", "owner", "spec", "orchestrator")


def _runs(data: dict[str, Any], launcher: LauncherConfig, warm_start: WarmStartConfig | None) -> list[RunLaunch]:
    """[[runs]], taken out of `data`; its [orchestrator] (set to {} if absent) stays there, for
    the tables an orchestrator needs to be added, and is then the runs' template."""
    tables = data.pop("runs")
    if not isinstance(tables, list) or not tables or not all(isinstance(table, dict) for table in tables):
        raise LaunchConfigError("runs: must be an array of tables ([[runs]]), at least one")
    if warm_start is not None:
        raise LaunchConfigError("[warm_start]: not with [[runs]] (the SFT warm start trains the whole model once)")
    _check_trainer_for_runs(data.get("trainer"), len(tables))
    template = data.setdefault("orchestrator", {})
    mtls = launcher.tls == "mtls"
    runs = [_run(table, f"[[runs]] #{index + 1}", template, mtls=mtls) for index, table in enumerate(tables)]
    seen: dict[str, str] = {}
    for run in runs:
        if run.id in seen:
            raise LaunchConfigError(f"{run.where} id: {run.id!r} is also the id of {seen[run.id]}")
        seen[run.id] = run.where
    return runs


def _check_trainer_for_runs(trainer: Any, num_runs: int) -> None:
    """The trainer that trains the runs: LoRA on, room for every run at once."""
    if not isinstance(trainer, dict):
        raise LaunchConfigError(
            "[[runs]] needs a [trainer] table with [trainer.lora] enabled = true and [trainer.runs] "
            "max_concurrent_runs (the runs are LoRA adapters on its backbone)"
        )
    runs = trainer.get("runs")
    max_runs = runs.get("max_concurrent_runs") if isinstance(runs, dict) else None
    if not isinstance(max_runs, int) or max_runs < num_runs:
        raise LaunchConfigError(
            f"[trainer] runs.max_concurrent_runs: must be at least the {num_runs} runs of [[runs]], got {max_runs}"
        )
    lora = trainer.get("lora")
    if not isinstance(lora, dict) or lora.get("enabled") is not True:
        raise LaunchConfigError("[trainer] lora.enabled: must be true with [[runs]] (each run trains its own adapter)")


def _run(table: dict[str, Any], where: str, template: dict[str, Any], *, mtls: bool) -> RunLaunch:
    """One [[runs]] table, checked; its orchestrator table laid over `template`."""
    for key in table:
        if key not in _RUN_KEYS:
            raise LaunchConfigError(f"{where} {key}: unknown key; known: {', '.join(_RUN_KEYS)}")
    run_id = table.get("id")
    if not isinstance(run_id, str):
        raise LaunchConfigError(f"{where} id: required, a string (the run's id, which names its adapter)")
    if (problem := adapter_name_problem(run_id)) is not None:
        raise LaunchConfigError(f"{where} id: {problem}")
    owner = table.get("owner")
    if owner is None and mtls:
        raise LaunchConfigError(
            f'{where} owner: required under [launcher] tls = "mtls" (the tenant the run belongs to: its '
            "orchestrator shows a certificate of that name)"
        )
    if owner is not None and (not isinstance(owner, str) or adapter_name_problem(owner) is not None):
        raise LaunchConfigError(f"{where} owner: {owner!r} is not a tenant name (1-64 of A-Z a-z 0-9 . _ -)")
    for key in ("spec", "orchestrator"):
        if not isinstance(table.get(key, {}), dict):
            raise LaunchConfigError(f"{where} {key}: must be a table")
    orchestrator = deep_merge(template, table.get("orchestrator", {}))
    if not _has(orchestrator, "run.max_steps"):
        raise LaunchConfigError(
            f"{where} orchestrator.run.max_steps: required, in the run's table or in [orchestrator] "
            "(the launcher follows each run to its last step)"
        )
    return RunLaunch(run_id, owner, _run_spec(table.get("spec", {}), where), orchestrator, where)


def _run_spec(table: dict[str, Any], where: str) -> trainer_pb2.RunSpec:
    """A trainer.v1 RunSpec from its fields (the proto's names; enums by name), field by field
    so that an error names the field."""
    spec = trainer_pb2.RunSpec()
    known = [field.name for field in spec.DESCRIPTOR.fields]
    for key, value in table.items():
        if key not in known:
            raise LaunchConfigError(
                f"{where} spec.{key}: unknown field of trainer.v1 RunSpec; known: {', '.join(known)}"
            )
        try:
            json_format.ParseDict({key: value}, spec)
        except json_format.ParseError as exc:
            raise LaunchConfigError(f"{where} spec.{key}: {exc}") from None
    return spec


def _is_set(data: dict[str, Any], table: str, dotted: str) -> bool:
    return _has(data.get(table, {}), dotted)


def _has(value: Any, dotted: str) -> bool:
    """Whether the table `value` sets `dotted` (e.g. "run.max_steps") to something."""
    for part in dotted.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return False
        value = value[part]
    return True


def _deployment(data: dict[str, Any], launcher: LauncherConfig) -> DeploymentConfig | None:
    """[inference.deployment], taken out of the [inference] table (the service does not know it)."""
    inference = data.get("inference")
    if isinstance(inference, list):
        for index, item in enumerate(inference):
            if isinstance(item, dict) and "deployment" in item:
                raise LaunchConfigError(
                    f"[[inference]] #{index + 1} deployment: the deployment section needs a single [inference] "
                    "table ([[inference]] lists the replicas one by one, each with its replica.role)"
                )
        return None
    if not isinstance(inference, dict) or "deployment" not in inference:
        return None
    deployment = _model(DeploymentConfig, inference.pop("deployment"), "inference.deployment")
    if "inference_replicas" in launcher.model_fields_set:
        raise LaunchConfigError(
            "[launcher] inference_replicas: not with [inference.deployment], which says how many replicas "
            "(replicas, or prefill and decode)"
        )
    return deployment


def _apply_deployment(data: dict[str, Any], deployment: DeploymentConfig) -> list[str]:
    """The shape's settings of the router and the tables the shape needs; returns what it added."""
    added = []
    if deployment.shape != "single" and "router" not in data and not _is_set(data, "orchestrator", "peers.router"):
        data["router"] = {}
        added.append(f"[router] (shape {deployment.shape}: the replicas are served through it)")
    outside_pool = _is_set(data, "inference", "kv_cache_pool.metadata_address")
    if deployment.pool_on and "kvstore" not in data and not outside_pool:
        data["kvstore"] = {}
        added.append("[kvstore] (the KV pool of [inference.deployment])")
    if deployment.disaggregate and "router" not in data:
        raise LaunchConfigError(
            "[inference.deployment] shape: disaggregated needs the run's [router], which splits each request "
            "(a router outside the run is configured there: routing.disaggregate)"
        )
    if "router" in data:
        try:
            apply_settings(data["router"], router_settings(deployment))
        except ValueError as exc:
            raise LaunchConfigError(f"[router] {exc} ([inference.deployment] shape = {deployment.shape!r})") from None
    return added


def _add_needed_tables(
    data: dict[str, Any], launcher: LauncherConfig, deployment: DeploymentConfig | None = None
) -> list[str]:
    """A run file that leaves out what it needs either gets it (the serving side: inference,
    router, weight broadcaster, which run on their defaults and the model) or is refused (the
    trainer: what is trained and how is the file's to say). A peer address set in a table
    stands for a peer outside the run: nothing is added for it (it is probed before the start).
    Adds the tables to `data`; returns what it added, as said at start."""
    added = []

    def add_inference(why: str) -> None:
        if launcher.model is None:
            raise LaunchConfigError(
                f"{why} but no [inference] table: add one (engine.model), "
                "or set [launcher] model for the launcher to start them on"
            )
        data["inference"] = {}
        added.append(f"[inference] x{deployment.num_replicas if deployment else launcher.inference_replicas} ({why})")

    if "inference" not in data and "inference_replicas" in launcher.model_fields_set:
        add_inference(f"[launcher] inference_replicas = {launcher.inference_replicas}")
    if "orchestrator" not in data:
        return added
    if "trainer" not in data and not _is_set(data, "orchestrator", "peers.trainer"):
        raise LaunchConfigError(
            "[orchestrator] needs a trainer: add a [trainer] table (its model and loss), "
            "or set [orchestrator] peers.trainer to a trainer that runs"
        )
    if "router" not in data and not _is_set(data, "orchestrator", "peers.router"):
        data["router"] = {}
        added.append("[router] (the orchestrator generates through it)")
    if "router" in data and "inference" not in data and not _is_set(data, "router", "replicas"):
        add_inference("[orchestrator] generates through a router that needs replicas")
    publishes = _is_set(data, "orchestrator", "peers.weight_broadcaster") or _is_set(
        data, "trainer", "publish.weight_broadcaster"
    )
    if "weight_broadcaster" not in data and "trainer" in data and "inference" in data and not publishes:
        data["weight_broadcaster"] = {}
        added.append("[weight_broadcaster] (new weights reach the replicas through it)")
    return added


def _inference_replicas(value: Any, deployment: DeploymentConfig | None) -> dict[str, ServiceSpec]:
    if isinstance(value, dict) and deployment is not None:
        specs = {}
        for layout in deployment.layout():
            table = copy.deepcopy(value)
            try:
                apply_settings(table, replica_settings(layout))
            except ValueError as exc:
                raise LaunchConfigError(
                    f"[inference] {exc} ([inference.deployment] shape = {deployment.shape!r})"
                ) from None
            specs[layout.name] = ServiceSpec(layout.name, "inference", table, "[inference]")
        return specs
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        tables = [(item, f"[[inference]] #{index + 1}") for index, item in enumerate(value)]
        return {f"inference-{i}": ServiceSpec(f"inference-{i}", "inference", t, w) for i, (t, w) in enumerate(tables)}
    raise LaunchConfigError("inference: must be a table ([inference]) or an array of tables ([[inference]])")


def _model(cls: type[BaseModel], value: Any, table: str) -> Any:
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        lines = []
        for item in exc.errors():
            field = ".".join(str(part) for part in item["loc"]) or "<table>"
            message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
            lines.append(f"  [{table}] {field}: {message}")
        raise LaunchConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` laid over it, tables merged key by key (copies)."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
