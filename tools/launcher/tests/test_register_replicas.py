"""`primerl-register-replicas`, the installed console script, against a weight broadcaster
and a router served by a real gRPC server on port 0 (their registration calls, kept in
memory as the real services keep them)."""

from __future__ import annotations

import asyncio
import functools
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.processes import free_port
from primerl_common.testing import bare_server, eventually
from primerl_launcher import run as launcher_run
from primerl_launcher.register_replicas import RegistrationFailed
from primerl_launcher.spec import ServiceSpec

REPLICAS = {"inference-0": "inference-0.inference:50053", "r1": "h:1"}
REPLICA_ARGS = [f"--replica={replica_id}={address}" for replica_id, address in REPLICAS.items()]


class Broadcaster(wb_pb2_grpc.WeightBroadcasterServiceServicer):
    """Registrations as the weight broadcaster keeps them; refuses the addresses in `refused`."""

    def __init__(self) -> None:
        self.replicas: dict[str, str] = {}
        self.refused: set[str] = set()

    async def GetStatus(self, request, context):
        return wb_pb2.GetStatusResponse(
            replicas=[wb_pb2.ReplicaStatus(replica_id=i, address=a) for i, a in self.replicas.items()]
        )

    async def RegisterReplica(self, request, context):
        if request.address in self.refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address: {request.address} is not reachable")
        self.replicas[request.replica_id] = request.address
        return wb_pb2.RegisterReplicaResponse(latest_policy_version=-1)

    async def DeregisterReplica(self, request, context):
        if self.replicas.pop(request.replica_id, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {request.replica_id!r} is registered")
        return wb_pb2.DeregisterReplicaResponse()


class Router(router_pb2_grpc.RouterServiceServicer):
    """Registrations as the router keeps them for replicas not in its config."""

    def __init__(self) -> None:
        self.replicas: dict[str, str] = {}

    async def ListReplicas(self, request, context):
        return router_pb2.ListReplicasResponse(
            replicas=[router_pb2.ReplicaInfo(replica_id=i, address=a) for i, a in self.replicas.items()]
        )

    async def RegisterReplica(self, request, context):
        self.replicas[request.replica_id] = request.address
        return router_pb2.RegisterReplicaResponse()

    async def DeregisterReplica(self, request, context):
        self.replicas.pop(request.replica_id, None)
        return router_pb2.DeregisterReplicaResponse()


@dataclass
class Peers:
    address: str  # of both
    broadcaster: Broadcaster
    router: Router


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    broadcaster, router = Broadcaster(), Router()
    async with bare_server(
        functools.partial(wb_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, broadcaster),
        functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router),
    ) as address:
        yield Peers(address, broadcaster, router)


def command() -> str:
    path = shutil.which("primerl-register-replicas", path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail("primerl-register-replicas is not installed: pip install -e libs/common --no-deps")
    return path


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        command(), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )


async def finish(process: asyncio.subprocess.Process, timeout_s: float = 60.0) -> tuple[int, str]:
    """Its exit status and output, once it exits (killed, and a failure, after `timeout_s`)."""
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"primerl-register-replicas still ran after {timeout_s:g} s") from None
    return process.returncode, output.decode()


async def test_keeps_replicas_registered_until_sigterm(peers: Peers) -> None:
    process = await start(
        f"--broadcaster={peers.address}", f"--router={peers.address}", *REPLICA_ARGS, "--interval=0.1"
    )
    try:
        await eventually(
            lambda: peers.broadcaster.replicas == REPLICAS and peers.router.replicas == REPLICAS,
            what="both peers list both replicas",
        )
        peers.broadcaster.replicas.clear()  # a restarted broadcaster has forgotten them
        await eventually(lambda: peers.broadcaster.replicas == REPLICAS, what="the broadcaster lists them again")
        process.send_signal(signal.SIGTERM)
        returncode, output = await finish(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert returncode == 0, output
    assert peers.broadcaster.replicas == {} and peers.router.replicas == {}, output


async def test_once_exits_0_once_registered(peers: Peers) -> None:
    returncode, output = await finish(await start(f"--broadcaster={peers.address}", *REPLICA_ARGS, "--once"))
    assert returncode == 0, output
    # Registered with the broadcaster alone (no --router), and left registered.
    assert peers.broadcaster.replicas == REPLICAS and peers.router.replicas == {}, output


async def test_once_fails_at_once_when_the_broadcaster_refuses(peers: Peers) -> None:
    peers.broadcaster.refused.add("h:1")
    # --timeout-s=600: only an exit without retries comes within finish's 60 s.
    returncode, output = await finish(
        await start(f"--broadcaster={peers.address}", *REPLICA_ARGS, "--once", "--timeout-s=600")
    )
    assert returncode == 1, output
    assert f"registering r1 (h:1) with the weight broadcaster {peers.address}: INVALID_ARGUMENT" in output
    assert "address: h:1 is not reachable" in output


async def test_once_gives_up_on_an_unreachable_broadcaster() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    returncode, output = await finish(await start(f"--broadcaster={address}", *REPLICA_ARGS, "--once", "--timeout-s=2"))
    assert returncode == 1, output
    assert (
        f"registering inference-0 (inference-0.inference:50053) with the weight broadcaster {address}: UNAVAILABLE"
        in output
    )
    assert "gave up after 2 s" in output


async def test_the_launcher_registers_as_the_command_does(peers: Peers) -> None:
    specs = []
    for replica_id, address in REPLICAS.items():
        host, port = address.rsplit(":", 1)
        table = {"replica": {"id": replica_id}, "server": {"host": host, "port": port}}
        specs.append(ServiceSpec(replica_id, "inference", table, where="[[inference]]"))
    await launcher_run.register_replicas(peers.address, specs)
    assert peers.broadcaster.replicas == REPLICAS and peers.router.replicas == {}

    peers.broadcaster.replicas.clear()
    peers.broadcaster.refused.add("h:1")
    with pytest.raises(
        RegistrationFailed, match=r"registering r1 \(h:1\) with the weight broadcaster .*: INVALID_ARGUMENT"
    ):
        await launcher_run.register_replicas(peers.address, specs)
