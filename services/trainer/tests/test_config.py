"""The trainer's configuration: sections nest from TOML, environment and flags; combinations
that cannot work are refused naming the keys; the example file is valid."""

from __future__ import annotations

import pathlib

import pytest

from primerl_common.config import ConfigError, load_config
from primerl_trainer.config import TrainerConfig

EXAMPLE = pathlib.Path(__file__).parents[1] / "config.example.toml"


def test_the_example_config_loads() -> None:
    config = load_config(TrainerConfig, ["-c", str(EXAMPLE)])
    assert config.server.port == 50052
    assert config.mode == "rl" and config.checkpoint.interval > 0
    assert config.optimizer.max_grad_norm == 1.0


def test_sections_nest_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIMERL_TRAINER_MODEL__PATH", "/models/tiny")
    monkeypatch.setenv("PRIMERL_TRAINER_LORA__ENABLED", "true")
    config = load_config(
        TrainerConfig,
        ["--optimizer.lr", "0.001", "--lora.target_modules", '["q", "v"]', "--publish.kind", "adapter"],
    )
    assert config.model.path == "/models/tiny"
    assert config.optimizer.lr == 0.001
    assert config.lora.enabled and config.lora.target_modules == ["q", "v"]
    assert config.publish.kind == "adapter" and config.publish.weight_broadcaster is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "model: Field required"),
        (["--model.path", "m", "--publish.kind", "adapter"], "publish.kind 'adapter' needs lora.enabled"),
        (["--model.path", "m", "--sft.dataset", "d.jsonl"], "sft.dataset needs mode 'sft'"),
        (["--model.path", "m", "--max_queued_batches", "0"], "max_queued_batches"),
        (["--model.path", "m", "--schedule.decay", "cosine"], "needs total_steps"),
        (["--model.path", "m", "--model.dtype", "float16"], "model.dtype"),
    ],
)
def test_unusable_configs_are_refused_naming_the_key(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerConfig, argv)
