"""TRANSPORT_NCCL with real parts on CPU (the gloo backend: the same code path as NCCL): the
trainer's publish code broadcasting to real inference replicas (primerl-inference, a tiny
float32 model) in groups the broadcaster forms, beside gRPC pushes of the same weights, a
replica killed and restarted, and what is refused."""

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.errors import FailedPrecondition
from primerl_common.processes import free_port
from primerl_common.testing import eventually, in_process_service
from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.publish import PublishError, WeightPublisher, tensor_headers
from primerl_weight_broadcaster.collective import CollectiveHost, CollectiveSettings
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build
from services.weight_broadcaster.tests.helpers import FAST_PUSH, replica_states, wait_for

from .replicas import START_TIMEOUT_S, TOLERANCE, logprobs, max_difference, perturbed, replica, served_version

BroadcasterStub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub
# Small buckets: a version of the tiny model goes out in several broadcasts.
COLLECTIVE = {"backend": "gloo", "timeout_s": 20.0, "bucket_mib": 1}


@contextlib.asynccontextmanager
async def broadcaster(
    push: dict[str, float] | None = None, **collective: object
) -> AsyncIterator[tuple[weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub, str]]:
    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0},
        push={**FAST_PUSH, **(push or {})},
        collective={**COLLECTIVE, **collective},
    )
    async with in_process_service(await build(config), config) as served:
        yield weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel), served.address


async def register(stub, name: str, address: str, transport: int) -> None:
    await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id=name, address=address, transport=transport))


async def _answered(stub, *names: str) -> bool:
    """Every replica named answered a probe: registered BEHIND, CURRENT once probed at the latest
    version (a collective group takes only replicas that answered)."""
    states = await replica_states(stub)
    return all(states[name][0] == pb2.REPLICA_STATE_CURRENT for name in names)


async def publish_collective(address: str, policy_version: int, tensors) -> pb2.PublishCollectiveResponse:
    """The trainer's publish code, in a thread (it blocks, and the broadcaster runs on this loop)."""

    def send() -> pb2.PublishCollectiveResponse:
        publisher = WeightPublisher(address, timeout_s=60)
        try:
            return publisher.send_collective(
                iter(tensors.items()),
                headers=tensor_headers(tensors.items()),
                policy_version=policy_version,
                kind="full",
                chunk_bytes=64 * 1024,
            )
        finally:
            publisher.close()

    return await asyncio.to_thread(send)


@pytest.mark.slow
async def test_collective_publish_to_real_replicas(tmp_path: pathlib.Path):
    model = make_tiny_model(tmp_path / "tiny-dense", kind="dense", dtype="float32")
    version_1 = perturbed(model, tmp_path / "v1", seed=1)
    version_2 = perturbed(model, tmp_path / "v2", seed=2)
    a, b = replica(model, free_port()), replica(model, free_port())
    started = [a, b]
    try:
        await asyncio.gather(a.start(START_TIMEOUT_S), b.start(START_TIMEOUT_S))
        async with broadcaster() as (stub, address):
            original = await logprobs(a)

            # a joins the group, b is pushed over gRPC: the trainer sends the data too, once.
            await register(stub, "a", a.address, pb2.TRANSPORT_NCCL)
            await register(stub, "b", b.address, pb2.TRANSPORT_GRPC)
            await eventually(lambda: _answered(stub, "a", "b"))
            reply = await publish_collective(address, 1, version_1)
            assert (list(reply.replica_ids), reply.group.world_size, reply.send_data) == (["a"], 2, True)
            await wait_for(stub, 1, 2, timeout_s=120)
            assert [await served_version(a), await served_version(b)] == [1, 1]
            status = {r.replica_id: r for r in (await stub.GetStatus(pb2.GetStatusRequest())).replicas}
            assert status["a"].num_bytes_sent_total == 0 < status["b"].num_bytes_sent_total
            over_collective = await logprobs(a)
            assert max_difference(over_collective, original) > 0.5
            assert max_difference(over_collective, await logprobs(b)) <= TOLERANCE

            # Both on the collective: the broadcaster gets no data; the group keeps forming per
            # membership (a new generation now that b joined).
            await register(stub, "b", b.address, pb2.TRANSPORT_NCCL)
            await eventually(lambda: _answered(stub, "b"))
            reply_2 = await publish_collective(address, 2, version_2)
            assert (list(reply_2.replica_ids), reply_2.send_data) == (["a", "b"], False)
            assert reply_2.group.group_name != reply.group.group_name
            await wait_for(stub, 2, 2, timeout_s=120)
            second = await logprobs(a)
            assert max_difference(second, over_collective) > 0.5
            assert max_difference(second, await logprobs(b)) <= TOLERANCE

            # b is killed: version 3 goes to a over the collective and to the broadcaster as data,
            # and b, restarted on its checkpoint, catches up to 3 over gRPC without help.
            b.kill()
            await b.wait()
            await eventually(lambda: _state_is(stub, "b", pb2.REPLICA_STATE_FAILED))
            reply_3 = await publish_collective(address, 3, version_1)
            assert (list(reply_3.replica_ids), reply_3.send_data) == (["a"], True)
            await wait_for(stub, 3, 1, timeout_s=120)
            b = replica(model, b.port)
            started.append(b)
            await b.start(START_TIMEOUT_S)
            await wait_for(stub, 3, 2, timeout_s=120)
            assert await served_version(b) == 3
            third = await logprobs(b)
            assert max_difference(third, await logprobs(a)) <= TOLERANCE
            assert max_difference(third, over_collective) <= TOLERANCE  # version 3 holds version 1's weights

            # A version that is not newer is refused before anything is broadcast.
            with pytest.raises(PublishError) as refused:
                await publish_collective(address, 3, version_2)
            assert refused.value.holds(3)
    finally:
        await asyncio.gather(*(process.stop() for process in started))


async def _state_is(stub, replica_id: str, state: int) -> bool:
    return (await replica_states(stub))[replica_id][0] == state


def test_a_member_that_fails_the_latest_version_undoes_its_announcement():
    """The broadcaster has no data of a version broadcast to every replica: a member that fails
    to load it makes it count as not published, so that the trainer publishes it again."""
    host = CollectiveHost(CollectiveSettings(backend="gloo"))
    host.announce(1)
    host.announce(2)
    host.member_failed(1)  # a failure of an older version: the latest stands
    assert host.announced_policy_version == 2
    with pytest.raises(FailedPrecondition):
        host.check_version(2, data=False)
    host.member_failed(2)
    assert host.announced_policy_version == 1
    host.check_version(2, data=False)  # it may be announced again


async def test_nccl_registration_is_checked():
    async with broadcaster() as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RegisterReplica(
                pb2.RegisterReplicaRequest(
                    replica_id="r",
                    address="127.0.0.1:1",
                    transport=pb2.TRANSPORT_NCCL,
                    format=tensor_pb2.WEIGHT_FORMAT_KERNEL,
                )
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "format" in refused.value.details()
    with pytest.raises(ValueError, match=r"collective\.backend"):
        WeightBroadcasterConfig(replicas=[{"replica_id": "r", "address": "h:1", "transport": "nccl"}])


async def test_collective_publish_sends_the_data_when_a_replica_is_not_in_the_group():
    tensors = {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)}
    async with broadcaster() as (stub, address):
        # Down (never answers): not in the group, so the broadcaster asks for the data.
        await register(stub, "down", f"127.0.0.1:{free_port()}", pb2.TRANSPORT_NCCL)
        reply = await publish_collective(address, 5, tensors)
        assert (reply.group.world_size, list(reply.replica_ids), reply.send_data) == (1, [], True)
        status = await stub.GetStatus(pb2.GetStatusRequest())
        assert status.latest_policy_version == 5
        # The data arrived: a stale version is refused as held, a newer one is announced.
        with pytest.raises(PublishError) as refused:
            await publish_collective(address, 5, tensors)
        assert refused.value.holds(5)
        wrong = pb2.PublishCollectiveRequest(
            begin=pb2.PublishBegin(policy_version=6, num_tensors=2, num_bytes=1),
            tensors=tensor_headers(tensors.items()),
        )
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.PublishCollective(wrong)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
