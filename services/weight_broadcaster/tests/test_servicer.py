"""The broadcaster's RPCs that need no replica, and its config (pushes: test_push.py)."""

import asyncio

import grpc
import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.testing import in_process_service
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build

from .helpers import publish, running_broadcaster, wait_for

CURRENT, FAILED = pb2.REPLICA_STATE_CURRENT, pb2.REPLICA_STATE_FAILED


def weights(step: int) -> dict[str, torch.Tensor]:
    """Layer i changes at every step that is a multiple of i + 1."""
    return {f"layer.{i}.weight": torch.full((8, 8), float(step // (i + 1))) for i in range(4)}


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
            ({"format": 99}, "format"),
            ({"transport": pb2.TRANSPORT_NCCL}, "transport"),
            ({"transport": pb2.TRANSPORT_SHARED_FS}, "transport"),  # no shared_fs.folder configured
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


def test_config_refuses_duplicate_replica_ids_and_shared_fs_without_a_folder(tmp_path):
    with pytest.raises(ValueError, match="duplicate replica_id r"):
        WeightBroadcasterConfig(replicas=[{"replica_id": "r", "address": "a:1"}, {"replica_id": "r", "address": "b:1"}])
    shared = {"replica_id": "r", "address": "a:1", "transport": "shared_fs"}
    with pytest.raises(ValueError, match=r"r use transport shared_fs, which needs shared_fs\.folder"):
        WeightBroadcasterConfig(replicas=[shared])
    with pytest.raises(ValueError, match=r"shared_fs.folder\n.*is not a folder"):
        WeightBroadcasterConfig(shared_fs={"folder": tmp_path / "missing"})
    with pytest.raises(ValueError, match=r"r use transport nccl, which needs collective\.backend"):
        WeightBroadcasterConfig(replicas=[{**shared, "transport": "nccl"}])
    with pytest.raises(ValueError, match=r"replicas\.0\.transport"):
        WeightBroadcasterConfig(replicas=[{**shared, "transport": "rdma"}])
    config = WeightBroadcasterConfig(replicas=[{**shared, "format": "kernel_fp8"}], shared_fs={"folder": tmp_path})
    assert config.shared_fs.folder == tmp_path.resolve() and config.replicas[0].format == "kernel_fp8"


async def test_a_graceful_stop_ends_watches_and_waits_at_once():
    """Streams that never end on their own (WatchReplicas, a long WaitForVersion) do not hold a
    graceful stop for its whole grace period: they end, and their clients ask the next process."""
    config = WeightBroadcasterConfig(server={"host": "127.0.0.1", "port": 0, "grace_s": 30, "drain_delay_s": 0})
    async with in_process_service(await build(config), config, max_attempts=1) as served:
        stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel)
        watch = stub.WatchReplicas(pb2.WatchReplicasRequest())
        wait = asyncio.ensure_future(
            stub.WaitForVersion(pb2.WaitForVersionRequest(policy_version=1, timeout_ms=60_000))
        )
        await asyncio.sleep(0.2)  # both are open
        loop = asyncio.get_running_loop()
        started = loop.time()
        await served.service.stop()
        assert loop.time() - started < 5
        assert not (await wait).reached
        assert [event async for event in watch] == []
