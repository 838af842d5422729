"""deploy/systemd, checked offline: `systemd-analyze verify` on every unit (over a
temporary root in which the install prefix holds the console scripts), and what each
unit promises (drain time, hardening, its config file, which loads with its service's
config class); each deployment shape (etc/, or a folder of shapes/ laid over it) lists the
replicas, roles, pool and router of that shape as the launcher lays it out."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from primerl_launcher.deployment import DeploymentConfig
from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from .deploy_helpers import (
    DEPLOY,
    SERVICES,
    console_scripts,
    drain_s,
    env_file,
    load_service_config,
    tool,
)

fake_model = deploy_helpers.fake_model  # a fixture of the deploy tests

SYSTEMD = DEPLOY / "systemd"
UNITS = [*sorted(p.name for p in SYSTEMD.glob("*.service")), "primerl.target"]
SERVICE_UNITS = {
    "orchestrator": "primerl-orchestrator.service",
    "trainer": "primerl-trainer.service",
    "inference": "primerl-inference@.service",
    "router": "primerl-router.service",
    "weight_broadcaster": "primerl-weight-broadcaster.service",
    "kvstore": "primerl-kvstore.service",
}
PREFIX = "/opt/primerl/bin/"


def unit_entries(path: Path) -> dict[str, list[str]]:
    """key -> values, over all sections (systemd allows most keys more than once)."""
    entries: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            entries.setdefault(key.strip(), []).append(value.strip())
    return entries


def host_unit_dir() -> Path:
    for candidate in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(candidate, "sysinit.target").exists():
            return Path(candidate)
    pytest.fail("systemd-analyze is installed but its units (sysinit.target, ...) are not")


@pytest.fixture
def systemd_root(tmp_path: Path) -> Path:
    """A file system root for `systemd-analyze verify --root`: systemd's own units, ours, and the
    install prefix with a stub for every console script of primerl-common and the services (and
    torchrun), so that an ExecStart naming anything else is reported as not executable."""
    root = tmp_path / "root"
    shutil.copytree(host_unit_dir(), root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for name in UNITS:
        shutil.copy(SYSTEMD / name, units / name)
    bin_dir = root / PREFIX.strip("/")
    bin_dir.mkdir(parents=True)
    for name in console_scripts() | {"torchrun"}:
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    return root


def verify_units(root: Path, units: list[str]) -> subprocess.CompletedProcess[str]:
    analyze = tool("systemd-analyze", "Debian package systemd")
    return subprocess.run(
        [analyze, "verify", f"--root={root}", "--man=no", "--generators=no", *units],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_systemd_analyze_verify_is_silent_on_every_unit(systemd_root: Path) -> None:
    units = [u.replace("@.service", "@0.service") for u in UNITS]  # a template is verified as an instance
    result = verify_units(systemd_root, units)
    # verify exits 0 on many complaints (unknown keys, bad values): any output is a failure.
    assert result.returncode == 0 and not result.stdout and not result.stderr, result.stdout + result.stderr


def test_systemd_analyze_verify_catches_a_broken_unit(systemd_root: Path) -> None:
    """The check above can fail: a typo'd key and a missing binary are both reported."""
    unit = systemd_root / "etc/systemd/system/primerl-router.service"
    unit.write_text(
        unit.read_text()
        .replace("Restart=on-failure", "Restart=on-failure\nRestrt=always")
        .replace("bin/primerl-router", "bin/primerl-routr")
    )
    result = verify_units(systemd_root, ["primerl-router.service"])
    output = result.stdout + result.stderr
    assert "Restrt" in output and "primerl-routr" in output, output


@pytest.mark.parametrize("service", SERVICES)
def test_systemd_unit_runs_its_service_as_documented(service: str, fake_model: Path) -> None:
    unit = SERVICE_UNITS[service]
    entries = unit_entries(SYSTEMD / unit)
    one = {key: values[-1] for key, values in entries.items()}
    exec_start = one["ExecStart"].split()
    binary = exec_start[0]
    assert binary.startswith(PREFIX)
    if service == "trainer":
        assert exec_start[:4] == [f"{PREFIX}torchrun", "--standalone", "-m", "primerl_trainer"]
    else:
        assert (
            binary == f"{PREFIX}primerl-{service.replace('_', '-')}"
            and binary.removeprefix(PREFIX) in console_scripts()
        )
    assert exec_start[-2:] == ["-c", f"/etc/primerl/{service}.toml"]
    assert f"-/etc/primerl/{service}.env" in entries["EnvironmentFile"]
    assert one["User"] == one["Group"] == "primerl"
    assert one["KillSignal"] == "SIGTERM" and one["KillMode"] == "mixed"
    assert one["Restart"] == "on-failure"
    assert one["Type"] == "exec"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert one[key] == value, key
    assert one["WorkingDirectory"] == f"/var/lib/primerl/{service}"
    assert one["StateDirectory"] == f"primerl/{service}"
    assert one["PartOf"] == "primerl.target"
    assert one["WantedBy"] == "primerl.target"

    # The example config of /etc/primerl loads, and the unit waits for its drain.
    env = env_file(SYSTEMD / "etc/inference@0.env") if service == "inference" else {}
    config = load_service_config(service, SYSTEMD / "etc" / f"{service}.toml", fake_model, env)
    stop_s = float(one["TimeoutStopSec"])
    assert stop_s > drain_s(config) + 30
    if service == "trainer":
        shutdown = dict(e.split("=", 1) for v in entries["Environment"] for e in v.split())
        assert drain_s(config) < float(shutdown["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < stop_s


def test_systemd_inference_template_gives_each_instance_its_gpu_and_port() -> None:
    entries = unit_entries(SYSTEMD / "primerl-inference@.service")
    assert "CUDA_VISIBLE_DEVICES=%i" in entries["Environment"]
    assert "/etc/primerl/inference@%i.env" in entries["EnvironmentFile"]
    ports = {}
    for path in sorted((SYSTEMD / "etc").glob("inference@*.env")):
        values = env_file(path)
        ports[values["PRIMERL_INFERENCE_REPLICA__ID"]] = int(values["PRIMERL_INFERENCE_SERVER__PORT"])
    assert len(set(ports.values())) == len(ports) >= 2
    # The router of the example lists exactly these replicas, at these ports.
    router = tomllib.loads((SYSTEMD / "etc/router.toml").read_text())
    listed = {replica_id: f"localhost:{port}" for replica_id, port in ports.items()}
    assert {r["replica_id"]: r["address"] for r in router["replicas"]} == listed
    # ... and so does the registration with the broadcaster.
    register = env_file(SYSTEMD / "etc/register-replicas.env")
    assert register["REPLICAS"].split() == [f"--replica={i}={a}" for i, a in listed.items()]
    assert register["BROADCASTER"] == router["versions"]["weight_broadcaster_address"]
    unit = unit_entries(SYSTEMD / "primerl-register-replicas.service")
    exec_start = unit["ExecStart"][0].split()
    assert exec_start == [f"{PREFIX}primerl-register-replicas", "--broadcaster", "${BROADCASTER}", "$REPLICAS"]
    # What the unit runs, with the variables expanded, is a valid command line.
    parse_args(["--broadcaster", register["BROADCASTER"], *register["REPLICAS"].split()])


def test_systemd_target_and_user() -> None:
    target = unit_entries(SYSTEMD / "primerl.target")
    assert target["WantedBy"] == ["multi-user.target"]
    assert "u primerl - " in (SYSTEMD / "primerl.sysusers.conf").read_text()


# ---------------------------------------------------------------------------- deployment shapes

# Shape -> the folder laid over etc/ (None: etc/ alone) and the shape it deploys.
SHAPES = {
    "single": (SYSTEMD / "shapes/single", DeploymentConfig()),
    "replicas": (None, DeploymentConfig(shape="replicas", replicas=2)),
    "disaggregated": (SYSTEMD / "shapes/disaggregated", DeploymentConfig(shape="disaggregated", prefill=1, decode=1)),
}


def installed_etc(overlay: Path | None) -> dict[str, Path]:
    """/etc/primerl as the README installs it: etc/, then the shape's folder over it."""
    files = {path.name: path for path in (SYSTEMD / "etc").iterdir()}
    if overlay is not None:
        files |= {path.name: path for path in overlay.iterdir()}
    return files


@pytest.mark.parametrize("shape", SHAPES)
def test_each_deployment_shape_gives_the_replicas_router_and_pool_of_that_shape(shape: str, fake_model: Path) -> None:
    overlay, deployment = SHAPES[shape]
    etc = installed_etc(overlay)
    router = load_service_config("router", etc["router.toml"])
    # The instances the router lists are the ones enabled (one inference@N.env each).
    instances = {}
    for replica in router.replicas:
        env_files = [p for n, p in etc.items() if n.startswith("inference@") and n.endswith(".env")]
        [path] = [p for p in env_files if env_file(p)["PRIMERL_INFERENCE_REPLICA__ID"] == replica.replica_id]
        config = load_service_config("inference", etc["inference.toml"], fake_model, env_file(path))
        assert replica.address == f"localhost:{config.server.port}" and replica.role == config.replica.role
        if config.kv_cache_pool.enabled:
            kvstore = load_service_config("kvstore", etc["kvstore.toml"])
            assert config.kv_cache_pool.metadata_address == f"localhost:{kvstore.server.port}"
        instances[replica.replica_id] = config
    replicas = sorted((c.replica.role, c.kv_cache_pool.enabled) for c in instances.values())
    assert replicas == sorted((r.role, r.kv_pool) for r in deployment.layout())
    assert router.routing.disaggregate == deployment.disaggregate
    register = env_file(etc["register-replicas.env"])
    assert sorted(register["REPLICAS"].split()) == sorted(
        f"--replica={r.replica_id}={r.address}" for r in router.replicas
    )
    # Where the replicas pool KV, the orchestrator is given the kvstore (as `primerl up` does): it
    # removes the namespace of each old policy version; elsewhere it is not. Its unit reads the
    # optional /etc/primerl/orchestrator.env.
    assert "-/etc/primerl/orchestrator.env" in unit_entries(SYSTEMD / SERVICE_UNITS["orchestrator"])["EnvironmentFile"]
    env = env_file(etc["orchestrator.env"]) if "orchestrator.env" in etc else {}
    peers = load_service_config("orchestrator", etc["orchestrator.toml"], fake_model, env).peers
    pooled = [c for c in instances.values() if c.kv_cache_pool.enabled]
    if pooled:
        kvstore = load_service_config("kvstore", etc["kvstore.toml"])
        assert peers.kv_cache_pool == f"localhost:{kvstore.server.port}"
        assert peers.kv_cache_pool_model in {"", *(c.kv_cache_pool.model for c in pooled)}
    else:
        assert peers.kv_cache_pool is None


def _bytes(size: str) -> int:
    return int(size[:-1]) << {"K": 10, "M": 20, "G": 30, "T": 40}[size[-1]]


@pytest.mark.parametrize("unit", [u for u in UNITS if u.endswith(".service")])
def test_systemd_unit_bounds_its_memory_tasks_and_files(unit: str) -> None:
    """Every service unit: MemoryHigh below MemoryMax (throttled before it is killed), a TasksMax
    and a LimitNOFILE, each given once."""
    entries = unit_entries(SYSTEMD / unit)
    for key in ("MemoryHigh", "MemoryMax", "TasksMax", "LimitNOFILE"):
        assert len(entries.get(key, [])) == 1, (unit, key)
    [high], [most] = entries["MemoryHigh"], entries["MemoryMax"]
    assert 0 < _bytes(high) < _bytes(most), unit
    assert int(entries["TasksMax"][0]) >= 128 and int(entries["LimitNOFILE"][0]) >= 1024, unit
    if unit.startswith(("primerl-inference", "primerl-trainer")):  # vLLM and torch: many threads
        assert _bytes(most) >= 32 << 30 and int(entries["TasksMax"][0]) >= 4096, unit
