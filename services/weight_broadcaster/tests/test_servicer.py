"""The broadcaster's RPCs against in-process fake replicas (see fakes.py)."""

import asyncio

import grpc
import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.server import GrpcService
from primerl_common.testing import free_port
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build

from .fakes import FakeReplica, eventually, publish, replica_states, running_broadcaster, wait_for

CURRENT, FAILED = pb2.REPLICA_STATE_CURRENT, pb2.REPLICA_STATE_FAILED


def weights(step: int) -> dict[str, torch.Tensor]:
    """Layer i changes at every step that is a multiple of i + 1."""
    return {f"layer.{i}.weight": torch.full((8, 8), float(step // (i + 1))) for i in range(4)}


def register(replica: FakeReplica, replica_id: str, **fields) -> pb2.RegisterReplicaRequest:
    return pb2.RegisterReplicaRequest(replica_id=replica_id, address=replica.address, **fields)


async def test_publish_validates_versions_and_streams():
    async with running_broadcaster() as stub:
        assert (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version == -1
        reply = await publish(stub, 1, weights(1))
        assert (reply.policy_version, reply.num_tensors, reply.num_changed_tensors) == (1, 4, 4)
        assert reply.num_bytes == 4 * 64 * 4
        assert (await publish(stub, 2, weights(2))).num_changed_tensors == 2  # layers 0 and 1
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish(stub, 2, weights(2))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not newer than the latest published 2" in error.value.details()

        async def truncated():
            yield pb2.PublishWeightsRequest(begin=pb2.PublishBegin(policy_version=3, num_tensors=2))
            yield pb2.PublishWeightsRequest(
                chunk=tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name="x", dtype=1, shape=[4], num_bytes=16))
            )

        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishWeights(truncated())
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version == 2
        assert (await wait_for(stub, 2, 0)).latest_policy_version == 2
        reply = await stub.WaitForVersion(pb2.WaitForVersionRequest(policy_version=3, timeout_ms=100))
        assert not reply.reached and reply.latest_policy_version == 2


async def test_register_refuses_unsupported_format_and_transport():
    async with running_broadcaster() as stub:
        for fields, field in [
            ({"format": tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8}, "format"),
            ({"transport": pb2.TRANSPORT_NCCL}, "transport"),
            ({"address": ""}, "address"),
            ({"replica_id": ""}, "replica_id"),
        ]:
            request = pb2.RegisterReplicaRequest(**{"replica_id": "r", "address": "127.0.0.1:1", **fields})
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.RegisterReplica(request)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith(f"{field}:")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.DeregisterReplica(pb2.DeregisterReplicaRequest(replica_id="nobody"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_replicas_are_pushed_late_joiners_and_restarts_catch_up():
    a, b = await FakeReplica().start(), await FakeReplica().start()
    try:
        async with running_broadcaster() as stub:
            await stub.RegisterReplica(register(a, "a"))
            await publish(stub, 1, weights(1))
            await wait_for(stub, 1, 1)
            # b joins after the publish and gets version 1 at once.
            reply = await stub.RegisterReplica(register(b, "b"))
            assert reply.latest_policy_version == 1
            assert (await wait_for(stub, 1, 2)).num_replicas_at_version == 2
            assert await replica_states(stub) == {"a": (CURRENT, 1), "b": (CURRENT, 1)}
            assert all(torch.equal(b.weights[n], t) for n, t in weights(1).items())

            # b restarts on its checkpoint: the probe notices and pushes version 1 again.
            await b.restart()
            assert b.policy_version == 0
            await eventually(lambda: _at(b, 1))
            assert len(b.updates) == 1 and not b.updates[0][0].delta  # a new instance gets everything

            await stub.DeregisterReplica(pb2.DeregisterReplicaRequest(replica_id="b"))
            assert set(await replica_states(stub)) == {"a"}
    finally:
        await a.stop()
        await b.stop()


async def test_a_failing_replica_does_not_hold_back_the_others():
    good, bad = await FakeReplica().start(), await FakeReplica().start()
    bad.num_failures_left = 3
    try:
        async with running_broadcaster() as stub:
            await stub.RegisterReplica(register(good, "good"))
            await stub.RegisterReplica(register(bad, "bad"))
            await publish(stub, 1, weights(1))
            await wait_for(stub, 1, 1)
            await eventually(lambda: _failed(stub, "bad"))
            status = {r.replica_id: r for r in (await stub.GetStatus(pb2.GetStatusRequest())).replicas}
            assert status["good"].state == CURRENT and status["bad"].policy_version == 0
            assert "injected failure" in status["bad"].last_error
            # Retried with backoff until it succeeds.
            await wait_for(stub, 1, 2)
            status = {r.replica_id: r for r in (await stub.GetStatus(pb2.GetStatusRequest())).replicas}
            assert status["bad"].state == CURRENT and status["bad"].num_consecutive_failures == 0

            # A replica that is down entirely: the other one still moves on. What the down one serves
            # is unknown (it may come back on its checkpoint), so it no longer counts at version 1.
            await bad.stop()
            await publish(stub, 2, weights(2))
            await wait_for(stub, 2, 1)
            await eventually(lambda: _failed(stub, "bad"))
            assert (await replica_states(stub))["bad"] == (FAILED, -1)
            assert (await wait_for(stub, 1, 1)).num_replicas_at_version == 1
            await bad.start(bad.port)
            await wait_for(stub, 2, 2)
    finally:
        await good.stop()
        await bad.stop()


async def test_a_replica_that_comes_back_is_pushed_within_a_probe_interval():
    """Probes of a replica that is down do not back off like failed pushes: once it is back (a
    restart that took long), it gets the latest version at the next probe, not after minutes."""
    replica = FakeReplica()
    port = free_port()
    async with running_broadcaster(probe_interval_s=0.2, retry_initial_s=0.1, retry_max_s=60.0) as stub:
        await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id="r", address=f"127.0.0.1:{port}"))
        await publish(stub, 1, weights(1))

        async def failed_often() -> bool:
            status = (await stub.GetStatus(pb2.GetStatusRequest())).replicas[0]
            return status.num_consecutive_failures >= 8  # a push backoff would be 0.1 * 2**7 s by now

        await eventually(failed_often)
        await replica.start(port)
        try:
            await wait_for(stub, 1, 1, timeout_s=2.0)
        finally:
            await replica.stop()


async def test_replicas_in_the_config_are_registered_at_start():
    """A restarted broadcaster knows its configured replicas again; the first version published
    to it (a trainer republishing what the old process had) reaches them."""
    replica = await FakeReplica().start()
    try:
        async with running_broadcaster(replicas=[{"replica_id": "r", "address": replica.address}]) as stub:
            await eventually(lambda: _state_is(stub, "r", (CURRENT, 0)))
            await publish(stub, 3, weights(3))
            await wait_for(stub, 3, 1)
            assert replica.policy_version == 3 and not replica.updates[0][0].delta
    finally:
        await replica.stop()


def test_config_refuses_duplicate_replica_ids():
    with pytest.raises(ValueError, match="duplicate replica_id r"):
        WeightBroadcasterConfig(replicas=[{"replica_id": "r", "address": "a:1"}, {"replica_id": "r", "address": "b:1"}])


async def test_delta_sends_only_changed_tensors():
    full, delta, old = await FakeReplica().start(), await FakeReplica().start(), await FakeReplica(delta=False).start()
    try:
        async with running_broadcaster() as stub:
            await stub.RegisterReplica(register(full, "full"))
            await stub.RegisterReplica(register(delta, "delta", delta=True))
            # A replica without the delta capability gets full updates even when it asks for deltas.
            await stub.RegisterReplica(register(old, "old", delta=True))
            for step in (1, 2, 3, 4):
                await publish(stub, step, weights(step))
                await wait_for(stub, step, 3)
            assert [len(names) for _, names in full.updates] == [4, 4, 4, 4]
            assert [len(names) for _, names in old.updates] == [4, 4, 4, 4]
            # Version 1 is the first the replica gets (everything); then layer i changes every i+1 steps.
            assert [names for _, names in delta.updates] == [
                [f"layer.{i}.weight" for i in range(4)],
                ["layer.0.weight", "layer.1.weight"],
                ["layer.0.weight", "layer.2.weight"],
                ["layer.0.weight", "layer.1.weight", "layer.3.weight"],
            ]
            assert [begin.delta for begin, _ in delta.updates] == [False, True, True, True]
            for replica in (full, delta, old):
                assert replica.weights.keys() == weights(4).keys()
                assert all(torch.equal(replica.weights[n], t) for n, t in weights(4).items())
            status = {r.replica_id: r for r in (await stub.GetStatus(pb2.GetStatusRequest())).replicas}
            assert status["delta"].num_bytes_sent_total < status["full"].num_bytes_sent_total
    finally:
        for replica in (full, delta, old):
            await replica.stop()


async def test_watch_replicas_starts_with_a_snapshot_then_streams_changes():
    a = await FakeReplica().start()
    try:
        async with running_broadcaster() as stub:
            await stub.RegisterReplica(register(a, "a"))
            await wait_for(stub, -1, 0)
            watch = stub.WatchReplicas(pb2.WatchReplicasRequest())
            first = await watch.read()
            assert first.replica.replica_id == "a" and not first.removed
            await publish(stub, 1, weights(1))

            async def next_current():
                while True:
                    event = await watch.read()
                    if event.replica.state == CURRENT and event.replica.policy_version == 1:
                        return event

            event = await asyncio.wait_for(next_current(), 10)
            assert event.latest_policy_version == 1
            await stub.DeregisterReplica(pb2.DeregisterReplicaRequest(replica_id="a"))
            while not (event := await asyncio.wait_for(watch.read(), 10)).removed:
                pass
            assert event.replica.replica_id == "a"
            watch.cancel()
    finally:
        await a.stop()


async def _at(replica: FakeReplica, policy_version: int) -> bool:
    return replica.policy_version == policy_version


async def _failed(stub, replica_id: str) -> bool:
    return (await replica_states(stub))[replica_id][0] == FAILED


async def _state_is(stub, replica_id: str, state: tuple[int, int]) -> bool:
    return (await replica_states(stub)).get(replica_id) == state


async def test_a_graceful_stop_ends_watches_and_waits_at_once():
    """Streams that never end on their own (WatchReplicas, a long WaitForVersion) do not hold a
    graceful stop for its whole grace period: they end, and their clients ask the next process."""
    config = WeightBroadcasterConfig(server={"host": "127.0.0.1", "port": 0, "grace_s": 30, "drain_delay_s": 0})
    service = GrpcService(await build(config), config)
    port = await service.start()
    async with make_channel(f"127.0.0.1:{port}", max_attempts=1) as channel:
        stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
        watch = stub.WatchReplicas(pb2.WatchReplicasRequest())
        wait = asyncio.ensure_future(
            stub.WaitForVersion(pb2.WaitForVersionRequest(policy_version=1, timeout_ms=60_000))
        )
        await asyncio.sleep(0.2)  # both are open
        loop = asyncio.get_running_loop()
        started = loop.time()
        await service.stop()
        assert loop.time() - started < 5
        assert not (await wait).reached
        assert [event async for event in watch] == []
