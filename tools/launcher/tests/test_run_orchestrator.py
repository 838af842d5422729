"""The config of an orchestrator started beside a running `primerl up`: filled from the
launcher's services.json as the launcher fills its own orchestrator's."""

from __future__ import annotations

import pathlib
import tomllib

import pytest

from primerl_launcher import _toml
from primerl_launcher.run_orchestrator import run_orchestrator_config

OWN = {"run": {"max_steps": 3}, "environments": [{"name": "e", "kind": "reverse_text"}]}


def listing(tmp_path: pathlib.Path, trainer: dict) -> dict:
    """services.json of a run whose trainer's written config is `trainer` (plus its model)."""
    config = tmp_path / "trainer.toml"
    config.write_text(_toml.dumps({"model": {"path": "/models/tiny"}, **trainer}))
    services = {name: {"address": f"127.0.0.1:{port}"} for name, port in (("router", 1), ("weight_broadcaster", 2))}
    return services | {"trainer": {"address": "127.0.0.1:3", "config": str(config)}}


def written(tmp_path: pathlib.Path, trainer: dict, table: dict = OWN, **kwargs) -> dict:
    path = run_orchestrator_config(
        tmp_path / "orchestrator.toml", listing(tmp_path, trainer), table, port=4, out_dir=tmp_path / "out", **kwargs
    )
    return tomllib.loads(path.read_text())


def test_a_run_of_a_trainer_with_runs_is_named_and_wired_to_the_running_services(tmp_path):
    config = written(tmp_path, {"runs": {"max_concurrent_runs": 2}, "publish": {"kind": "adapter"}}, run_id="run-a")
    assert config["peers"] == {
        "run_id": "run-a",
        "router": "127.0.0.1:1",
        "weight_broadcaster": "127.0.0.1:2",
        "trainer": "127.0.0.1:3",
    }
    assert config["model"] == {"path": "/models/tiny"}  # the run's adapter is named by its run id
    assert config["server"] == {"host": "127.0.0.1", "port": 4} and config["tls"] == {"mode": "plaintext"}
    assert config["output"] == {
        "metrics_jsonl": str(tmp_path / "out" / "metrics.jsonl"),
        "samples_dir": str(tmp_path / "out" / "samples"),
    }
    assert config["run"] == OWN["run"] and config["environments"] == OWN["environments"]


def test_a_single_run_trainer_s_orchestrator_uses_its_published_adapter(tmp_path):
    lora = {"lora": {"enabled": True}, "publish": {"kind": "adapter", "adapter_name": "mine"}}
    assert written(tmp_path, lora, run_id=None)["model"]["lora_adapter"] == "mine"
    unnamed = {"lora": {"enabled": True}, "publish": {"kind": "adapter"}}
    assert written(tmp_path, unnamed, run_id=None)["model"]["lora_adapter"] == "primerl"
    # Whole weights published: no adapter.
    assert "lora_adapter" not in written(tmp_path, {}, run_id=None)["model"]


def test_what_the_table_sets_is_kept_and_the_table_is_left_as_it_was(tmp_path):
    table = {**OWN, "server": {"port": 9}, "peers": {"router": "10.0.0.1:5"}}
    before = _toml.dumps(table)
    config = written(tmp_path, {}, table, run_id=None)
    assert config["server"]["port"] == 9 and config["peers"]["router"] == "10.0.0.1:5"
    assert _toml.dumps(table) == before


@pytest.mark.parametrize(
    ("trainer", "run_id", "message"),
    [
        ({"runs": {"max_concurrent_runs": 2}}, None, "name the run"),
        ({}, "run-a", "trains one run"),
    ],
)
def test_a_run_id_is_needed_exactly_where_the_trainer_has_runs(tmp_path, trainer, run_id, message):
    with pytest.raises(ValueError, match=message):
        written(tmp_path, trainer, run_id=run_id)
