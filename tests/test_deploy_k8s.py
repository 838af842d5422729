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

from primerl_launcher.deployment import DeploymentConfig
from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from .deploy_helpers import (
    DEPLOY,
    IN_CI,
    PORTS,
    SEALED_PORTS,
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


# ---------------------------------------------------------------------------- deployment shapes

SHAPES_DIR = DEPLOY / "k8s-shapes"
# Shape -> the kustomization that deploys it, and the shape (replica counts as it sets them).
SHAPES = {
    "single": (SHAPES_DIR / "single", DeploymentConfig()),
    "replicas": (K8S, DeploymentConfig(shape="replicas", replicas=2)),
    "disaggregated": (SHAPES_DIR / "disaggregated", DeploymentConfig(shape="disaggregated", prefill=1, decode=1)),
}


def inference_groups(objects: list[dict], fake_model: Path, tmp_path: Path) -> dict[str, tuple[dict, object]]:
    """Each inference StatefulSet with the config its pods run (its ConfigMap and env)."""
    config_maps = by_kind(objects, "ConfigMap")
    groups = {}
    for name, workload in by_kind(objects, "StatefulSet").items():
        container = pod_spec(workload)["containers"][0]
        if not container["image"].startswith("primerl-inference"):
            continue
        toml = tmp_path / f"{name}.toml"
        toml.write_text(mounted_config(workload, config_maps, "inference"))
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("PRIMERL_INFERENCE_")}
        env.pop("PRIMERL_INFERENCE_REPLICA__ID")  # $(POD_NAME)
        groups[name] = (workload, load_service_config("inference", toml, fake_model, env=env))
    return groups


@pytest.mark.parametrize("shape", SHAPES)
def test_each_deployment_shape_gives_the_replicas_router_and_pool_of_that_shape(
    shape: str, fake_model: Path, tmp_path: Path
) -> None:
    directory, deployment = SHAPES[shape]
    objects = load_kustomization(directory)
    assert reference_errors(objects) == []
    groups = inference_groups(objects, fake_model, tmp_path)
    replicas = sorted(
        (config.replica.role, config.kv_cache_pool.enabled)
        for workload, config in groups.values()
        for _ in range(workload["spec"]["replicas"])
    )
    assert replicas == sorted((r.role, r.kv_pool) for r in deployment.layout())
    services = by_kind(objects, "Service")
    for name, (workload, config) in groups.items():
        if config.kv_cache_pool.enabled:
            assert config.kv_cache_pool.metadata_address == f"kvstore:{PORTS['kvstore']}"
        # Each pod registers itself with the router in its group's role, at its headless Service's name.
        sidecar = next(c for c in pod_spec(workload)["containers"] if c["name"] == "register")
        args = parse_args(sidecar["args"])
        assert args.role == config.replica.role
        assert args.replica == [("$(POD_NAME)", f"$(POD_NAME).{workload['spec']['serviceName']}:{PORTS['inference']}")]
        selected = [w for w in groups.values() if services[workload["spec"]["serviceName"]]["spec"]["selector"].items()
                    <= w[0]["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert [w[0]["metadata"]["name"] for w in selected] == [name]  # one group per headless Service
    router = by_kind(objects, "Deployment")["router"]
    toml = tmp_path / "router.toml"
    toml.write_text(mounted_config(router, by_kind(objects, "ConfigMap"), "router"))
    env = {
        e["name"]: e["value"]
        for e in pod_spec(router)["containers"][0]["env"]
        if e["name"].startswith("PRIMERL_ROUTER_")
    }
    assert load_service_config("router", toml, env=env).routing.disaggregate == deployment.disaggregate
    kvstore_toml = tmp_path / "kvstore.toml"
    kvstore_toml.write_text(
        mounted_config(by_kind(objects, "Deployment")["kvstore"], by_kind(objects, "ConfigMap"), "kvstore")
    )
    assert load_service_config("kvstore", kvstore_toml).node.advertise_address == f"kvstore:{PORTS['kvstore']}"
    # Where the replicas pool KV, the orchestrator is given the kvstore (as `primerl up` does): it
    # removes the namespace of each old policy version; elsewhere it is not.
    orchestrator = by_kind(objects, "Deployment")["orchestrator"]
    toml = tmp_path / "orchestrator.toml"
    toml.write_text(mounted_config(orchestrator, by_kind(objects, "ConfigMap"), "orchestrator"))
    env = {
        e["name"]: e["value"]
        for e in pod_spec(orchestrator)["containers"][0]["env"]
        if e["name"].startswith("PRIMERL_ORCHESTRATOR_")
    }
    peers = load_service_config("orchestrator", toml, fake_model, env=env).peers
    pooled = [config for _, config in groups.values() if config.kv_cache_pool.enabled]
    if pooled:
        assert peers.kv_cache_pool == f"kvstore:{PORTS['kvstore']}"
        assert peers.kv_cache_pool_model in {"", *(config.kv_cache_pool.model for config in pooled)}
    else:
        assert peers.kv_cache_pool is None
    need_kubernetes_validate()
    assert schema_errors(objects) == []


def test_the_prefill_group_is_the_inference_statefulset_but_for_its_name_role_and_pool() -> None:
    """inference-prefill.yaml is a copy of inference.yaml: nothing else may differ."""
    base = {(o["kind"], o["metadata"]["name"]): o for o in load_kustomization(K8S)}
    shaped = {(o["kind"], o["metadata"]["name"]): o for o in load_kustomization(SHAPES["disaggregated"][0])}
    extra_env = ("PRIMERL_INFERENCE_REPLICA__ROLE", "PRIMERL_INFERENCE_KV_CACHE_POOL__ENABLED",
                 "PRIMERL_INFERENCE_KV_CACHE_POOL__METADATA_ADDRESS")  # fmt: skip

    def as_base(value: object) -> object:
        if isinstance(value, dict):
            items = {k: as_base(v) for k, v in value.items() if k != "primerl.io/role"}
            if "env" in items:
                items["env"] = [e for e in items["env"] if e["name"] not in extra_env]
            return items
        if isinstance(value, list):
            return [as_base(v) for v in value if v != "--role=prefill"]
        return value.replace("inference-prefill", "inference") if isinstance(value, str) else value

    for kind in ("StatefulSet", "Service"):
        prefill, inference = as_base(shaped[kind, "inference-prefill"]), base[kind, "inference"]
        if kind == "StatefulSet":  # the replica count is the shape's
            prefill["spec"]["replicas"] = inference["spec"]["replicas"]
        assert prefill == inference, kind


@pytest.mark.parametrize("shape", ["single", "disaggregated"])
def test_kubectl_kustomize_builds_each_shape_the_same(shape: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    directory = SHAPES[shape][0]
    built = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    )
    objects = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    ours = load_kustomization(directory)

    def keyed(objs: list[dict]) -> dict[tuple[str, str], dict]:
        return {(o["kind"], re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"])): o for o in objs}

    theirs, mine = keyed(objects), keyed(ours)
    assert set(theirs) == set(mine)
    for key in mine:
        if key[0] in WORKLOAD_KINDS:
            # Same replicas, labels, env and args (ConfigMap names carry kustomize's hash there).
            assert theirs[key]["spec"]["replicas"] == mine[key]["spec"]["replicas"], key
            assert theirs[key]["spec"]["selector"] == mine[key]["spec"]["selector"], key
            for a, b in zip(containers_of(theirs[key]), containers_of(mine[key]), strict=True):
                env_a, env_b = (sorted(c.get("env", []), key=lambda e: e["name"]) for c in (a, b))
                assert (env_a, a.get("args"), a["image"]) == (env_b, b.get("args"), b["image"]), key
            assert theirs[key]["metadata"].get("namespace") == mine[key]["metadata"].get("namespace"), key


# ---------------------------------------------------------------------------- network policies

ROOT = DEPLOY.parent
OPERATOR_LABEL = {"primerl.io/operator": "true"}
# Role -> the pods that carry it (pod labels), and whether they may be in any namespace.
ROLE_PEERS = {
    **{s: ({"app.kubernetes.io/name": f"primerl-{s.replace('_', '-')}"}, False) for s in SERVICES},
    "operator": (OPERATOR_LABEL, False),
    "environment": ({"primerl.io/environment": "true"}, True),
    "tenant": ({"primerl.io/tenant": "true"}, True),
}
# Who calls the methods open to any authenticated caller (security.ANY), from their clients: a
# new ANY method, or a new caller of one, is placed here and in deploy/k8s/network-policy.yaml.
ANY_CALLERS = {
    ("inference", "GetLoad"): {"weight_broadcaster", "operator"},
    ("inference", "WatchLoad"): {"router"},
    ("inference", "ListAdapters"): {"operator"},
    ("kvstore", "GetStats"): {"orchestrator", "inference"},
    ("orchestrator", "GetRunStatus"): {"operator"},
    ("router", "ListReplicas"): {"orchestrator", "operator"},
    ("trainer", "GetStatus"): {"operator"},
    ("trainer", "WatchSteps"): {"orchestrator", "operator"},
    ("weight_broadcaster", "GetStatus"): {"trainer", "orchestrator", "operator"},
    ("weight_broadcaster", "WaitForVersion"): {"orchestrator", "operator"},
    ("weight_broadcaster", "WatchReplicas"): {"router"},
}


def service_roles(service: str) -> dict[str, set[str]]:
    """The ROLES table of a service's server.py, read without importing it: method -> roles
    ({"*"} for security.ANY)."""
    import ast

    [path] = (ROOT / "services" / service / "src").glob("*/server.py")
    module = ast.parse(path.read_text())
    names: dict[str, ast.expr] = {
        target.id: node.value
        for node in module.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    from primerl_common import security

    def roles(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Name):
            return roles(names[node.id])
        if isinstance(node, ast.Attribute):  # security.X
            return set(getattr(security, node.attr)) if node.attr == "ANY" else {getattr(security, node.attr)}
        if isinstance(node, ast.Set):
            return set().union(*(roles(e) for e in node.elts))
        raise AssertionError(f"{path}: cannot read {ast.dump(node)}")

    table = names["ROLES"]
    assert isinstance(table, ast.Dict)
    return {ast.literal_eval(k): roles(v) for k, v in zip(table.keys, table.values, strict=True)}


def callers_of(service: str, roles: dict[str, set[str]]) -> set[str]:
    """The roles whose pods call `service`: those its RPCs name, and the callers of its ANY ones."""
    callers: set[str] = set()
    for method, allowed in roles.items():
        if allowed == {"*"}:
            assert (service, method) in ANY_CALLERS, f"{service}.{method} is open to any caller: who calls it?"
            callers |= ANY_CALLERS[service, method]
        else:
            callers |= allowed
    return callers


def selector_matches(selector: dict, labels: dict) -> bool:
    return set(selector.get("matchLabels", {}).items()) <= set(labels.items()) and not selector.get("matchExpressions")


def peer_key(peer: dict) -> tuple[frozenset, bool]:
    """A `from` entry as (its pod labels, whether it reaches beyond the namespace)."""
    assert set(peer) <= {"podSelector", "namespaceSelector"} and "podSelector" in peer, peer
    return frozenset(peer["podSelector"]["matchLabels"].items()), "namespaceSelector" in peer


def operator_sidecars(objects: list[dict]) -> dict[str, set[tuple[frozenset, bool]]]:
    """service -> the pods whose register sidecar (an operator's call, primerl-register-replicas)
    calls it, from the sidecar's arguments."""
    hosts = {s.replace("_", "-"): s for s in SERVICES}
    peers: dict[str, set[tuple[frozenset, bool]]] = {}
    for obj in objects:
        for container in containers_of(obj):
            if not container.get("command", [""])[0].endswith("primerl-register-replicas"):
                continue
            args = parse_args(container["args"])
            name = obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            for address in (args.router, args.broadcaster):
                peers.setdefault(hosts[address.split(":")[0]], set()).add(
                    (frozenset({"app.kubernetes.io/name": name}.items()), False)
                )
    return peers


def network_policy_errors(objects: list[dict], roles_of: dict[str, dict[str, set[str]]]) -> list[str]:
    """Each service's NetworkPolicy admits to its gRPC port exactly the pods of the roles that call
    it (and the register sidecars that call it as the operator); other rules: Prometheus on the
    port named metrics, and the trainer's pods among themselves (rendezvous and NCCL)."""
    errors: list[str] = []
    policies = by_kind(objects, "NetworkPolicy")
    workloads = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    sidecars = operator_sidecars(objects)
    prometheus = (frozenset({"app.kubernetes.io/name": "prometheus"}.items()), True)
    for service in SERVICES:
        name = service.replace("_", "-")
        policy = policies.get(name)
        if policy is None:
            errors.append(f"{service}: no NetworkPolicy {name}")
            continue
        spec = policy["spec"]
        own = ROLE_PEERS[service][0]
        if spec["podSelector"] != {"matchLabels": own} or spec["policyTypes"] != ["Ingress"]:
            errors.append(f"{name}: selects {spec['podSelector']} ({spec['policyTypes']}), not the {service} pods")

        def named_ports(port_name: str, spec: dict = spec) -> list[int]:  # of the pods it selects
            return [
                port["containerPort"]
                for workload in workloads
                if selector_matches(spec["podSelector"], workload["spec"]["template"]["metadata"]["labels"])
                for container in containers_of(workload)
                for port in container.get("ports", [])
                if port.get("name") == port_name
            ]

        grpc_ports = named_ports("grpc")  # (the trainer's worker pods serve none)
        if not grpc_ports or set(grpc_ports) != {PORTS[service]}:
            errors.append(f"{name}: its pods' ports named grpc are {grpc_ports}, not {PORTS[service]}")
        sealed_ports = set(named_ports("sealed"))
        sealed_port, sealed_method = SEALED_PORTS.get(service, (None, None))
        if sealed_ports != ({sealed_port} if sealed_port else set()):
            errors.append(f"{name}: its pods' ports named sealed are {sealed_ports}, not {sealed_port}")
        callers = callers_of(service, roles_of[service])
        expected = {(frozenset(ROLE_PEERS[r][0].items()), ROLE_PEERS[r][1]) for r in callers}
        expected |= sidecars.get(service, set())
        admitted: set[tuple[frozenset, bool]] = set()
        for rule in spec["ingress"]:
            ports = [p["port"] for p in rule.get("ports", [])]
            peers = {peer_key(peer) for peer in rule["from"]}
            if "grpc" in ports:
                admitted |= peers
            elif ports == ["sealed"]:
                allowed = roles_of[service].get(sealed_method, set()) if sealed_method else set()
                sealed_callers = {(frozenset(ROLE_PEERS[r][0].items()), ROLE_PEERS[r][1]) for r in allowed}
                if not sealed_method or peers != sealed_callers:
                    errors.append(f"{name}: sealed port from {peers}, not the callers of {sealed_method}")
            elif ports == ["metrics"]:
                if peers != {prometheus}:
                    errors.append(f"{name}: metrics from {peers}, not only Prometheus")
            elif not ports:  # every port: only a trainer's own pods (torchrun rendezvous, NCCL)
                if service != "trainer" or peers != {(frozenset(own.items()), False)}:
                    errors.append(f"{name}: every port open to {peers}")
            else:
                errors.append(f"{name}: a rule for ports {ports}")
        if admitted != expected:
            missing, extra = expected - admitted, admitted - expected
            errors.append(
                f"{name}: gRPC callers missing {[dict(m) for m, _ in missing]}, extra {[dict(e) for e, _ in extra]}"
            )
    return errors


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_k8s_each_service_admits_exactly_the_callers_its_roles_name(shape: str) -> None:
    objects = load_kustomization(SHAPES[shape][0])
    assert network_policy_errors(objects, {s: service_roles(s) for s in SERVICES}) == []


def test_k8s_network_policy_check_catches_a_role_change(k8s_objects: list[dict]) -> None:
    roles = {s: service_roles(s) for s in SERVICES}
    assert roles["trainer"]["PushBatch"] == {"orchestrator"}
    # A new caller in a role table that the policy does not admit yet.
    roles["kvstore"]["GetBlocks"] = {"inference", "trainer"}
    errors = network_policy_errors(k8s_objects, roles)
    assert len(errors) == 1 and errors[0].startswith("kvstore: gRPC callers missing") and "trainer" in errors[0]
    # A policy that admits a caller no role names, and a service without one.
    roles = {s: service_roles(s) for s in SERVICES}
    broken = yaml.safe_load(yaml.safe_dump(k8s_objects))
    policies = by_kind(broken, "NetworkPolicy")
    policies["trainer"]["spec"]["ingress"][0]["from"].append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "primerl-router"}}}
    )
    broken.remove(policies["router"])
    errors = network_policy_errors(broken, roles)
    assert any(e.startswith("trainer: gRPC callers missing []") and "primerl-router" in e for e in errors), errors
    assert "router: no NetworkPolicy router" in errors and len(errors) == 2, errors
    # A method open to any caller that nobody placed.
    roles["router"]["NewOpenMethod"] = {"*"}
    with pytest.raises(AssertionError, match=r"router\.NewOpenMethod"):
        network_policy_errors(k8s_objects, roles)
