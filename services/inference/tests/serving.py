"""Helpers of the inference tests: tiny models, a real service on port 0, weight update
streams, and an in-process vLLM engine as the reference a fresh start gives."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import torch
from safetensors.torch import load_file, save_file

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.local_vllm import in_process_llm, restored_process_state
from primerl_common.server import GrpcService
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.testing import in_process_service
from primerl_inference.config import InferenceConfig
from primerl_inference.server import service_definition
from primerl_launcher.tiny_model import make_tiny_model

# Small enough to start fast and fit beside other engines on a shared 2-core box.
ENGINE_SETTINGS: dict[str, Any] = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8}
# Largest logprob difference between an updated engine and a fresh one (the bounds;
# bfloat16 rounding alone can move a logprob by ~1e-2 between kernels).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def tiny_model(root: pathlib.Path, kind: str, dtype: str = "float32") -> pathlib.Path:
    return make_tiny_model(root / f"{kind}-{dtype}", kind=kind, dtype=dtype)  # type: ignore[arg-type]


def checkpoint(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def perturbed_model(model_dir: pathlib.Path, out_dir: pathlib.Path, *, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `model_dir` with noise added to every tensor (written once); its tensors."""
    if not (out_dir / "model.safetensors").is_file():
        generator = torch.Generator().manual_seed(seed)
        tensors = {
            name: (t.float() + 0.02 * torch.randn(t.shape, generator=generator)).to(t.dtype)
            for name, t in checkpoint(model_dir).items()
        }
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return checkpoint(out_dir)


@dataclasses.dataclass
class Served:
    service: GrpcService
    stub: inference_pb2_grpc.InferenceServiceStub
    channel: grpc.aio.Channel
    engine: Any  # primerl_inference.engine.InferenceEngine (its module imports vLLM)


@contextlib.asynccontextmanager
async def running_service(**engine: Any) -> AsyncIterator[Served]:
    """The inference service in this process on a free port, and a stub talking to it."""
    from primerl_inference.engine import InferenceEngine

    config = InferenceConfig(engine={**ENGINE_SETTINGS, **engine}, server={"host": "127.0.0.1", "port": 0})
    with restored_process_state():
        started = await InferenceEngine.start(config)
    async with in_process_service(service_definition(started, config), config) as served:
        stub = inference_pb2_grpc.InferenceServiceStub(served.channel)
        yield Served(served.service, stub, served.channel, started)


def reference_engine(model_dir: pathlib.Path, dtype: str, **engine: Any) -> contextlib.AbstractContextManager[Any]:
    """A fresh vLLM engine on `model_dir`, in this process (it starts in seconds), set up as
    the service sets up its own."""
    return in_process_llm(model_dir, dtype=dtype, logprobs_mode="processed_logprobs", **{**ENGINE_SETTINGS, **engine})


def reference_logprobs(llm: Any, prompts: list[list[int]], *, num_tokens: int, seed: int) -> list[list[float]]:
    """Per prompt: its prompt logprobs (after the first token), then those of `num_tokens`
    tokens sampled at temperature 1 with `seed`, as `sample` below reports them."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=1.0, max_tokens=num_tokens, ignore_eos=True, seed=seed, logprobs=0, prompt_logprobs=0
    )
    results = []
    for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        steps = zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:], strict=True)
        prompt = [step[t].logprob for step, t in steps]
        completion = output.outputs[0]
        sampled = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        results.append(prompt + sampled)
    return results


async def sample(
    stub: inference_pb2_grpc.InferenceServiceStub, prompts: list[list[int]], *, num_tokens: int, seed: int
) -> list[list[float]]:
    """`reference_logprobs` through the service."""
    results = []
    for prompt in prompts:
        final = await final_output(
            stub,
            generation_pb2.GenerationInput(
                prompt_token_ids=prompt,
                sampling=generation_pb2.SamplingParams(
                    temperature=1.0, max_tokens=num_tokens, ignore_eos=True, seed=seed
                ),
                stream=generation_pb2.StreamOptions(final_only=True),
                return_prompt_logprobs=True,
            ),
        )
        results.append(list(final.prompt_logprobs[1:]) + list(final.logprobs))
    return results


async def assert_update_matches_a_fresh_engine(
    stub: inference_pb2_grpc.InferenceServiceStub,
    model_dir: pathlib.Path,
    dtype: str,
    scratch_dir: pathlib.Path,
    *,
    tolerance: float,
    kernel_format: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    **engine: Any,
) -> None:
    """After UpdateWeights with perturbed weights the service computes what an engine
    started on them computes (`engine`: its settings beyond ENGINE_SETTINGS), and updating
    back to the original weights restores the original logprobs. With `kernel_format` (HF
    tensors -> the engine's kernel layout), an update of the perturbed weights in that format
    computes the same too (the service is left on the original weights)."""
    prompts = [list(range(40, 72)), [(5 * i) % 200 + 30 for i in range(24)]]
    num_tokens, seed = 4, 3
    perturbed = perturbed_model(model_dir, scratch_dir, seed=1)
    version = await policy_version(stub)

    original = await sample(stub, prompts, num_tokens=num_tokens, seed=seed)
    first = await update_weights(stub, perturbed)
    updated = await sample(stub, prompts, num_tokens=num_tokens, seed=seed)
    second = await update_weights(stub, checkpoint(model_dir))
    restored = await sample(stub, prompts, num_tokens=num_tokens, seed=seed)
    kernel_updated = None
    if kernel_format is not None:
        kernel = tensor_pb2.WEIGHT_FORMAT_KERNEL
        await stub.UpdateWeights(update_stream(kernel_format(perturbed), version + 3, weight_format=kernel))
        kernel_updated = await sample(stub, prompts, num_tokens=num_tokens, seed=seed)
        await update_weights(stub, checkpoint(model_dir))
    with reference_engine(scratch_dir, dtype, **engine) as llm:
        fresh = reference_logprobs(llm, prompts, num_tokens=num_tokens, seed=seed)

    def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
        return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))

    assert (first.policy_version, second.policy_version) == (version + 1, version + 2)
    assert first.num_tensors == len(perturbed) and first.pause_s <= first.total_s
    assert max_difference(updated, original) > 0.5  # the update took effect
    assert max_difference(updated, fresh) <= tolerance
    assert max_difference(restored, original) <= tolerance
    if kernel_updated is not None:
        assert max_difference(kernel_updated, fresh) <= tolerance


async def generate(
    stub: inference_pb2_grpc.InferenceServiceStub, input: generation_pb2.GenerationInput
) -> list[generation_pb2.GenerationOutput]:
    return [response.output async for response in stub.Generate(inference_pb2.GenerateRequest(input=input))]


async def final_output(
    stub: inference_pb2_grpc.InferenceServiceStub, input: generation_pb2.GenerationInput
) -> generation_pb2.GenerationOutput:
    outputs = await generate(stub, input)
    assert outputs[-1].finished
    return outputs[-1]


def update_stream(
    tensors: dict[str, torch.Tensor],
    policy_version: int,
    *,
    num_tensors: int | None = None,
    num_bytes: int | None = None,
    weight_format: int = tensor_pb2.WEIGHT_FORMAT_HF,
    delta: bool = False,
    base_policy_version: int = 0,
    shared_fs_path: pathlib.Path | None = None,
    shm_path: pathlib.Path | None = None,
) -> Iterator[inference_pb2.UpdateWeightsRequest]:
    """An UpdateWeights request stream: `begin`, then the tensors in 256 KiB chunks (none
    when the tensors lie in `shared_fs_path` or `shm_path`)."""
    begin = inference_pb2.WeightUpdateBegin(
        policy_version=policy_version,
        format=weight_format,
        num_tensors=len(tensors) if num_tensors is None else num_tensors,
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()) if num_bytes is None else num_bytes,
        delta=delta,
        base_policy_version=base_policy_version,
        shared_fs_path="" if shared_fs_path is None else str(shared_fs_path),
        shm_path="" if shm_path is None else str(shm_path),
    )
    yield inference_pb2.UpdateWeightsRequest(begin=begin)
    if shared_fs_path is not None or shm_path is not None:
        return
    for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=256 * 1024):
        yield inference_pb2.UpdateWeightsRequest(chunk=chunk)


def kernel_format(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named Qwen3 / Qwen3-MoE weights in vLLM's kernel layout, written out here from the
    layout's definition (q, k, v rows fused; gate, up rows fused; experts stacked) to check
    the engine against it independently of the broadcaster's converter."""
    out = {}
    for name, t in tensors.items():
        if match := re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name):
            experts, index, projection = match.groups()
            if index == "0" and projection == "down":
                out[f"{experts}.routed_experts.w13_weight"] = _stacked(tensors, experts, ("gate_proj", "up_proj"))
                out[f"{experts}.routed_experts.w2_weight"] = _stacked(tensors, experts, ("down_proj",))
        elif match := re.fullmatch(r"(.+)\.(q|gate)_proj\.weight", name):
            prefix, first = match.groups()
            fused, parts = ("qkv_proj", ("q", "k", "v")) if first == "q" else ("gate_up_proj", ("gate", "up"))
            out[f"{prefix}.{fused}.weight"] = torch.cat([tensors[f"{prefix}.{p}_proj.weight"] for p in parts])
        elif not re.search(r"\.(k|v|up)_proj\.weight$", name):
            out[name] = t
    return out


def _stacked(tensors: dict[str, torch.Tensor], experts: str, projections: tuple[str, ...]) -> torch.Tensor:
    """[experts, rows of `projections` one after the other, columns]."""
    num_experts = sum(1 for n in tensors if n.startswith(f"{experts}.") and n.endswith(".down_proj.weight"))
    return torch.stack(
        [torch.cat([tensors[f"{experts}.{e}.{p}.weight"] for p in projections]) for e in range(num_experts)]
    )


async def policy_version(stub: inference_pb2_grpc.InferenceServiceStub) -> int:
    return (await stub.GetLoad(inference_pb2.GetLoadRequest())).load.policy_version


async def update_weights(
    stub: inference_pb2_grpc.InferenceServiceStub, tensors: dict[str, torch.Tensor], version: int | None = None
) -> inference_pb2.UpdateWeightsResponse:
    """A full update to `version` (default: the next one)."""
    version = await policy_version(stub) + 1 if version is None else version
    return await stub.UpdateWeights(update_stream(tensors, version))


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    """The error a call (awaitable, or a response stream) fails with."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded")


async def status_of(call: Any) -> grpc.StatusCode:
    """The status code a call (awaitable, or a response stream) fails with."""
    return (await refusal(call)).code()
