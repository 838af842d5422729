"""What the deployment checks (tests/test_deploy_*.py) share: where deploy/ is, the
services and their ports, the console scripts an install has, the tools the checks need,
and loading an example config with its service's own config class."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tomllib
from pathlib import Path
from unittest import mock

import pytest

from primerl_common.config import load_config

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
IN_CI = bool(os.environ.get("CI"))

SERVICES = ("orchestrator", "trainer", "inference", "router", "weight_broadcaster", "kvstore")
# server.sealed_port of the services that take weight pushes sealed in the shipped deployments,
# and the method taken so (its callers' pods are admitted to the port).
SEALED_PORTS = {"inference": (51053, "UpdateWeights"), "weight_broadcaster": (51055, "PublishWeights")}
PORTS = {
    "orchestrator": 50051,
    "trainer": 50052,
    "inference": 50053,
    "router": 50054,
    "weight_broadcaster": 50055,
    "kvstore": 50056,
}
CONFIG_CLASSES = {
    "orchestrator": "OrchestratorConfig",
    "trainer": "TrainerConfig",
    "inference": "InferenceConfig",
    "router": "RouterConfig",
    "weight_broadcaster": "WeightBroadcasterConfig",
    "kvstore": "KvstoreConfig",
}
MODEL_FLAG = {"orchestrator": "--model.path", "trainer": "--model.path", "inference": "--engine.model"}


def scripts_of(project: Path) -> set[str]:
    return set(tomllib.loads((project / "pyproject.toml").read_text())["project"].get("scripts", {}))


def launcher_scripts() -> set[str]:
    """The console scripts of primerl-launcher (installed beside the services; the tools image)."""
    return scripts_of(REPO / "tools" / "launcher")


def console_scripts() -> set[str]:
    """The console scripts an install of every service and primerl-launcher has."""
    names = scripts_of(REPO / "libs" / "common") | launcher_scripts()
    for service in SERVICES:
        names |= scripts_of(REPO / "services" / service)
    return names


def tool(name: str, why: str) -> str:
    """Path of a tool the tests need: missing fails in CI, skips elsewhere."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is missing ({why})")
        pytest.skip(f"{name} is missing ({why})")
    return path


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the config validators look for in a model folder (they open nothing)."""
    model = tmp_path_factory.mktemp("model")
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (model / name).write_text("{}")
    return model


def load_service_config(
    service: str,
    path: Path,
    model: Path | None = None,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
):
    """The config `primerl-<service> -c path [argv]` would run with (the model folder replaced by `model`)."""
    config_class = getattr(importlib.import_module(f"primerl_{service}.config"), CONFIG_CLASSES[service])
    argv = ["-c", str(path), *(argv or [])]
    if model is not None and service in MODEL_FLAG:
        argv += [MODEL_FLAG[service], str(model)]
    with mock.patch.dict(os.environ, env or {}):
        return load_config(config_class, argv)


def drain_s(config) -> float:
    return config.server.drain_delay_s + config.server.grace_s


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (systemd EnvironmentFile, kustomize envs), comments skipped."""
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))
