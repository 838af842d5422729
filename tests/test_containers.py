"""The RL demo in containers, as a user runs it: deploy/docker/build_images.sh builds the
wheelhouse, the shared runtime images, the six service images and the tools image (reusing
every cached layer), then deploy/compose.yaml with deploy/compose/short-run.yaml runs a few RL steps on
the tiny MoE, one container per service. The outcome is read from the services' own APIs
on the ports compose publishes on 127.0.0.1: the orchestrator finished max_steps, the
trainer trained and published every step once, the replica serves the last policy version
and the router sees it; the orchestrator's metrics file has one line per step. Then every
container, the one-shot `model` included, has exited 0 after `compose stop`.

Every channel is mutual TLS, as deployed: the certificates are made with `primerl-certs`
into deploy/certs (kept when there already), and the test calls the services as `operator`.

Needs a Docker engine and compose (`docker compose`, or Debian's docker-compose 1.29):
deploy/docker/ensure_docker.sh installs and starts them and makes the base image.
Without an engine the test is skipped, unless PRIMERL_REQUIRE_DOCKER=1 (then it fails).
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
import pytest

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = pathlib.Path(__file__).resolve().parents[1]
COMPOSE_FILES = [REPO / "deploy" / "compose.yaml", REPO / "deploy" / "compose" / "short-run.yaml"]
# Service -> container port, all published on an ephemeral 127.0.0.1 port.
PORTS = {
    "orchestrator": 50051,
    "trainer": 50052,
    "inference": 50053,
    "router": 50054,
    "weight-broadcaster": 50055,
    "kvstore": 50056,
}
ONE_SHOT = ("model",)
# Long-running containers with a health probe and no published port.
UNPUBLISHED = ("register-replica",)
CERTS = REPO / "deploy" / "certs"
RUN_TIMEOUT_S = 1200.0
T = TypeVar("T")


def _docker_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def _compose_command() -> list[str] | None:
    """`docker compose` (v2) where installed, else Debian's docker-compose (v1): the
    commands used here mean the same in both."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        if subprocess.run([*command, "version"], capture_output=True, timeout=60).returncode == 0:
            return command
    return None


def _missing(reason: str) -> None:
    if os.environ.get("PRIMERL_REQUIRE_DOCKER") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def wait_until(probe: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 1.0) -> T:
    give_up_at = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > give_up_at:
            raise AssertionError(f"gave up after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Compose:
    command: list[str]
    project: str
    env: dict[str, str]

    def run(self, *args: str, timeout_s: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        files = [arg for path in COMPOSE_FILES for arg in ("-f", str(path))]
        result = subprocess.run(
            [*self.command, "-p", self.project, *files, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result

    def address(self, service: str) -> str:
        published = self.run("port", service, str(PORTS[service])).stdout.strip()
        host, _, port = published.rpartition(":")
        assert host == "127.0.0.1" and port.isdigit(), published
        return published

    def containers(self) -> dict[str, dict]:
        """Every container of the project, running or not, by compose service name."""
        ids = subprocess.run(
            ["docker", "ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={self.project}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if not ids:
            return {}
        inspected = json.loads(
            subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True).stdout
        )
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in inspected}


def operator_channel(address: str) -> grpc.Channel:
    """A channel to `address` showing the operator's certificate from deploy/certs."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(CERTS / "ca.pem").read_bytes(),
        private_key=(CERTS / "operator-key.pem").read_bytes(),
        certificate_chain=(CERTS / "operator.pem").read_bytes(),
    )
    return grpc.secure_channel(address, credentials)


@pytest.fixture(scope="module")
def certificates() -> None:
    """deploy/certs as the compose file's comment makes it (a user's own are kept)."""
    if not (CERTS / "operator.pem").exists():
        primerl_certs = pathlib.Path(sys.executable).parent / "primerl-certs"
        subprocess.run([str(primerl_certs), str(CERTS), "--readable-keys"], check=True, timeout=120)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The six service images and primerl-tools, built as a user builds them (only what
    changed is rebuilt)."""
    if not _docker_reachable():
        _missing("no Docker engine answers (deploy/docker/ensure_docker.sh starts one)")
    log = tmp_path_factory.mktemp("build") / "build_images.log"
    start = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(
            [str(REPO / "deploy" / "docker" / "build_images.sh")], stdout=out, stderr=subprocess.STDOUT, timeout=3000
        )
    lines = log.read_text().splitlines()
    print(f"build_images.sh: {time.monotonic() - start:.0f}s; its summary:", *lines[-16:], sep="\n")
    assert result.returncode == 0, "build_images.sh failed:\n" + "\n".join(lines[-60:])


@pytest.fixture(scope="module")
def demo(images: None, certificates: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    command = _compose_command()
    if command is None:
        _missing("no compose: neither `docker compose` nor `docker-compose` (ensure_docker.sh installs one)")
    env = {
        **os.environ,
        # Empty host ports: Docker picks free ones (a demo on this machine keeps 50051-50056).
        **{f"PRIMERL_{service.upper().replace('-', '_')}_PORT": "" for service in PORTS},
        # Quick start-up ordering; each probe costs a Python start, so not quicker.
        "PRIMERL_HEALTHCHECK_INTERVAL": "3s",
    }
    compose = Compose(command, f"primerl-test-{uuid.uuid4().hex[:8]}", env)
    logs = tmp_path_factory.mktemp("compose") / "compose.log"
    try:
        start = time.monotonic()
        # Returns once every container is started, each after what it depends on is
        # healthy or has completed.
        compose.run("up", "--detach", "--no-build", timeout_s=1200)
        print(f"compose up: {time.monotonic() - start:.0f}s")
        yield compose
    finally:
        result = compose.run("logs", "--no-color", "--timestamps", check=False, timeout_s=120)
        logs.write_text(result.stdout + result.stderr)
        print(f"compose logs ({logs}), last lines:", *logs.read_text().splitlines()[-150:], sep="\n")
        compose.run("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False, timeout_s=300)


def test_rl_run_in_containers_trains_every_step_and_stops_cleanly(demo: Compose) -> None:
    start = time.monotonic()

    # Compose returns once the orchestrator is started; the images' health probes say when
    # every service serves.
    def all_healthy() -> bool | None:
        health = {
            service: container["State"].get("Health", {}).get("Status")
            for service, container in demo.containers().items()
            if service not in ONE_SHOT
        }
        assert "unhealthy" not in health.values(), health
        expected = {*PORTS, *UNPUBLISHED}
        return True if set(health) == expected and set(health.values()) == {"healthy"} else None

    wait_until(all_healthy, timeout_s=300, what="every service to report healthy", interval_s=2.0)
    with operator_channel(demo.address("orchestrator")) as channel:
        orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        def finished() -> orchestrator_pb2.GetRunStatusResponse | None:
            status = orchestrator.GetRunStatus(orchestrator_pb2.GetRunStatusRequest(), timeout=30, wait_for_ready=True)
            assert status.state != orchestrator_pb2.RUN_STATE_FAILED, status.error
            return status if status.state == orchestrator_pb2.RUN_STATE_FINISHED else None

        status = wait_until(finished, timeout_s=RUN_TIMEOUT_S, what="the run to finish", interval_s=2.0)
    print(f"run finished: {time.monotonic() - start:.0f}s after compose up")
    max_steps = status.max_steps
    assert max_steps == 3, "deploy/compose/short-run.yaml sets max_steps 3"
    assert status.step == max_steps and not status.error
    assert status.policy_version >= max_steps - 1

    with operator_channel(demo.address("trainer")) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        steps = []
        for response in trainer.WatchSteps(trainer_pb2.WatchStepsRequest(after_step=-1), timeout=60):
            steps.append(response.step)
            if response.step.step >= max_steps:
                break
        trainer_status = trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
    assert [s.step for s in steps] == list(range(1, max_steps + 1))
    for step in steps:
        assert step.metrics["num_samples"] >= 1 and step.metrics["num_loss_tokens"] >= 1, step
        assert step.policy_version == step.step
    assert trainer_status.step == max_steps
    assert trainer_status.published_policy_version == max_steps, trainer_status.last_publish_error

    # The weight broadcaster pushed every version to the replica: it serves the last one.
    with operator_channel(demo.address("inference")) as channel:
        inference = inference_pb2_grpc.InferenceServiceStub(channel)

        def serves_last_version() -> int | None:
            load = inference.GetLoad(inference_pb2.GetLoadRequest(), timeout=10).load
            return load.policy_version if load.policy_version == max_steps else None

        wait_until(serves_last_version, timeout_s=120, what=f"the replica to serve policy version {max_steps}")
        load = inference.GetLoad(inference_pb2.GetLoadRequest(), timeout=10).load
    assert load.num_generated_tokens_total > 0

    # The router routed the rollouts to it and follows its version. (Its error count may
    # hold requests the orchestrator cancelled once the run needed no more rollouts.)
    with operator_channel(demo.address("router")) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)

        def follows_last_version() -> router_pb2.ReplicaInfo | None:
            [replica] = router.ListReplicas(router_pb2.ListReplicasRequest(), timeout=10).replicas
            return replica if replica.load.policy_version == max_steps else None

        replica = wait_until(follows_last_version, timeout_s=60, what="the router to see the last version")
    assert replica.replica_id == "inference-0" and replica.num_requests_total > 0
    assert replica.health == router_pb2.REPLICA_HEALTH_HEALTHY

    # SIGTERM to every service: each drains and exits 0; the one-shot exited 0 earlier.
    demo.run("stop", "--timeout", "30", timeout_s=300)
    containers = demo.containers()
    assert set(containers) == {*PORTS, *UNPUBLISHED, *ONE_SHOT}
    for service, container in containers.items():
        state = container["State"]
        assert not state["Running"], service
        assert (state["ExitCode"], state["OOMKilled"]) == (0, False), f"{service}: {state}"

    # The orchestrator's metrics (its state volume), read from the stopped container.
    orchestrator_id = containers["orchestrator"]["Id"]
    metrics = subprocess.run(
        ["docker", "cp", f"{orchestrator_id}:/var/cache/primerl/run/metrics.jsonl", "-"],
        capture_output=True,
        check=True,
    ).stdout
    records = [json.loads(line) for line in _untar_one(metrics).splitlines()]
    assert [r["step"] for r in records] == list(range(1, max_steps + 1))


def _untar_one(data: bytes) -> str:
    """The one file of a tar stream (what `docker cp CONTAINER:PATH -` writes)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        [member] = archive.getmembers()
        extracted = archive.extractfile(member)
        assert extracted is not None
        return extracted.read().decode()
