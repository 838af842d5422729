"""Service configuration: pydantic models loaded from, in order of precedence,
the command line > environment (PRIMERL_<SERVICE>_*) > a TOML file > defaults.

Unknown keys are errors wherever they come from, and every error names the
field, so a typo in a config file never silently falls back to a default.

One TOML file may hold several services' configs, each under its own top-level
table: `--config-section NAME` (or PRIMERL_<SERVICE>_CONFIG_SECTION) reads only
that table. `--check-config` (see server.run_main) validates and exits.
"""

from __future__ import annotations

import argparse
import contextvars
import ipaddress
import os
import pathlib
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from primerl_common.admission import AdmissionConfig

__all__ = [
    "CommandLine",
    "ConfigError",
    "ObservabilityConfig",
    "Section",
    "ServerConfig",
    "ServiceConfig",
    "TlsConfig",
    "load_config",
    "parse_command_line",
]

_toml_path: contextvars.ContextVar[pathlib.Path | None] = contextvars.ContextVar("primerl_toml_path", default=None)
_toml_section: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("primerl_toml_section", default=())
# Environment variable suffix (after PRIMERL_<SERVICE>_) of --config-section; not a config field.
_SECTION_ENV = "CONFIG_SECTION"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each bad field."""


class Section(BaseModel):
    """Base of every nested config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


class ServerConfig(Section):
    host: str = "0.0.0.0"
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    drain_delay_s: float = Field(
        default=0.5, ge=0, description="on SIGTERM, how long health says NOT_SERVING while new calls are still taken"
    )
    grace_s: float = Field(default=10.0, ge=0, description="then how long in-flight calls may finish")
    max_message_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    sealed_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="port of sealed streams (weight pushes sealed with AES-256-GCM on several cores over a "
        "plaintext connection, each stream's key handed out over mutual TLS; tls.mode mtls only) on server.host; "
        "unset: pushes take the mTLS port; 0 picks a free one",
    )


class ObservabilityConfig(Section):
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_json: bool = True
    trace_exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str | None = None
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="Prometheus port; unset: off")
    metrics_host: str | None = Field(
        default=None,
        min_length=1,
        description="address the Prometheus endpoint binds (e.g. 127.0.0.1 for a scraper on the host); "
        "unset: server.host",
    )


class TlsConfig(Section):
    """Transport security of the service's server and of the channels its process opens.
    Checked when the service starts (`check`), not when the config is read: a deployment's
    config names certificate files that exist only where it runs."""

    mode: Literal["mtls", "plaintext"] = Field(
        default="mtls",
        description="mtls: mutual TLS, every caller shows a certificate of tls.ca; "
        "plaintext: no TLS and no identities, only on a loopback server.host (local demo, tests)",
    )
    cert: pathlib.Path | None = Field(default=None, description="PEM certificate of this service (mtls)")
    key: pathlib.Path | None = Field(default=None, description="PEM private key of tls.cert (mtls)")
    ca: pathlib.Path | None = Field(default=None, description="PEM CA certificate(s) peers must be signed by (mtls)")
    tokens_file: pathlib.Path | None = Field(
        default=None, description="TOML file of accepted bearer tokens (sha256, name, roles); unset: none (mtls)"
    )

    def check(self, host: str) -> None:
        """Raises ConfigError naming the field: mtls without its files or with unreadable
        ones, plaintext on a host other than loopback."""
        if self.mode == "plaintext":
            if not is_loopback(host):
                raise ConfigError(
                    f"invalid configuration:\n  tls.mode: plaintext is allowed only on a loopback server.host "
                    f"(127.0.0.1, ::1, localhost), not {host!r}; use mtls (tls.cert, tls.key, tls.ca)"
                )
            return
        problems = []
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is None:
                problems.append(f"  tls.{name}: required when tls.mode is mtls (the default)")
            elif not _readable(path):
                problems.append(f"  tls.{name}: cannot read {path}")
        if self.tokens_file is not None and not _readable(self.tokens_file):
            problems.append(f"  tls.tokens_file: cannot read {self.tokens_file}")
        if problems:
            raise ConfigError("invalid configuration:\n" + "\n".join(problems))


def is_loopback(host: str) -> bool:
    """Whether `host` (a server.host) is a loopback address: 0.0.0.0 and :: are not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _readable(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError:
        return False
    return True


class ServiceConfig(BaseSettings):
    """Base of each service's config. Subclasses set `service_name` and
    `model_config = service_settings("router")`."""

    service_name: ClassVar[str] = ""
    model_config = SettingsConfigDict(
        extra="forbid", env_nested_delimiter="__", nested_model_default_partial_update=True
    )

    server: ServerConfig = ServerConfig()
    tls: TlsConfig = TlsConfig()
    admission: AdmissionConfig = AdmissionConfig()
    observability: ObservabilityConfig = ObservabilityConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        toml_path = _toml_path.get()
        if toml_path is not None:
            sources.append(
                TomlConfigSettingsSource(settings_cls, toml_file=toml_path, toml_table_header=_toml_section.get())
            )
        return tuple(sources)

    @classmethod
    def env_prefix(cls) -> str:
        return f"PRIMERL_{cls.service_name.upper()}_"


def service_settings(service_name: str, **overrides: Any) -> SettingsConfigDict:
    """The settings config of a service's ServiceConfig subclass."""
    return SettingsConfigDict(
        extra="forbid",
        env_prefix=f"PRIMERL_{service_name.upper()}_",
        env_nested_delimiter="__",
        nested_model_default_partial_update=True,
        **overrides,
    )


def _describe(error: ValidationError, toml_path: pathlib.Path | str | None) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<root>"
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"  {field}: {message}")
    where = f" (config file {toml_path})" if toml_path else ""
    return f"invalid configuration{where}:\n" + "\n".join(lines)


def _check_unknown_env(cls: type[ServiceConfig]) -> None:
    prefix = cls.env_prefix()
    known = {name.upper() for name in cls.model_fields}
    for key in os.environ:
        if key.startswith(prefix) and key != prefix + _SECTION_ENV:
            top = key[len(prefix) :].split("__", 1)[0]
            if top not in known:
                field = key[len(prefix) :].lower().replace("__", ".")
                raise ConfigError(f"invalid configuration:\n  {field}: unknown key (from environment variable {key})")


C = TypeVar("C", bound=ServiceConfig)


@dataclass(frozen=True)
class CommandLine:
    """What the command line asked for besides the config itself."""

    config_file: pathlib.Path | None
    config_section: str | None
    check_config: bool
    print_config: bool = False


def load_config(cls: type[C], argv: Sequence[str] | None = None, *, prog: str | None = None) -> C:
    """Parses argv (`-c/--config FILE` plus one flag per field, e.g.
    `--server.port 5000`) and builds the config. Raises ConfigError."""
    return parse_command_line(cls, argv, prog=prog)[0]


def parse_command_line(
    cls: type[C], argv: Sequence[str] | None = None, *, prog: str | None = None
) -> tuple[C, CommandLine]:
    """load_config, plus the flags that are not config fields. Raises ConfigError."""
    parser = argparse.ArgumentParser(
        prog=prog or f"primerl-{cls.service_name.replace('_', '-')}",
        description=" ".join((cls.__doc__ or "").split()) or None,
        epilog=f"Precedence: flags > environment ({cls.env_prefix()}<FIELD>, nested with __) > TOML file > defaults.",
    )
    parser.add_argument("-c", "--config", type=pathlib.Path, help="TOML config file")
    parser.add_argument(
        "--config-section",
        default=os.environ.get(cls.env_prefix() + _SECTION_ENV) or None,
        help=f"read only this top-level table of the TOML file (dotted for nested ones; "
        f"env {cls.env_prefix()}{_SECTION_ENV})",
    )
    parser.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="validate the configuration, print it as JSON (defaults and environment applied) and exit",
    )
    cli_source = CliSettingsSource(cls, root_parser=parser)
    parsed = parser.parse_args(list(argv) if argv is not None else None)
    toml_path = parsed.config
    section = tuple(parsed.config_section.split(".")) if parsed.config_section else ()
    if section and toml_path is None:
        raise ConfigError(f"--config-section {parsed.config_section} needs a config file (-c)")
    if toml_path is not None:
        _check_toml(toml_path, section)
    _check_unknown_env(cls)
    path_token, section_token = _toml_path.set(toml_path), _toml_section.set(section)
    try:
        config = cls(_cli_settings_source=cli_source(parsed_args=parsed))
    except ValidationError as exc:
        where = f"{toml_path} [{'.'.join(section)}]" if section else toml_path
        raise ConfigError(_describe(exc, where)) from None
    finally:
        _toml_path.reset(path_token)
        _toml_section.reset(section_token)
    return config, CommandLine(toml_path, parsed.config_section, parsed.check_config, parsed.print_config)


def _check_toml(toml_path: pathlib.Path, section: tuple[str, ...]) -> None:
    if not toml_path.is_file():
        raise ConfigError(f"config file {toml_path} does not exist")
    try:
        table: Any = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {toml_path} is not valid TOML: {exc}") from None
    for depth, key in enumerate(section):
        table = table.get(key) if isinstance(table, dict) else None
        if not isinstance(table, dict):
            raise ConfigError(f"config file {toml_path} has no [{'.'.join(section[: depth + 1])}] table")
