"""deploy/compose.yaml, checked offline (tests/test_containers.py runs it): every config of
deploy/compose/ loads with its service's config class and serves on the port compose
probes and publishes; the containers of the launcher's commands run commands the images have, and the
replica registration (kept up, not a one-shot) names the replica and the broadcaster as
their configs do."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from .deploy_helpers import (
    DEPLOY,
    PORTS,
    SERVICES,
    console_scripts,
    drain_s,
    load_service_config,
)

fake_model = deploy_helpers.fake_model  # a fixture of the deploy tests

COMPOSE = DEPLOY / "compose"


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]


@pytest.mark.parametrize("service", SERVICES)
def test_compose_service_runs_its_config_on_its_port(service: str, fake_model: Path) -> None:
    spec = compose_services()[service.replace("_", "-")]
    port = PORTS[service]
    assert spec["image"] == f"primerl-{service.replace('_', '-')}:${{PRIMERL_TAG:-latest}}"
    assert f"./compose/{service}.toml:/etc/primerl/{service}.toml:ro" in spec["volumes"]
    assert spec["environment"]["PRIMERL_HEALTHCHECK_PORT"] == str(port)
    assert spec["ports"] == [f"127.0.0.1:${{PRIMERL_{service.upper()}_PORT-{port}}}:{port}"]
    config = load_service_config(service, COMPOSE / f"{service}.toml", fake_model)
    assert config.server.port == port and config.server.host == "0.0.0.0"
    assert drain_s(config) < float(spec["stop_grace_period"].removesuffix("s"))


def test_compose_keeps_the_replica_registered_and_starts_the_run_once_it_is(fake_model: Path) -> None:
    services = compose_services()
    for name, spec in services.items():
        if "entrypoint" in spec:
            assert spec["entrypoint"][0] in console_scripts(), name
    register = services["register-replica"]
    # The launcher's commands come with the tools image, not with a service image.
    assert register["image"] == services["model"]["image"] == "primerl-tools:${PRIMERL_TAG:-latest}"
    assert register["entrypoint"][0] == "primerl-register-replicas"
    args = parse_args(register["entrypoint"][1:] + register["command"])
    # Not a one-shot: a broadcaster restarted by compose has forgotten the replica.
    assert not args.once and args.interval <= 10
    assert register["restart"] == "on-failure"
    # Healthy once registered (the same registration, --once); the orchestrator waits for that.
    probe = register["healthcheck"]["test"]
    assert probe[:2] == ["CMD", "primerl-register-replicas"]
    checked = parse_args(probe[2:])
    assert checked.once and (checked.broadcaster, checked.replica) == (args.broadcaster, args.replica)
    assert services["orchestrator"]["depends_on"]["register-replica"] == {"condition": "service_healthy"}
    assert register["depends_on"] == {
        "inference": {"condition": "service_healthy"},
        "weight-broadcaster": {"condition": "service_healthy"},
    }
    assert register["volumes"] == ["./certs:/etc/primerl/certs:ro"]  # its certificate; the command comes with the image
    inference = load_service_config("inference", COMPOSE / "inference.toml", fake_model)
    replicas = [(inference.replica.id, f"inference:{inference.server.port}")]
    assert args.replica == replicas
    assert args.broadcaster == f"weight-broadcaster:{PORTS['weight_broadcaster']}"
    # No --router: the router's config lists the replica.
    router = load_service_config("router", COMPOSE / "router.toml")
    assert args.router is None and [(r.replica_id, r.address) for r in router.replicas] == replicas
