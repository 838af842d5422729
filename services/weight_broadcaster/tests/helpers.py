"""Helpers of the broadcaster's tests: the broadcaster in-process on a free port, publishing
to it and waiting on it. (Real inference replicas for tests across the two services are in
the top-level tests/replicas.py.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.testing import in_process_service
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build

# Short probe and retry intervals, so that restarts and failures resolve in test time.
FAST_PUSH = {"probe_interval_s": 0.2, "retry_initial_s": 0.1, "retry_max_s": 0.5, "probe_timeout_s": 2.0}


@contextlib.asynccontextmanager
async def running_broadcaster(
    replicas: list[dict[str, object]] | None = None,
    shared_fs: dict[str, object] | None = None,
    shm: dict[str, object] | None = None,
    store: dict[str, object] | None = None,
    publish_limits: dict[str, object] | None = None,
    **push: float,
) -> AsyncIterator[weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub]:
    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0},
        push={**FAST_PUSH, **push},
        publish=publish_limits or {},
        replicas=replicas or [],
        shared_fs=shared_fs or {},
        shm=shm or {},
        store=store or {},
    )
    async with in_process_service(await build(config), config) as served:
        yield weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel)


async def publish(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    policy_version: int,
    tensors: dict[str, torch.Tensor],
    model_type: str = "",
) -> pb2.PublishWeightsResponse:
    async def requests():
        yield pb2.PublishWeightsRequest(
            begin=pb2.PublishBegin(
                policy_version=policy_version,
                kind=pb2.PUBLISH_KIND_FULL,
                num_tensors=len(tensors),
                num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                model_type=model_type,
            )
        )
        for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=1024):
            yield pb2.PublishWeightsRequest(chunk=chunk)

    return await stub.PublishWeights(requests())


def lora_tensors(
    seed: int, *, rank: int = 8, modules: tuple[str, ...] = ("q_proj", "v_proj")
) -> dict[str, torch.Tensor]:
    """A LoRA in PEFT names on the attention `modules` of the 4 layers of the launcher's tiny
    dense model (hidden 256; q_proj out 256, v_proj out 128)."""
    out_features = {"q_proj": 256, "k_proj": 128, "v_proj": 128, "o_proj": 256}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(4):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(rank, 256, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(out_features[module], rank, generator=generator)
    return tensors


async def publish_adapter(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    name: str,
    policy_version: int,
    tensors: dict[str, torch.Tensor],
    **begin: object,
) -> pb2.PublishWeightsResponse:
    """A PUBLISH_KIND_ADAPTER publish (rank 8, alpha 16 unless `begin` says otherwise)."""
    fields = {
        "policy_version": policy_version,
        "kind": pb2.PUBLISH_KIND_ADAPTER,
        "num_tensors": len(tensors),
        "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "adapter_name": name,
        "adapter_rank": 8,
        "adapter_alpha": 16.0,
        **begin,
    }

    async def requests():
        yield pb2.PublishWeightsRequest(begin=pb2.PublishBegin(**fields))  # type: ignore[arg-type]
        for chunk in iter_tensor_chunks(tensors.items()):
            yield pb2.PublishWeightsRequest(chunk=chunk)

    return await stub.PublishWeights(requests())


async def wait_for_adapter(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    name: str,
    policy_version: int,
    min_replicas: int,
    *,
    timeout_s: float = 30.0,
) -> pb2.WaitForVersionResponse:
    request = pb2.WaitForVersionRequest(
        adapter_name=name, policy_version=policy_version, min_replicas=min_replicas, timeout_ms=int(timeout_s * 1000)
    )
    reply = await stub.WaitForVersion(request)
    assert reply.reached, reply
    return reply


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
