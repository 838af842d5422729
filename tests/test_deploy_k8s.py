"""deploy/k8s, checked offline: every object of the kustomization against the Kubernetes
JSON schemas (kubernetes-validate, strict: unknown fields are errors), and the references
between objects: selectors, named ports, probes, ConfigMaps, PVCs, addresses in the
configs, drain time; every config loads with its service's config class."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from .deploy_helpers import (
    DEPLOY,
    IN_CI,
    PORTS,
    SERVICES,
    drain_s,
    env_file,
    launcher_scripts,
    load_service_config,
)

fake_model = deploy_helpers.fake_model  # a fixture of the deploy tests

K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.32"

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
                # primerl-healthcheck PORT (a gRPC probe of the kubelet cannot show a client certificate)
                command = container.get(probe, {}).get("exec", {}).get("command", [])
                port = int(command[1]) if command[:1] == ["primerl-healthcheck"] else None
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
