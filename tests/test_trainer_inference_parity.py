"""The trainer against what real vLLM sampled: `primerl-inference` (vLLM on CPU, run as its
binary, as a peer the trainer never imports) samples completions of tiny models at several
temperatures, and the trainer scores the same tokens.

- float32, the dense model: the trainer's logprob of every sampled token, at that token's
  temperature, is the one vLLM reported (within 1e-4).
- a bfloat16 engine serving the MoE model: the trainer service's mismatch_kl on those samples
  is at least 5x lower when it replays the experts the engine routed to than when it routes
  on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import sys
from dataclasses import dataclass

import pytest
import torch

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.tensors import tensor_from_proto
from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.batch import MicroBatch
from primerl_trainer.losses import token_logprobs
from primerl_trainer.models import load_model
from services.trainer.tests.serving import push, serving, trainer_config, watch
from services.trainer.tests.tiny_training import Sample, pack

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

# (kind, dtype) of each engine; they start side by side. (The MoE in float32, its experts
# replayed, is held to the same logprobs by tests/test_orchestrator_e2e.py's mismatch_kl.)
ENGINES = (("dense", "float32"), ("moe", "bfloat16"))
TEMPERATURES = (1.0, 0.7, 1.3)
NUM_PROMPTS = 12
NUM_COMPLETION_TOKENS = 40
SEQ_LEN = 1024
_START_TIMEOUT_S = 240


@dataclass(frozen=True)
class Rollout:
    """One completion as the inference service returned it."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    temperature: float
    # [prompt + completion, layers, top_k] uint8 (MoE only).
    routed_experts: torch.Tensor | None


def _engine_args(model_dir: pathlib.Path, dtype: str, port: int) -> list[str]:
    return [
        str(pathlib.Path(sys.executable).parent / "primerl-inference"),
        f"--server.port={port}",
        "--server.host=127.0.0.1",
        "--server.drain_delay_s=0",
        "--observability.log_json=false",
        f"--engine.model={model_dir}",
        f"--engine.dtype={dtype}",
        "--engine.enforce_eager=true",
        "--engine.max_model_len=256",
        f"--engine.max_num_seqs={NUM_PROMPTS}",
    ]


async def sample_rollouts(stub: inference_pb2_grpc.InferenceServiceStub, *, moe: bool) -> list[Rollout]:
    """NUM_PROMPTS random byte prompts, each sampled at one of TEMPERATURES, all in flight together
    (tests/test_family_serving.py samples each model family's engine with it)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 40, (NUM_PROMPTS,), generator=generator).tolist()
    prompts = [torch.randint(0, 256, (length,), generator=generator).tolist() for length in lengths]

    async def one(index: int) -> Rollout:
        temperature = TEMPERATURES[index % len(TEMPERATURES)]
        request = inference_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                prompt_token_ids=prompts[index],
                sampling=generation_pb2.SamplingParams(
                    temperature=temperature, max_tokens=NUM_COMPLETION_TOKENS, ignore_eos=True, seed=index
                ),
                stream=generation_pb2.StreamOptions(final_only=True),
                return_routed_experts=moe,
            )
        )
        [response] = [response async for response in stub.Generate(request)]
        output = response.output
        assert output.finished and len(output.token_ids) == NUM_COMPLETION_TOKENS
        return Rollout(
            prompt=prompts[index],
            completion=list(output.token_ids),
            logprobs=list(output.logprobs),
            temperature=temperature,
            routed_experts=tensor_from_proto(output.routed_experts) if moe else None,
        )

    return await asyncio.gather(*(one(index) for index in range(NUM_PROMPTS)))


async def _sample(address: str, *, moe: bool) -> list[Rollout]:
    async with make_channel(address) as channel:
        return await sample_rollouts(inference_pb2_grpc.InferenceServiceStub(channel), moe=moe)


async def _sample_all(models: dict[tuple[str, str], pathlib.Path]) -> dict[tuple[str, str], list[Rollout]]:
    processes = {
        engine: ServiceProcess(_engine_args(path, engine[1], port := free_port()), port=port)
        for engine, path in models.items()
    }
    try:
        await asyncio.gather(*(process.start(timeout_s=_START_TIMEOUT_S) for process in processes.values()))
        results = await asyncio.gather(
            *(_sample(process.address, moe=kind == "moe") for (kind, _), process in processes.items())
        )
    finally:
        await asyncio.gather(*(process.stop() for process in processes.values()))
        for process in processes.values():
            await process.__aexit__(None, None, None)
    return dict(zip(processes, results, strict=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], pathlib.Path]:
    root = tmp_path_factory.getbasetemp() / "parity-models"
    return {
        (kind, dtype): make_tiny_model(root / f"{kind}-{dtype}", kind=kind, dtype=dtype)  # type: ignore[arg-type]
        for kind, dtype in ENGINES
    }


@pytest.fixture(scope="module")
def rollouts(models: dict[tuple[str, str], pathlib.Path]) -> dict[tuple[str, str], list[Rollout]]:
    """What each engine sampled; the engines are stopped before any test runs."""
    return asyncio.run(_sample_all(models))


def _micro_batch(rollouts: list[Rollout], *, replay: bool) -> MicroBatch:
    """The rollouts packed into one sequence as the orchestrator packs them (advantages +-1)."""
    samples = [
        Sample(
            prompt=torch.tensor(r.prompt),
            completion=torch.tensor(r.completion),
            advantage=1.0 if i % 2 else -1.0,
            temperature=r.temperature,
            inference_logprobs=torch.tensor(r.logprobs),
        )
        for i, r in enumerate(rollouts)
    ]
    micro_batch = pack(samples)
    if replay:
        rows = [r.routed_experts for r in rollouts]
        assert all(row is not None for row in rows)
        micro_batch = dataclasses.replace(micro_batch, routed_experts=torch.cat(rows))  # type: ignore[arg-type]
    return micro_batch


def test_trainer_logprobs_equal_vllm_sampled_logprobs_in_float32(
    models: dict[tuple[str, str], pathlib.Path],
    rollouts: dict[tuple[str, str], list[Rollout]],
) -> None:
    engine = ("dense", "float32")
    assert_trainer_logprobs_equal_vllm(models[engine], rollouts[engine])


def assert_trainer_logprobs_equal_vllm(model_dir: pathlib.Path, rollouts: list[Rollout]) -> None:
    """The RL step's own path (the model's forward over the packed samples, logits divided by
    each token's temperature) gives vLLM's logprobs of the tokens it sampled (float32)."""
    micro_batch = _micro_batch(rollouts, replay=False)
    model = load_model(model_dir, impl="auto", dtype=torch.float32)
    with torch.no_grad():
        logits = model(
            micro_batch.input_ids[None], micro_batch.position_ids[None], routed_experts=micro_batch.routed_experts
        ).logits.squeeze(0)
        logprobs, _ = token_logprobs(logits, micro_batch.input_ids, micro_batch.temperatures)
        at_temperature_one, _ = token_logprobs(logits, micro_batch.input_ids, torch.ones_like(micro_batch.temperatures))

    mask = micro_batch.loss_mask
    assert micro_batch.inference_logprobs is not None
    difference = (logprobs - micro_batch.inference_logprobs)[mask].abs()
    assert difference.max() <= 1e-4, difference.max()
    # The temperature matters to these logprobs: ignoring it misses them by far.
    not_one = mask & (micro_batch.temperatures != 1.0)
    assert (at_temperature_one - micro_batch.inference_logprobs)[not_one].abs().max() > 1e-2


async def test_router_replay_cuts_mismatch_kl_with_a_bfloat16_engine(
    models: dict[tuple[str, str], pathlib.Path],
    rollouts: dict[tuple[str, str], list[Rollout]],
) -> None:
    """The trainer service (its defaults: float32 master weights, bfloat16 compute) reports the
    mismatch_kl of its first step on the bfloat16 engine's MoE samples, once replaying the
    engine's experts and once routing on its own."""
    engine = ("moe", "bfloat16")
    samples = rollouts[engine]
    mismatch_kl = {}
    for replay in (False, True):
        config = trainer_config(
            models[engine], seq_len=SEQ_LEN, router_replay=replay, model={"compute_dtype": "bfloat16"}
        )
        async with serving(config) as stub:
            await push(stub, 1, [_micro_batch(samples, replay=True)])
            [step] = await watch(stub, after_step=0, count=1)
        mismatch_kl[replay] = step.metrics["mismatch_kl"]
    assert mismatch_kl[True] > 0  # bfloat16 rounding still differs between the two
    assert mismatch_kl[False] >= 5 * mismatch_kl[True], mismatch_kl
