"""The config of an orchestrator started beside a running `primerl up` whose launch file has no
[orchestrator]: the orchestrator of one run of a trainer with runs ([trainer.runs], each run fed
by its own orchestrator, peers.run_id), or of a single-run trainer's one run. What the launcher
fills into an [orchestrator] table (wiring.wire, wiring.wire_lora) is filled in the same way
(the links by the same wiring.orchestrator_wiring), from the listing the launcher writes once every
service is SERVING (<run_dir>/services.json): each service's address and config file."""

from __future__ import annotations

import copy
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

from primerl_common.config import TlsConfig
from primerl_launcher import _toml
from primerl_launcher.wiring import DEFAULT_ADAPTER_NAME, get_path, orchestrator_wiring, set_default, tls_table

__all__ = ["run_orchestrator_config"]


def run_orchestrator_config(
    path: pathlib.Path,
    services: Mapping[str, Mapping[str, Any]],
    table: Mapping[str, Any],
    *,
    run_id: str | None,
    port: int,
    out_dir: pathlib.Path,
    tls: TlsConfig | None = None,
    config_dir: pathlib.Path | None = None,
) -> pathlib.Path:
    """Writes at `path` the config of an orchestrator that feeds the trainer of `services` (the
    launcher's services.json) and returns `path`. `table` is the orchestrator's own part (what a
    launch file's [orchestrator] table holds: run, environments, ...; left unchanged); filled in
    where it leaves them unset: the peers (the kvstore too where the replicas pool their KV cache,
    as their config files say), the model the trainer trains, loopback at `port` (plaintext, or
    mutual TLS with the certificate of `tls`), the outputs under `out_dir`, the folder of the
    run's service configs it logs with its own (tracking.config_dir: `config_dir`; None: the
    launcher's, <run_dir>/config, where the trainer's config is), and the run it feeds: `run_id`
    on a trainer with runs; None on a single-run trainer, whose adapter (where it publishes its
    LoRA adapter alone) the rollouts then use, as the launcher's own orchestrator would."""
    config = copy.deepcopy(dict(table))
    trainer_config = pathlib.Path(services["trainer"]["config"])
    trainer = tomllib.loads(trainer_config.read_text())
    with_runs = bool(get_path(trainer, "runs.max_concurrent_runs"))
    if with_runs and run_id is None:
        raise ValueError("the trainer has runs ([trainer.runs]): name the run the orchestrator feeds (run_id)")
    if not with_runs and run_id is not None:
        raise ValueError(f"run_id {run_id!r}: the trainer trains one run (no [trainer.runs])")
    filled: dict[str, Any] = {
        "server.host": "127.0.0.1",
        "server.port": port,
        **{f"tls.{field}": value for field, value in tls_table(tls).items()},
        "observability.log_json": False,
        "model.path": trainer["model"]["path"],
        **orchestrator_wiring(
            {name: service["address"] for name, service in services.items()},
            _replica_tables(services),
            out_dir=out_dir,
            config_dir=config_dir if config_dir is not None else trainer_config.parent,
        ),
    }
    if run_id is not None:
        filled["peers.run_id"] = run_id
    elif get_path(trainer, "publish.kind") == "adapter":
        filled["model.lora_adapter"] = get_path(trainer, "publish.adapter_name") or DEFAULT_ADAPTER_NAME
    for dotted, value in filled.items():
        set_default(config, dotted, value)
    path.write_text(_toml.dumps(config))
    return path


def _replica_tables(services: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The inference replicas' configs, as the files services.json names say them."""
    return [
        tomllib.loads(pathlib.Path(service["config"]).read_text())
        for service in services.values()
        if service.get("service") == "inference" and service.get("config")
    ]
