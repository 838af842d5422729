"""Mutual TLS as deployed: the container health probe speaks it, every shipped deployment
requires it, and a local `primerl up` run says plaintext unless its launch file gives TLS."""

from __future__ import annotations

import pytest

from primerl_common.config import TlsConfig
from tests.security_attacks import (
    REPO,
    served,
    service_tls,
)

# --- deployment -----------------------------------------------------------------------------


async def test_the_container_health_probe_speaks_mutual_tls(certs):
    """deploy/docker/grpc_healthcheck.py (the images' HEALTHCHECK, the Kubernetes probes) with
    the identity PRIMERL_TLS_* names; without it the mTLS server refuses it."""
    import asyncio
    import os
    import sys

    from primerl_router.config import RouterConfig
    from primerl_router.server import build

    config = RouterConfig(server={"host": "127.0.0.1", "port": 0}, tls=service_tls(certs, "router"))
    async with served(await build(config), config, certs) as target:
        port = target.address.rpartition(":")[2]
        script = str(REPO / "deploy" / "docker" / "grpc_healthcheck.py")
        plain_env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMERL_")}
        tls_env = {
            **plain_env,
            "PRIMERL_TLS_MODE": "mtls",
            "PRIMERL_TLS_CERT": str(certs / "router.pem"),
            "PRIMERL_TLS_KEY": str(certs / "router-key.pem"),
            "PRIMERL_TLS_CA": str(certs / "ca.pem"),
        }
        results = []
        for env in (tls_env, plain_env):
            probe = await asyncio.create_subprocess_exec(
                sys.executable, script, port, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await probe.communicate()
            results.append((probe.returncode, (out + err).decode()))
    assert results[0][0] == 0 and "SERVING" in results[0][1], results
    assert results[1][0] == 1, results


@pytest.mark.parametrize("deployment", ["compose", "systemd/etc", "k8s/config", "slurm/config"])
def test_every_shipped_deployment_requires_mutual_tls(deployment):
    import tomllib

    configs = sorted((REPO / "deploy" / deployment).glob("*.toml"))
    # One per service, and more where a deployment shape has its own (compose's router-*.toml).
    services = ("trainer", "orchestrator", "inference", "router", "weight_broadcaster", "kvstore")
    assert {name for name in services if any(path.stem.startswith(name) for path in configs)} == set(services)
    for path in configs:
        tls = TlsConfig(**tomllib.loads(path.read_text())["tls"])
        assert tls.mode == "mtls" and None not in (tls.cert, tls.key, tls.ca), path


def test_a_local_run_of_primerl_up_says_plaintext_unless_the_launch_file_gives_tls(tmp_path):
    from primerl_launcher.spec import ServiceSpec
    from primerl_launcher.wiring import wire

    given = {"mode": "mtls", "cert": "c.pem", "key": "k.pem", "ca": "ca.pem"}
    services = {
        "router": ServiceSpec("router", "router", {}, "[router]"),
        "kvstore": ServiceSpec("kvstore", "kvstore", {"tls": dict(given)}, "[kvstore]"),
    }
    wire(services, run_dir=tmp_path, model=None, host="127.0.0.1")
    assert services["router"].table["tls"] == {"mode": "plaintext"}
    assert services["kvstore"].table["tls"] == given
