"""deploy/k8s's NetworkPolicies, checked offline against the services' permission tables:
each service admits exactly the pods of the roles its RPCs name, in every deployment shape."""

from __future__ import annotations

import pytest
import yaml

from primerl_launcher.register_replicas import parse_args

from .deploy_helpers import (
    DEPLOY,
    PORTS,
    SEALED_PORTS,
    SERVICES,
)
from .k8s_manifests import K8S, SHAPES, WORKLOAD_KINDS, by_kind, containers_of, load_kustomization


@pytest.fixture(scope="module")
def k8s_objects() -> list[dict]:
    return load_kustomization(K8S)


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
