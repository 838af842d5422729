"""The router in front of real inference replicas (`primerl-inference`, vLLM on
CPU, a tiny model): episode affinity and its prefix-cache hits, policy
versions, registration and drain, and a replica killed mid-run.

Two replica processes serve the whole module; each test runs its own router in
process. The kill test goes last: it leaves one replica dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import prometheus_client
import pytest
import safetensors.torch

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.testing import in_process_service
from primerl_launcher.tiny_model import make_tiny_model
from primerl_router.config import RouterConfig
from primerl_router.server import build

pytestmark = pytest.mark.slow

REPLICA_IDS = ("inference-a", "inference-b")
# Long enough that a stream is still running when the test pauses its replica: the tiny model makes
# a few hundred tokens a second, and a pause reaches the engine some tens of milliseconds later.
LONG_STREAM_TOKENS = 1024


# Two vLLM engines on one small box: OpenMP's threads spin at each barrier by default, and two
# processes that each spin on every core slow each other ~8x (2 cores: 4 streams on 2 replicas made
# 8 tokens/s each instead of 65; a 1,024-token stream then outlasts the client's deadline). They wait
# passively instead, as co-located CPU replicas should (services/inference/README.md).
CO_LOCATED_REPLICA_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass
class InferenceReplica:
    replica_id: str
    process: ServiceProcess

    @property
    def address(self) -> str:
        return self.process.address


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), kind="dense", dtype="bfloat16")


@pytest.fixture(scope="module")
def replicas(model):
    """Both replica processes, started together (vLLM starts in seconds, the imports take longer)."""
    processes = []
    for replica_id in REPLICA_IDS:
        port = free_port()
        args = [
            os.path.join(os.path.dirname(sys.executable), "primerl-inference"),
            "--server.host=127.0.0.1",
            f"--server.port={port}",
            "--server.drain_delay_s=0",
            f"--engine.model={model}",
            "--engine.enforce_eager=true",
            "--engine.max_model_len=2048",
            f"--replica.id={replica_id}",
            "--observability.log_json=false",
        ]
        processes.append(ServiceProcess(args, port=port, env=CO_LOCATED_REPLICA_ENV))

    async def start() -> None:
        await asyncio.gather(*(process.start(timeout_s=180) for process in processes))

    try:
        asyncio.run(start())
        yield [InferenceReplica(name, process) for name, process in zip(REPLICA_IDS, processes, strict=True)]
    finally:
        for process in processes:
            asyncio.run(process.__aexit__(None, None, None))


@contextlib.asynccontextmanager
async def running_router(
    replicas: list[InferenceReplica], **config
) -> AsyncIterator[router_pb2_grpc.RouterServiceStub]:
    config = RouterConfig(
        server={"host": "127.0.0.1", "port": 0, "grace_s": 1},
        replicas=[{"replica_id": r.replica_id, "address": r.address} for r in replicas],
        health={"interval_s": 0.2, "timeout_s": 1.0},
        load={"report_interval_ms": 50},
        **config,
    )
    async with in_process_service(await build(config), config, max_attempts=1) as served:
        yield router_pb2_grpc.RouterServiceStub(served.channel)


def prompt_of(seed: int, length: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def generate_request(
    prompt: list[int],
    *,
    session_key: str = "",
    max_tokens: int = 16,
    every_n_tokens: int = 8,
    final_only: bool = False,
    min_policy_version: int = 0,
) -> router_pb2.GenerateRequest:
    generation = generation_pb2.GenerationInput(
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
        stream=generation_pb2.StreamOptions(every_n_tokens=every_n_tokens, final_only=final_only),
        cache_salt="0",
        min_policy_version=min_policy_version,
    )
    return router_pb2.GenerateRequest(input=generation, routing=router_pb2.RoutingHints(session_key=session_key))


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    replica_ids: set[str] = field(default_factory=set)
    last: generation_pb2.GenerationOutput | None = None
    first_message: asyncio.Event = field(default_factory=asyncio.Event)
    num_messages: int = 0
    error: grpc.aio.AioRpcError | None = None

    @property
    def replica_id(self) -> str:
        (replica_id,) = self.replica_ids
        return replica_id


async def complete(stub, request: router_pb2.GenerateRequest, completion: Completion | None = None) -> Completion:
    completion = completion or Completion()
    try:
        async for response in stub.Generate(request, timeout=120):
            output = response.output
            completion.token_ids.extend(output.token_ids)
            completion.policy_versions.extend(output.policy_versions)
            completion.replica_ids.add(output.replica_id)
            completion.last = output
            completion.num_messages += 1
            completion.first_message.set()
    except grpc.aio.AioRpcError as exc:
        completion.error = exc
    return completion


async def test_consistent_hash_keeps_an_episode_on_one_replica_and_its_second_turn_hits_the_cache(replicas):
    async with running_router(replicas, policy={"name": "consistent_hash"}) as stub:

        async def episode(index: int) -> tuple[Completion, Completion]:
            key = f"episode-{index}"
            prompt = prompt_of(index, 300)
            first = await complete(stub, generate_request(prompt, session_key=key))
            follow_up = [*prompt, *first.token_ids, *prompt_of(1000 + index, 20)]
            second = await complete(stub, generate_request(follow_up, session_key=key))
            return first, second

        turns = await asyncio.gather(*(episode(index) for index in range(8)))
    for index, (first, second) in enumerate(turns):
        assert first.error is None and second.error is None
        assert first.replica_id == second.replica_id, f"episode {index} moved"
        assert first.last.stats.num_cached_prompt_tokens == 0
        # The whole first turn (prompt + completion) is cached there, up to the last full KV block.
        assert second.last.stats.num_cached_prompt_tokens >= 256, second.last.stats
    assert {first.replica_id for first, _ in turns} == set(REPLICA_IDS)  # the episodes are spread


async def update_weights(address: str, model, policy_version: int) -> inference_pb2.UpdateWeightsResponse:
    tensors = safetensors.torch.load_file(str(model / "model.safetensors"))
    begin = inference_pb2.WeightUpdateBegin(
        policy_version=policy_version,
        format=tensor_pb2.WEIGHT_FORMAT_HF,
        num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )

    def messages():
        yield inference_pb2.UpdateWeightsRequest(begin=begin)
        for chunk in iter_tensor_chunks(tensors.items()):
            yield inference_pb2.UpdateWeightsRequest(chunk=chunk)

    async with make_channel(address) as channel:
        return await inference_pb2_grpc.InferenceServiceStub(channel).UpdateWeights(messages(), timeout=120)


async def test_a_request_needing_a_version_never_lands_on_an_older_replica(replicas, model):
    old, new = replicas
    async with running_router(replicas, policy={"name": "round_robin"}, routing={"no_replica_wait_s": 60}) as stub:
        # Nobody serves version 1 yet: these wait in the router...
        waiting = [
            asyncio.create_task(complete(stub, generate_request(prompt_of(i), min_policy_version=1))) for i in range(4)
        ]
        unversioned = await asyncio.gather(*(complete(stub, generate_request(prompt_of(i))) for i in range(4)))
        assert not any(task.done() for task in waiting)
        assert {c.replica_id for c in unversioned} == {old.replica_id, new.replica_id}

        # ... until one replica has it.
        assert (await update_weights(new.address, model, 1)).policy_version == 1
        late = await asyncio.gather(*waiting)
        now = await asyncio.gather(
            *(complete(stub, generate_request(prompt_of(i), min_policy_version=1)) for i in range(8))
        )
        for completion in [*late, *now]:
            assert completion.error is None
            assert completion.replica_id == new.replica_id
            assert set(completion.policy_versions) == {1}

        replicas_seen = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
        assert {r.replica_id: r.load.policy_version for r in replicas_seen} == {old.replica_id: 0, new.replica_id: 1}

    async with running_router(replicas, routing={"no_replica_wait_s": 0.5}) as stub:
        refused = await complete(stub, generate_request(prompt_of(0), min_policy_version=2))
        assert refused.error is not None and refused.error.code() == grpc.StatusCode.FAILED_PRECONDITION


async def pause(replica: InferenceReplica) -> None:
    """Freezes the replica's running requests where they are (they continue on resume)."""
    async with make_channel(replica.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        await stub.PauseGeneration(inference_pb2.PauseGenerationRequest(mode=inference_pb2.PAUSE_MODE_KEEP))


@contextlib.asynccontextmanager
async def paused(replica: InferenceReplica) -> AsyncIterator[None]:
    await pause(replica)
    try:
        yield
    finally:
        async with make_channel(replica.address) as channel:
            await inference_pb2_grpc.InferenceServiceStub(channel).ResumeGeneration(
                inference_pb2.ResumeGenerationRequest()
            )


async def start_streaming(stub, count: int, max_tokens: int) -> tuple[list[Completion], list[asyncio.Task]]:
    """`count` requests streaming every 16 tokens, returned once each has streamed."""
    completions = [Completion() for _ in range(count)]
    tasks = [
        asyncio.create_task(complete(stub, generate_request(prompt_of(i), max_tokens=max_tokens, every_n_tokens=16), c))
        for i, c in enumerate(completions)
    ]
    await asyncio.gather(*(c.first_message.wait() for c in completions))
    return completions, tasks


async def test_a_registered_replica_takes_traffic_and_a_drained_one_finishes_its_requests(replicas):
    first, second = replicas
    # Updating (paused) replicas are not avoided here: only the drain keeps traffic off `first`.
    async with running_router([first], policy={"name": "round_robin"}, routing={"avoid_updating": False}) as stub:
        alone = await asyncio.gather(*(complete(stub, generate_request(prompt_of(i))) for i in range(4)))
        assert {c.replica_id for c in alone} == {first.replica_id}

        registered = await stub.RegisterReplica(
            router_pb2.RegisterReplicaRequest(replica_id=second.replica_id, address=second.address)
        )
        assert registered.replica.health == router_pb2.REPLICA_HEALTH_HEALTHY
        shared = await asyncio.gather(*(complete(stub, generate_request(prompt_of(i))) for i in range(6)))
        assert {c.replica_id for c in shared} == {first.replica_id, second.replica_id}

        # Requests streaming on `first` when it is drained; the pause holds them there meanwhile.
        running, tasks = await start_streaming(stub, 4, max_tokens=LONG_STREAM_TOKENS)
        async with paused(first):
            await asyncio.sleep(0.5)  # what `first` sent before it froze arrives
            on_first = [
                c
                for c, task in zip(running, tasks, strict=True)
                if first.replica_id in c.replica_ids and not task.done()
            ]
            drained = await stub.DrainReplica(router_pb2.DrainReplicaRequest(replica_id=first.replica_id))
            assert drained.replica.draining and drained.replica.num_in_flight == len(on_first) > 0

            during = await asyncio.gather(*(complete(stub, generate_request(prompt_of(i))) for i in range(6)))
            assert {c.replica_id for c in during} == {second.replica_id}

            waiting = asyncio.ensure_future(
                stub.DrainReplica(router_pb2.DrainReplicaRequest(replica_id=first.replica_id, wait=True))
            )
            await asyncio.sleep(0.5)
            assert not waiting.done()  # its requests are still running
        assert (await waiting).replica.num_in_flight == 0
        for completion in await asyncio.gather(*tasks):
            assert completion.error is None
            assert len(completion.token_ids) == LONG_STREAM_TOKENS
            assert completion.last.finish_reason == generation_pb2.FINISH_REASON_LENGTH

        await stub.UndrainReplica(router_pb2.UndrainReplicaRequest(replica_id=first.replica_id))
        after = await asyncio.gather(*(complete(stub, generate_request(prompt_of(i))) for i in range(4)))
        assert {c.replica_id for c in after} == {first.replica_id, second.replica_id}


async def in_flight(stub, replica: InferenceReplica) -> int:
    replicas = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
    return next(r.num_in_flight for r in replicas if r.replica_id == replica.replica_id)


async def test_killing_a_replica_loses_no_request_that_had_not_streamed(replicas):
    victim, survivor = replicas
    retries_before = prometheus_client.REGISTRY.get_sample_value("primerl_router_retries_total") or 0.0
    # Paused replicas are not avoided here, so that requests reach the victim while it is frozen.
    async with running_router(replicas, policy={"name": "round_robin"}, routing={"avoid_updating": False}) as stub:
        streaming, streaming_tasks = await start_streaming(stub, 4, max_tokens=LONG_STREAM_TOKENS)
        # Freeze the victim mid-run: its requests stay in flight until it is killed.
        await pause(victim)
        # What the victim sent before it froze arrives first; a stream it had finished is not cut.
        await asyncio.sleep(0.5)
        cut_on_victim = [
            c
            for c, task in zip(streaming, streaming_tasks, strict=True)
            if victim.replica_id in c.replica_ids and not task.done()
        ]
        streamed_on_victim = len(cut_on_victim)
        # Requests that want one final message: they have not streamed until they end.
        not_streamed = [Completion() for _ in range(8)]
        tasks = [
            asyncio.create_task(complete(stub, generate_request(prompt_of(i), max_tokens=64, final_only=True), c))
            for i, c in enumerate(not_streamed)
        ]
        for _ in range(1000):
            if await in_flight(stub, victim) == streamed_on_victim + len(not_streamed) // 2:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail(f"the victim never had its requests in flight: {await in_flight(stub, victim)}")
        # A crash: the replica and its vLLM engine-core child.
        victim.process.kill(with_children=True)
        await victim.process.wait(30)
        await asyncio.gather(*streaming_tasks, *tasks)

        for completion in not_streamed:
            assert completion.error is None and len(completion.token_ids) == 64
            assert completion.replica_ids == {survivor.replica_id}
        retries = prometheus_client.REGISTRY.get_sample_value("primerl_router_retries_total") - retries_before
        assert retries >= len(not_streamed) // 2  # the victim's were moved to the survivor
        for completion in streaming:
            if any(completion is cut for cut in cut_on_victim):
                # It had streamed from the dead replica: it fails, since a retry would repeat tokens.
                assert completion.error is not None and completion.error.code() == grpc.StatusCode.UNAVAILABLE
            else:
                assert completion.error is None and len(completion.token_ids) == LONG_STREAM_TOKENS
        assert streamed_on_victim > 0

        # The survivor keeps serving everything that comes next.
        after = await asyncio.gather(*(complete(stub, generate_request(prompt_of(i))) for i in range(8)))
        assert all(c.error is None and c.replica_id == survivor.replica_id for c in after)
