"""deploy/k8s, checked offline: every object of the kustomization against the Kubernetes
JSON schemas (kubernetes-validate, strict: unknown fields are errors), and the references
between objects: selectors, named ports, probes, ConfigMaps, PVCs, addresses in the
configs, drain time; every config loads with its service's config class."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from .deploy_helpers import (
    DEPLOY,
    PORTS,
    SERVICES,
    drain_s,
    launcher_scripts,
    load_service_config,
)
from .k8s_manifests import (
    K8S,
    WORKLOAD_KINDS,
    by_kind,
    containers_of,
    kubectl_build,
    load_kustomization,
    mounted_config,
    need_kubernetes_validate,
    pod_spec,
    reference_errors,
    schema_errors,
    unhashed,
)

fake_model = deploy_helpers.fake_model  # a fixture of the deploy tests


@pytest.fixture(scope="module")
def k8s_objects() -> list[dict]:
    return load_kustomization(K8S)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    generated = [f for g in kustomization["configMapGenerator"] for f in g.get("files", []) + g.get("envs", [])]
    assert {p.relative_to(K8S).as_posix() for p in (K8S / "config").iterdir()} <= set(generated)
    images = {f"primerl-{s.replace('_', '-')}" for s in SERVICES} | {"primerl-tools"}
    assert images == {i["name"] for i in kustomization["images"]}


def test_k8s_objects_match_the_kubernetes_schemas(k8s_objects: list[dict]) -> None:
    need_kubernetes_validate()
    assert schema_errors(k8s_objects) == []


def test_k8s_schema_check_catches_a_bad_field(k8s_objects: list[dict]) -> None:
    need_kubernetes_validate()
    broken = yaml.safe_load(yaml.safe_dump(by_kind(k8s_objects, "StatefulSet")["inference"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["prot"] = 50053
    broken["spec"]["replicas"] = "two"
    errors = schema_errors([broken])
    assert len(errors) == 1 and ("prot" in errors[0] or "two" in errors[0]), errors
    del broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["prot"]
    assert "two" in schema_errors([broken])[0]


def test_kubectl_kustomize_builds_the_same_objects(k8s_objects: list[dict]) -> None:
    """When kubectl is at hand, its own kustomize build is schema-checked too, and holds the same
    objects as the build above (generated names carry a content hash there)."""
    objects = kubectl_build(K8S)
    need_kubernetes_validate()
    assert schema_errors(objects) == []

    def names(objs: list[dict]) -> set[tuple[str, str]]:
        return {(o["kind"], unhashed(o["metadata"]["name"])) for o in objs}

    assert names(objects) == names(k8s_objects)


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
        assert container[probe]["exec"]["command"] == ["primerl-healthcheck", str(PORTS[service])]
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


def test_k8s_register_sidecar_runs_the_installed_command(k8s_objects: list[dict]) -> None:
    """The inference pods' sidecar runs primerl-register-replicas from the tools image's venv (no
    service image has it), with arguments the command accepts: each pod registers itself with the
    broadcaster and the router."""
    venv = re.search(r"VIRTUAL_ENV=(\S+)", (DEPLOY / "docker" / "Dockerfile").read_text()).group(1)
    inference = pod_spec(by_kind(k8s_objects, "StatefulSet")["inference"])
    sidecar = next(c for c in inference["containers"] if c["name"] == "register")
    assert sidecar["image"] == "primerl-tools:latest"
    assert sidecar["command"] == [f"{venv}/bin/primerl-register-replicas"]
    assert "primerl-register-replicas" in launcher_scripts()
    args = parse_args(sidecar["args"])
    assert args.broadcaster == f"weight-broadcaster:{PORTS['weight_broadcaster']}"
    assert args.router == f"router:{PORTS['router']}"
    assert args.replica == [("$(POD_NAME)", f"$(POD_NAME).inference:{PORTS['inference']}")]
    assert not args.once  # a loop: it re-registers with restarted peers, deregisters on SIGTERM
    # POD_NAME, and the operator's certificate (PRIMERL_TLS_*): registering is an operator's call
    assert {e["name"] for e in sidecar["env"]} - {"POD_NAME"} == {
        f"PRIMERL_TLS_{k}" for k in ("MODE", "CERT", "KEY", "CA")
    }
