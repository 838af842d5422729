"""An in-process inference.v1 replica that records the weight updates it receives (fast, no
engine), and helpers to run the broadcaster on a free port and publish to it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc
import torch

from primerl.common.v1 import generation_pb2, service_info_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.server import GrpcService
from primerl_common.tensors import TensorAssembler, iter_tensor_chunks
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build

# Short probe and retry intervals, so that restarts and failures resolve in test time.
FAST_PUSH = {"probe_interval_s": 0.2, "retry_initial_s": 0.1, "retry_max_s": 0.5, "probe_timeout_s": 2.0}


class FakeReplica(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, *, delta: bool = True) -> None:
        self.capabilities = ["weights.format.hf", *(["weights.delta"] if delta else [])]
        self.instance_id = uuid.uuid4().hex
        self.policy_version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.updates: list[tuple[inference_pb2.WeightUpdateBegin, list[str]]] = []
        self.num_failures_left = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeReplica:
        self.server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0)

    async def restart(self) -> None:
        """Back on its checkpoint (version 0) as a new instance, on the same port."""
        await self.stop()
        self.instance_id, self.policy_version, self.weights, self.updates = uuid.uuid4().hex, 0, {}, []
        await self.start(self.port)

    async def GetServiceInfo(self, request, context):
        info = service_info_pb2.ServiceInfo(
            service_name="inference", capabilities=self.capabilities, instance_id=self.instance_id
        )
        return inference_pb2.GetServiceInfoResponse(info=info)

    async def GetLoad(self, request, context):
        return inference_pb2.GetLoadResponse(load=generation_pb2.LoadReport(policy_version=self.policy_version))

    async def UpdateWeights(self, request_iterator, context):
        begin = None
        assembler, received = TensorAssembler(), {}
        async for request in request_iterator:
            if request.HasField("begin"):
                begin = request.begin
            elif (item := assembler.feed(request.chunk)) is not None:
                received[item[0]] = item[1]
        assert begin is not None and len(received) == begin.num_tensors
        if self.num_failures_left > 0:
            self.num_failures_left -= 1
            await context.abort(grpc.StatusCode.INTERNAL, "injected failure")
        if begin.policy_version <= self.policy_version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not newer")
        if begin.delta:
            assert begin.base_policy_version == self.policy_version
            self.weights.update(received)
        else:
            self.weights = received
        self.updates.append((begin, sorted(received)))
        self.policy_version = begin.policy_version
        return inference_pb2.UpdateWeightsResponse(policy_version=begin.policy_version, num_tensors=len(received))


@contextlib.asynccontextmanager
async def running_broadcaster(
    replicas: list[dict[str, str]] | None = None, **push: float
) -> AsyncIterator[weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub]:
    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0}, push={**FAST_PUSH, **push}, replicas=replicas or []
    )
    service = GrpcService(await build(config), config)
    port = await service.start()
    try:
        async with make_channel(f"127.0.0.1:{port}") as channel:
            yield weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
    finally:
        await service.stop(grace_s=0)


async def publish(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    policy_version: int,
    tensors: dict[str, torch.Tensor],
) -> pb2.PublishWeightsResponse:
    async def requests():
        yield pb2.PublishWeightsRequest(
            begin=pb2.PublishBegin(
                policy_version=policy_version,
                kind=pb2.PUBLISH_KIND_FULL,
                num_tensors=len(tensors),
                num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            )
        )
        for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=1024):
            yield pb2.PublishWeightsRequest(chunk=chunk)

    return await stub.PublishWeights(requests())


async def wait_for(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    policy_version: int,
    min_replicas: int,
    *,
    timeout_s: float = 30.0,
) -> pb2.WaitForVersionResponse:
    request = pb2.WaitForVersionRequest(
        policy_version=policy_version, min_replicas=min_replicas, timeout_ms=int(timeout_s * 1000)
    )
    reply = await stub.WaitForVersion(request)
    assert reply.reached, reply
    return reply


async def replica_states(stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub) -> dict[str, tuple[int, int]]:
    status = await stub.GetStatus(pb2.GetStatusRequest())
    return {r.replica_id: (r.state, r.policy_version) for r in status.replicas}


async def eventually(condition, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await condition():  # noqa: ASYNC110 (polls another process's state)
            await asyncio.sleep(0.05)
