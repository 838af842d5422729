"""deploy/k8s-shapes, checked offline: each deployment shape's kustomization gives the
replicas, router and KV pool of that shape (as primerl_launcher's DeploymentConfig says), and
the prefill group is the inference StatefulSet but for its name, role and pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from . import k8s_manifests as k8s
from .deploy_helpers import (
    PORTS,
    load_service_config,
)

fake_model = deploy_helpers.fake_model  # a fixture of the deploy tests


def inference_groups(objects: list[dict], fake_model: Path, tmp_path: Path) -> dict[str, tuple[dict, object]]:
    """Each inference StatefulSet with the config its pods run (its ConfigMap and env)."""
    config_maps = k8s.by_kind(objects, "ConfigMap")
    groups = {}
    for name, workload in k8s.by_kind(objects, "StatefulSet").items():
        container = k8s.pod_spec(workload)["containers"][0]
        if not container["image"].startswith("primerl-inference"):
            continue
        toml = tmp_path / f"{name}.toml"
        toml.write_text(k8s.mounted_config(workload, config_maps, "inference"))
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("PRIMERL_INFERENCE_")}
        env.pop("PRIMERL_INFERENCE_REPLICA__ID")  # $(POD_NAME)
        groups[name] = (workload, load_service_config("inference", toml, fake_model, env=env))
    return groups


def deployed_config(objects: list[dict], service: str, tmp_path: Path, model: Path | None = None):
    """The config the pods of a service's Deployment run: its mounted ConfigMap and the
    PRIMERL_<SERVICE>_ variables of its container."""
    workload = k8s.by_kind(objects, "Deployment")[service]
    toml = tmp_path / f"{service}.toml"
    toml.write_text(k8s.mounted_config(workload, k8s.by_kind(objects, "ConfigMap"), service))
    prefix = f"PRIMERL_{service.upper()}_"
    container = k8s.pod_spec(workload)["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if e["name"].startswith(prefix)}
    return load_service_config(service, toml, model, env=env)


@pytest.mark.parametrize("shape", k8s.SHAPES)
def test_each_deployment_shape_gives_the_replicas_router_and_pool_of_that_shape(
    shape: str, fake_model: Path, tmp_path: Path
) -> None:
    directory, deployment = k8s.SHAPES[shape]
    objects = k8s.load_kustomization(directory)
    assert k8s.reference_errors(objects) == []
    groups = inference_groups(objects, fake_model, tmp_path)
    replicas = sorted(
        (config.replica.role, config.kv_cache_pool.enabled)
        for workload, config in groups.values()
        for _ in range(workload["spec"]["replicas"])
    )
    assert replicas == sorted((r.role, r.kv_pool) for r in deployment.layout())
    services = k8s.by_kind(objects, "Service")
    for name, (workload, config) in groups.items():
        if config.kv_cache_pool.enabled:
            assert config.kv_cache_pool.metadata_address == f"kvstore:{PORTS['kvstore']}"
        # Each pod registers itself with the router in its group's role, at its headless Service's name.
        sidecar = next(c for c in k8s.pod_spec(workload)["containers"] if c["name"] == "register")
        args = parse_args(sidecar["args"])
        assert args.role == config.replica.role
        assert args.replica == [("$(POD_NAME)", f"$(POD_NAME).{workload['spec']['serviceName']}:{PORTS['inference']}")]
        selected = [w for w in groups.values() if services[workload["spec"]["serviceName"]]["spec"]["selector"].items()
                    <= w[0]["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert [w[0]["metadata"]["name"] for w in selected] == [name]  # one group per headless Service
    assert deployed_config(objects, "router", tmp_path).routing.disaggregate == deployment.disaggregate
    assert deployed_config(objects, "kvstore", tmp_path).node.advertise_address == f"kvstore:{PORTS['kvstore']}"
    # Where the replicas pool KV, the orchestrator is given the kvstore (as `primerl up` does): it
    # removes the namespace of each old policy version; elsewhere it is not.
    peers = deployed_config(objects, "orchestrator", tmp_path, fake_model).peers
    pooled = [config for _, config in groups.values() if config.kv_cache_pool.enabled]
    if pooled:
        assert peers.kv_cache_pool == f"kvstore:{PORTS['kvstore']}"
        assert peers.kv_cache_pool_model in {"", *(config.kv_cache_pool.model for config in pooled)}
    else:
        assert peers.kv_cache_pool is None
    k8s.need_kubernetes_validate()
    assert k8s.schema_errors(objects) == []


def test_the_prefill_group_is_the_inference_statefulset_but_for_its_name_role_and_pool() -> None:
    """inference-prefill.yaml is a copy of inference.yaml: nothing else may differ."""
    base = {(o["kind"], o["metadata"]["name"]): o for o in k8s.load_kustomization(k8s.K8S)}
    shaped = {(o["kind"], o["metadata"]["name"]): o for o in k8s.load_kustomization(k8s.SHAPES["disaggregated"][0])}
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
    directory = k8s.SHAPES[shape][0]
    objects = k8s.kubectl_build(directory)
    ours = k8s.load_kustomization(directory)

    def keyed(objs: list[dict]) -> dict[tuple[str, str], dict]:
        return {(o["kind"], k8s.unhashed(o["metadata"]["name"])): o for o in objs}

    theirs, mine = keyed(objects), keyed(ours)
    assert set(theirs) == set(mine)
    for key in mine:
        if key[0] in k8s.WORKLOAD_KINDS:
            # Same replicas, labels, env and args (ConfigMap names carry kustomize's hash there).
            assert theirs[key]["spec"]["replicas"] == mine[key]["spec"]["replicas"], key
            assert theirs[key]["spec"]["selector"] == mine[key]["spec"]["selector"], key
            for a, b in zip(k8s.containers_of(theirs[key]), k8s.containers_of(mine[key]), strict=True):
                env_a, env_b = (sorted(c.get("env", []), key=lambda e: e["name"]) for c in (a, b))
                assert (env_a, a.get("args"), a["image"]) == (env_b, b.get("args"), b["image"]), key
            assert theirs[key]["metadata"].get("namespace") == mine[key]["metadata"].get("namespace"), key
