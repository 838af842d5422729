"""deploy/compose.yaml, checked offline (tests/test_containers.py runs it): every config of
deploy/compose/ loads with its service's config class and serves on the port compose
probes and publishes; the containers of the launcher's commands run commands the images have, and the
replica registration (kept up, not a one-shot) names the replica and the broadcaster as
their configs do."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from primerl_launcher.deployment import DeploymentConfig
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


# ---------------------------------------------------------------------------- deployment shapes

# Shape -> the file laid over compose.yaml (None: compose.yaml alone) and the shape it deploys.
SHAPES = {
    "single": (None, DeploymentConfig()),
    "replicas": (COMPOSE / "replicas.yaml", DeploymentConfig(shape="replicas", replicas=2)),
    "disaggregated": (COMPOSE / "disaggregated.yaml", DeploymentConfig(shape="disaggregated", prefill=1, decode=1)),
}


def _mounts(volumes: list[str]) -> dict[str, str]:
    return {volume.split(":")[1]: volume for volume in volumes}


def merged_services(override: Path | None) -> dict[str, dict]:
    """compose.yaml with `override` laid over it as `docker compose -f compose.yaml -f override`
    merges them: mappings key by key, mounts by their container path, sequences such as
    command replaced."""
    services = compose_services()
    if override is None:
        return services
    for name, spec in yaml.safe_load(override.read_text())["services"].items():
        base = services.setdefault(name, {})
        for key, value in spec.items():
            if key == "volumes" and key in base:
                base[key] = list((_mounts(base[key]) | _mounts(value)).values())
            elif isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
    return services


@pytest.mark.parametrize("shape", SHAPES)
def test_each_deployment_shape_gives_the_replicas_router_and_pool_of_that_shape(shape: str, fake_model: Path) -> None:
    override, deployment = SHAPES[shape]
    services = merged_services(override)
    replicas = {name: spec for name, spec in services.items() if spec["image"].startswith("primerl-inference:")}
    configs = {}
    for name, spec in replicas.items():
        [config_file] = [v.split(":")[0] for v in spec["volumes"] if v.endswith(":/etc/primerl/inference.toml:ro")]
        env = {k: str(v) for k, v in spec["environment"].items() if k.startswith("PRIMERL_INFERENCE_")}
        configs[name] = load_service_config("inference", DEPLOY / config_file, fake_model, env=env)
        assert spec["environment"]["PRIMERL_HEALTHCHECK_PORT"] == str(configs[name].server.port)
        assert spec["depends_on"]["model"] == {"condition": "service_completed_successfully"}
        if configs[name].kv_cache_pool.enabled:
            assert configs[name].kv_cache_pool.metadata_address == f"kvstore:{PORTS['kvstore']}"
            assert spec["depends_on"]["kvstore"] == {"condition": "service_healthy"}
    # The roles and pool switches of the shape, as the launcher lays them out.
    layout = deployment.layout()
    assert sorted((c.replica.role, c.kv_cache_pool.enabled) for c in configs.values()) == sorted(
        (r.role, r.kv_pool) for r in layout
    )
    # The router lists every replica with its role, and splits requests exactly when disaggregated.
    [router_file] = [v.split(":")[0] for v in services["router"]["volumes"] if "/etc/primerl/router.toml" in v]
    router = load_service_config("router", DEPLOY / router_file)
    listed = {(r.replica_id, r.address, r.role) for r in router.replicas}
    assert listed == {(c.replica.id, f"{name}:{c.server.port}", c.replica.role) for name, c in configs.items()}
    assert router.routing.disaggregate == deployment.disaggregate
    # Every replica is registered with the broadcaster (its pushes) once healthy.
    register = services["register-replica"]
    args = parse_args(register["entrypoint"][1:] + register["command"])
    assert sorted(args.replica) == sorted((r.replica_id, r.address) for r in router.replicas)
    assert all(register["depends_on"][name] == {"condition": "service_healthy"} for name in replicas)
    kvstore = load_service_config("kvstore", COMPOSE / "kvstore.toml")
    assert kvstore.node.advertise_address == f"kvstore:{PORTS['kvstore']}"
    # Where the replicas pool KV, the orchestrator is given the kvstore (as `primerl up` does): it
    # removes the namespace of each old policy version; elsewhere it is not.
    orchestrator_spec = services["orchestrator"]
    [orchestrator_file] = [v.split(":")[0] for v in orchestrator_spec["volumes"] if "/orchestrator.toml" in v]
    env = {k: str(v) for k, v in orchestrator_spec["environment"].items() if k.startswith("PRIMERL_ORCHESTRATOR_")}
    peers = load_service_config("orchestrator", DEPLOY / orchestrator_file, fake_model, env=env).peers
    pooled = [c for c in configs.values() if c.kv_cache_pool.enabled]
    if pooled:
        assert peers.kv_cache_pool == f"kvstore:{PORTS['kvstore']}"
        assert peers.kv_cache_pool_model in {"", *(c.kv_cache_pool.model for c in pooled)}
        assert orchestrator_spec["depends_on"]["kvstore"] == {"condition": "service_healthy"}
    else:
        assert peers.kv_cache_pool is None
    published = [port for spec in services.values() for port in spec.get("ports", [])]
    assert len({p.split(":")[-2] for p in published}) == len(published)  # no host port twice


def _bytes(size: str) -> int:
    number, unit = int(size[:-1]), size[-1].lower()
    return number << {"k": 10, "m": 20, "g": 30}[unit]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_compose_service_has_resource_limits_that_fit_the_demo(shape: str) -> None:
    """Memory, CPU and process limits on every container of every shape; the inference replicas
    get a few GiB (vLLM on CPU, its KV cache up to 4 GiB and the 1 GB /dev/shm), and no container
    asks for more CPUs than the 2-core machines the container test runs on (Docker refuses it)."""
    services = merged_services(SHAPES[shape][0])
    for name, spec in services.items():
        assert {"mem_limit", "cpus", "pids_limit"} <= set(spec), name
        assert _bytes(spec["mem_limit"]) >= 256 << 20 and 0 < spec["cpus"] <= 2 and spec["pids_limit"] >= 128, name
        if spec["image"].startswith(("primerl-inference:", "primerl-trainer:")):
            assert _bytes(spec["mem_limit"]) >= 6 << 30 and spec["pids_limit"] >= 2048, name
