import pathlib

import pytest
from pydantic import Field

from primerl_common.config import (
    ConfigError,
    Section,
    ServerConfig,
    ServiceConfig,
    load_config,
    parse_command_line,
    service_settings,
)


class Policy(Section):
    name: str = "round_robin"
    virtual_nodes: int = Field(default=64, gt=0)


class ExampleConfig(ServiceConfig):
    """An example service."""

    service_name = "example"
    model_config = service_settings("example")

    server: ServerConfig = ServerConfig(port=50099)
    policy: Policy = Policy()
    replicas: list[str] = Field(default_factory=list)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("PRIMERL_EXAMPLE_"):
            monkeypatch.delenv(key)


def write(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "example.toml"
    path.write_text(text)
    return str(path)


def test_defaults():
    config = load_config(ExampleConfig, [])
    assert config.server.port == 50099
    assert config.policy.name == "round_robin"
    assert config.observability.log_level == "INFO"


def test_precedence_cli_over_env_over_toml_over_defaults(tmp_path, monkeypatch):
    path = write(
        tmp_path, "replicas = ['a:1']\n[server]\nport = 1\nhost = 'toml'\ngrace_s = 3\n[policy]\nname = 'toml'\n"
    )
    monkeypatch.setenv("PRIMERL_EXAMPLE_SERVER__PORT", "2")
    monkeypatch.setenv("PRIMERL_EXAMPLE_POLICY__NAME", "env")
    config = load_config(ExampleConfig, ["-c", path, "--policy.name", "cli"])
    assert config.policy.name == "cli"  # CLI beats env and TOML
    assert config.server.port == 2  # env beats TOML
    assert config.server.host == "toml"  # TOML beats defaults
    assert config.server.grace_s == 3
    assert config.policy.virtual_nodes == 64  # untouched keys keep their defaults
    assert config.replicas == ["a:1"]


def test_unknown_toml_key_is_named(tmp_path):
    path = write(tmp_path, "[server]\nprot = 5\n")
    with pytest.raises(ConfigError, match=r"server\.prot: unknown key") as info:
        load_config(ExampleConfig, ["-c", path])
    assert "example.toml" in str(info.value)


def test_unknown_top_level_section_is_named(tmp_path):
    path = write(tmp_path, "[polcy]\nname = 'x'\n")
    with pytest.raises(ConfigError, match="polcy: unknown key"):
        load_config(ExampleConfig, ["-c", path])


def test_unknown_env_key_is_named(monkeypatch):
    monkeypatch.setenv("PRIMERL_EXAMPLE_REPLICA", "x")
    with pytest.raises(ConfigError, match=r"replica: unknown key .*PRIMERL_EXAMPLE_REPLICA"):
        load_config(ExampleConfig, [])


def test_invalid_value_names_field(tmp_path):
    path = write(tmp_path, "[policy]\nvirtual_nodes = 0\n")
    with pytest.raises(ConfigError, match=r"policy\.virtual_nodes: Input should be greater than 0"):
        load_config(ExampleConfig, ["-c", path])


def test_bad_cli_value_names_field():
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_config(ExampleConfig, ["--server.port", "many"])


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ExampleConfig, ["-c", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(ExampleConfig, ["-c", write(tmp_path, "[server\n")])


def test_help_lists_fields(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(ExampleConfig, ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--policy.virtual_nodes" in out and "--config" in out and "PRIMERL_EXAMPLE_" in out


SHARED = """
[launcher]
model = "tiny-dense"
[example.server]
port = 7
[example.policy]
name = "shared"
[other.example]
replicas = ["b:2"]
[other.example.policy]
virtual_nodes = 0
"""


def test_config_section_reads_only_that_table(tmp_path):
    path = write(tmp_path, SHARED)
    config, command_line = parse_command_line(ExampleConfig, ["-c", path, "--config-section", "example"])
    assert (config.server.port, config.policy.name) == (7, "shared")
    assert command_line.config_section == "example" and not command_line.check_config
    nested = load_config(ExampleConfig, ["-c", path, "--config-section", "other.example", "--policy.virtual_nodes=3"])
    assert nested.replicas == ["b:2"] and nested.policy.virtual_nodes == 3


def test_config_section_from_environment_and_errors_name_the_table(tmp_path, monkeypatch):
    path = write(tmp_path, SHARED)
    monkeypatch.setenv("PRIMERL_EXAMPLE_CONFIG_SECTION", "other.example")
    with pytest.raises(ConfigError, match=r"\[other\.example\]\):\n  policy\.virtual_nodes: Input should be greater"):
        load_config(ExampleConfig, ["-c", path])
    with pytest.raises(ConfigError, match=r"has no \[missing\] table"):
        load_config(ExampleConfig, ["-c", path, "--config-section", "missing"])
    with pytest.raises(ConfigError, match=r"has no \[launcher\.model\] table"):
        load_config(ExampleConfig, ["-c", path, "--config-section", "launcher.model"])
    monkeypatch.delenv("PRIMERL_EXAMPLE_CONFIG_SECTION")
    with pytest.raises(ConfigError, match="needs a config file"):
        load_config(ExampleConfig, ["--config-section", "example"])
