"""deploy/k8s and deploy/k8s-shapes as the deploy tests read them: the objects a kustomization
builds (load_kustomization, without kustomize; kubectl_build, with it where installed), the
Kubernetes schema check, the references between objects, and the deployment shapes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from primerl_launcher.deployment import DeploymentConfig

from .deploy_helpers import (
    DEPLOY,
    IN_CI,
    env_file,
)

K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.32"

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def strategic_merge(base: object, patch: object) -> object:
    """A strategic merge patch as kustomize applies the ones used here: mappings key by key,
    lists of named items (containers, env) item by name, other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base[k], v) if k in base else v for k, v in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(i, dict) and "name" in i for i in [*base, *patch]):
        merged = {item["name"]: item for item in base}
        for item in patch:
            merged[item["name"]] = strategic_merge(merged[item["name"]], item) if item["name"] in merged else item
        return list(merged.values())
    return patch


def load_kustomization(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` builds, without kustomize: the resources (files,
    or folders of another kustomization), the generated ConfigMaps (named without the content
    hash), strategic merge patches, replica counts, the namespace and the image tags."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for resource in kustomization["resources"]:
        if (directory / resource).is_dir():
            objects += load_kustomization((directory / resource).resolve())
            continue
        objects += [doc for doc in yaml.safe_load_all((directory / resource).read_text()) if doc]
    for patch in kustomization.get("patches", []):
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            [index] = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) ==
                       (doc["kind"], doc["metadata"]["name"])]  # fmt: skip
            objects[index] = strategic_merge(objects[index], doc)
    for count in kustomization.get("replicas", []):
        [workload] = [o for o in objects if o["kind"] in WORKLOAD_KINDS and o["metadata"]["name"] == count["name"]]
        workload["spec"]["replicas"] = count["count"]
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


def kubectl_build(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` builds; a skip where kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


def unhashed(name: str) -> str:
    """A generated object's name without the content hash kustomize appends."""
    return re.sub(r"-[a-z0-9]{10}$", "", name)


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


def mounted_config(workload: dict, config_maps: dict[str, dict], service: str) -> str:
    for volume in pod_spec(workload).get("volumes", []):
        if "configMap" in volume and volume["configMap"]["name"] == f"{service.replace('_', '-')}-config":
            return config_maps[volume["configMap"]["name"]]["data"][f"{service}.toml"]
    raise AssertionError(f"{workload['metadata']['name']} mounts no {service} config")


SHAPES_DIR = DEPLOY / "k8s-shapes"
# Shape -> the kustomization that deploys it, and the shape (replica counts as it sets them).
SHAPES = {
    "single": (SHAPES_DIR / "single", DeploymentConfig()),
    "replicas": (K8S, DeploymentConfig(shape="replicas", replicas=2)),
    "disaggregated": (SHAPES_DIR / "disaggregated", DeploymentConfig(shape="disaggregated", prefill=1, decode=1)),
}
