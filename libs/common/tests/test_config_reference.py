"""The configuration reference: every key, its default and its environment variable, kept
in the README between markers and checked for staleness."""

from __future__ import annotations

import pathlib
from typing import Literal

from pydantic import Field

from primerl_common import config_reference
from primerl_common.config import Section, ServiceConfig, service_settings

REPO = pathlib.Path(__file__).resolve().parents[3]


class Limits(Section):
    max_items: int = Field(default=8, gt=0, description="most items | per call")
    mode: Literal["fast", "safe"] = "safe"


class ExampleConfig(ServiceConfig):
    service_name = "example"
    model_config = service_settings("example")

    path: str = Field(description="where the data lives")
    limits: Limits = Limits()
    extra_limits: Limits | None = None
    tags: list[str] = Field(default_factory=lambda: ["a"])


def test_every_key_has_its_type_default_env_var_and_description() -> None:
    rows = {row.split(" | ")[0].strip("| `"): row for row in config_reference.render(ExampleConfig).splitlines()[2:]}

    assert "| `path` | str | required | `PRIMERL_EXAMPLE_PATH` | where the data lives |" in rows["path"]
    assert "`PRIMERL_EXAMPLE_LIMITS__MAX_ITEMS`" in rows["limits.max_items"]
    # A | in a description would split the Markdown cell: it is escaped.
    assert "most items \\| per call" in rows["limits.max_items"]
    assert "'fast' \\| 'safe' | \"safe\"" in rows["limits.mode"]
    # An optional section lists its keys too; a factory default is shown evaluated.
    assert "extra_limits.mode" in rows and "['a']" in rows["tags"]
    assert "server.port" in rows and "observability.log_level" in rows


def test_the_readme_block_is_replaced_in_place_and_check_finds_a_stale_one(tmp_path) -> None:
    readme = tmp_path / "example" / "README.md"
    readme.parent.mkdir()
    readme.write_text("# example\n\nIntro.\n")
    template, configs = str(tmp_path / "{service}" / "README.md"), {"example": ExampleConfig}

    assert config_reference.sync_readmes(template, configs, check=True) == [readme]
    assert readme.read_text() == "# example\n\nIntro.\n"
    config_reference.sync_readmes(template, configs, check=False)
    written = readme.read_text()
    assert written.startswith("# example\n\nIntro.\n") and written.count(config_reference.BEGIN) == 1
    assert config_reference.sync_readmes(template, configs, check=True) == []

    readme.write_text(written.replace("where the data lives", "old text") + "\n## After\n")
    assert config_reference.sync_readmes(template, configs, check=True) == [readme]
    config_reference.sync_readmes(template, configs, check=False)
    assert readme.read_text() == written + "\n## After\n"


def test_the_installed_services_readmes_are_up_to_date() -> None:
    assert config_reference.main(["--readme", str(REPO / "services" / "{service}" / "README.md"), "--check"]) == 0


def test_every_installed_service_registers_its_config() -> None:
    configs = config_reference.service_configs()

    assert set(configs) == {"orchestrator", "trainer", "inference", "router", "weight_broadcaster", "kvstore"}
    assert all(cls.service_name == name for name, cls in configs.items())
