"""What links the services, filled into their tables where the launch file leaves it
unset: ports, every peer address, the model path, the orchestrator's metrics file."""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from primerl_common.config import TlsConfig
from primerl_common.processes import free_ports
from primerl_launcher.spec import ServiceSpec

__all__ = [
    "DEFAULT_ADAPTER_NAME",
    "OPERATOR",
    "PROCESS_ENVIRONMENT",
    "PROCESS_ENVIRONMENT_KINDS",
    "address_of",
    "assign_ports",
    "get_path",
    "identities",
    "orchestrator_wiring",
    "served_hosts",
    "set_default",
    "set_environment_tls",
    "set_model",
    "set_tls",
    "tls_table",
    "wire",
    "wire_lora",
]

_UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::", "[::]")
# Where each service kind takes the model folder.
MODEL_FIELDS = {"orchestrator": "model.path", "trainer": "model.path", "inference": "engine.model"}
# Under mTLS: the launcher's own identity, and the one the orchestrator gives the programs of its
# process environments (the kinds below; options.tls_cert/tls_key): role environment only.
OPERATOR = "operator"
PROCESS_ENVIRONMENT = "environment"
PROCESS_ENVIRONMENT_KINDS = ("verifiers",)
# The trainer's lora.rank when a launch file leaves it unset (primerl_trainer.config.LoRAConfig).
_DEFAULT_LORA_RANK = 16
# The adapter a single-run LoRA trainer publishes when its config names none (the trainer's
# PublishConfig.adapter_name default).
DEFAULT_ADAPTER_NAME = "primerl"


def get_path(table: Mapping[str, Any], dotted: str) -> Any:
    value: Any = table
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def set_default(table: dict[str, Any], dotted: str, value: Any, *, force: bool = False) -> Any:
    """Sets `dotted` (e.g. "server.port") unless already set; returns the value in force."""
    *parents, last = dotted.split(".")
    for part in parents:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ValueError(f"{dotted}: {part} must be a table")
    if force or table.get(last) is None:
        table[last] = value
    return table[last]


# The services that take weight pushes as sealed streams (server.sealed_port, under mTLS).
SEALED_PUSH_SERVICES = ("inference", "weight_broadcaster")


def assign_ports(services: Mapping[str, ServiceSpec], *, host: str, sealed: bool = False) -> None:
    """Every service without server.port (or with 0) gets a free one; server.host defaults to `host`.
    `sealed` (mTLS): each service taking weight pushes without server.sealed_port gets one too
    (fixed for the run: a restarted service binds it again)."""
    missing = [(spec, "server.port") for spec in services.values() if not get_path(spec.table, "server.port")]
    if sealed:
        missing += [
            (spec, "server.sealed_port")
            for spec in services.values()
            if spec.service in SEALED_PUSH_SERVICES and get_path(spec.table, "server.sealed_port") is None
        ]
    for (spec, field), port in zip(missing, free_ports(len(missing)), strict=True):
        set_default(spec.table, field, port, force=True)
    for spec in services.values():
        set_default(spec.table, "server.host", host)


def address_of(spec: ServiceSpec) -> str:
    host = get_path(spec.table, "server.host")
    host = "127.0.0.1" if host in _UNSPECIFIED_HOSTS else host
    return f"{host}:{get_path(spec.table, 'server.port')}"


def set_model(services: Mapping[str, ServiceSpec], model: pathlib.Path, *, force: bool = False) -> None:
    for spec in services.values():
        if spec.service in MODEL_FIELDS:
            set_default(spec.table, MODEL_FIELDS[spec.service], str(model), force=force)


def identities(services: Mapping[str, ServiceSpec]) -> dict[str, list[str]]:
    """The certificates an mTLS run needs, name -> roles: one per service (its kind's role),
    the launcher's (operator) and its process environments' (environment)."""
    return {
        **{name: [spec.service] for name, spec in services.items()},
        OPERATOR: [OPERATOR],
        PROCESS_ENVIRONMENT: [PROCESS_ENVIRONMENT],
    }


def served_hosts(services: Mapping[str, ServiceSpec], host: str) -> list[str]:
    """The host names the services are reached at besides loopback (their certificates name them)."""
    hosts = {host, *(get_path(spec.table, "server.host") or host for spec in services.values())}
    return sorted(name for name in hosts if name not in _UNSPECIFIED_HOSTS)


def set_tls(spec: ServiceSpec, tls: Mapping[str, TlsConfig] | None) -> None:
    """The service's tls section, where the launch file leaves it: plaintext (a local run,
    which the services accept on loopback hosts only), or its certificate from `tls`."""
    for field, value in tls_table(tls[spec.name] if tls is not None else None).items():
        set_default(spec.table, f"tls.{field}", value)
    if tls is not None and spec.service == "orchestrator":
        set_environment_tls(spec.table, tls[PROCESS_ENVIRONMENT])


def tls_table(tls: TlsConfig | None) -> dict[str, str]:
    """A service's [tls] table showing the certificate of `tls`; None: plaintext."""
    if tls is None:
        return {"mode": "plaintext"}
    return {field: str(getattr(tls, field)) for field in ("mode", "cert", "key", "ca")}


def set_environment_tls(orchestrator: dict[str, Any], environment: TlsConfig) -> None:
    """The certificate (role environment) an orchestrator gives the programs of its process
    environments, where their tables leave it unset."""
    for table in orchestrator.get("environments") or ():
        if isinstance(table, dict) and table.get("kind") in PROCESS_ENVIRONMENT_KINDS:
            set_default(table, "options.tls_cert", str(environment.cert))
            set_default(table, "options.tls_key", str(environment.key))


def wire(
    services: Mapping[str, ServiceSpec],
    *,
    run_dir: pathlib.Path,
    model: pathlib.Path | None,
    host: str,
    tls: Mapping[str, TlsConfig] | None = None,
) -> None:
    """Fills ports, peer addresses, replica ids, the model and each service's tls section
    (`tls`: the certificates of `identities(services)` by name; None: plaintext) into the
    tables (in place)."""
    assign_ports(services, host=host, sealed=tls is not None)
    for spec in services.values():
        set_tls(spec, tls)
    if model is not None:
        set_model(services, model)
    replicas = [spec for spec in services.values() if spec.service == "inference"]
    addresses = {name: address_of(spec) for name, spec in services.items()}
    for spec in replicas:
        set_default(spec.table, "replica.id", spec.name)
        if get_path(spec.table, "kv_cache_pool.enabled") and "kvstore" in services:
            set_default(spec.table, "kv_cache_pool.metadata_address", addresses["kvstore"])
    for name, spec in services.items():
        # Plain-text logs: they are read by people (and their tail shown when a service dies).
        set_default(spec.table, "observability.log_json", False)
        if name == "router":
            if "replicas" not in spec.table:
                spec.table["replicas"] = [
                    {
                        "replica_id": get_path(r.table, "replica.id"),
                        "address": addresses[r.name],
                        **({"role": get_path(r.table, "replica.role")} if get_path(r.table, "replica.role") else {}),
                    }
                    for r in replicas
                ]
            if "weight_broadcaster" in services:
                set_default(spec.table, "versions.weight_broadcaster_address", addresses["weight_broadcaster"])
        elif name == "orchestrator":
            wiring = orchestrator_wiring(
                addresses,
                [r.table for r in replicas],
                out_dir=run_dir / "orchestrator",
                config_dir=run_dir / "config",
            )
            for dotted, value in wiring.items():
                set_default(spec.table, dotted, value)
        elif name == "trainer" and "weight_broadcaster" in services:
            set_default(spec.table, "publish.weight_broadcaster", addresses["weight_broadcaster"])
    wire_lora(services)


def orchestrator_wiring(
    addresses: Mapping[str, str],
    replicas: Iterable[Mapping[str, Any]],
    *,
    out_dir: pathlib.Path,
    config_dir: pathlib.Path | None,
) -> dict[str, Any]:
    """What links an orchestrator to a run's services, by dotted key (to be set where its table
    leaves it unset): its peers among `addresses` (the services' addresses by name), the kvstore
    too where the replicas (their tables: `replicas`) pool their KV cache, so that it removes a
    policy version's KV namespace once nothing can use it; its outputs under `out_dir`; the
    folder of the run's service configs it logs with its own (`config_dir`; None: none).
    The one place that says it, for the launcher's own orchestrator (wire) and one started
    beside the services (run_orchestrator.run_orchestrator_config)."""
    wiring: dict[str, Any] = {
        f"peers.{peer}": addresses[peer] for peer in ("router", "trainer", "weight_broadcaster") if peer in addresses
    }
    pooled = [r for r in replicas if get_path(r, "kv_cache_pool.enabled")]
    if pooled and "kvstore" in addresses:
        wiring["peers.kv_cache_pool"] = addresses["kvstore"]
        models = {get_path(r, "kv_cache_pool.model") or "" for r in pooled}
        if len(models) == 1:  # pooled for several models: left to the orchestrator ('': every model)
            wiring["peers.kv_cache_pool_model"] = models.pop()
    wiring["output.metrics_jsonl"] = str(out_dir / "metrics.jsonl")
    wiring["output.samples_dir"] = str(out_dir / "samples")
    if config_dir is not None:
        wiring["tracking.config_dir"] = str(config_dir)
    return wiring


def wire_lora(services: Mapping[str, ServiceSpec]) -> None:
    """A trainer with LoRA on publishes its adapter alone (a few MB instead of the whole model)
    where a weight broadcaster pushes it: the replicas then serve it as a LoRA adapter (ranks up
    to the trainer's) and the orchestrator generates every turn with it. A trainer with runs
    ([trainer.runs] max_concurrent_runs) publishes one adapter per run, named by the run id: the
    replicas then hold as many at once, and an orchestrator names its run (peers.run_id) itself.
    A launch file that sets any of these keeps its own value."""
    trainer = services.get("trainer")
    if trainer is None or not get_path(trainer.table, "lora.enabled") or "weight_broadcaster" not in services:
        return
    if set_default(trainer.table, "publish.kind", "adapter") != "adapter":
        return
    num_runs = get_path(trainer.table, "runs.max_concurrent_runs") or 0
    adapter = None if num_runs else set_default(trainer.table, "publish.adapter_name", DEFAULT_ADAPTER_NAME)
    rank = get_path(trainer.table, "lora.rank") or _DEFAULT_LORA_RANK
    for spec in services.values():
        if spec.service == "inference":
            set_default(spec.table, "engine.enable_lora", True)
            set_default(spec.table, "engine.max_lora_rank", rank)
            if num_runs:
                set_default(spec.table, "engine.max_loras", num_runs)
        elif spec.service == "orchestrator" and adapter is not None:
            set_default(spec.table, "model.lora_adapter", adapter)
