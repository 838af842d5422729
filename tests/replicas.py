"""Real inference replicas for tests across services: `primerl-inference` processes on a tiny
float32 dense model, the logprobs they compute, the policy version they serve, and a copy of
the model with perturbed weights to push to them."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess

PROMPTS = [list(range(40, 72)), [(5 * i) % 200 + 30 for i in range(24)]]
# float32 engines on the same weights agree to rounding.
TOLERANCE = 1e-4
# A vLLM engine starts in ~10 s on an idle 2-core box; far slower when the box is busy.
START_TIMEOUT_S = 600.0


def inference_binary() -> str:
    search = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")])
    path = shutil.which("primerl-inference", path=search)
    if path is None:
        pytest.skip("primerl-inference is not installed")
    return path


def perturbed(model_dir: pathlib.Path, out_dir: pathlib.Path, *, seed: int) -> dict[str, torch.Tensor]:
    """A copy of the model with noise on every tensor (a model folder too, for a reference engine)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: t + 0.02 * torch.randn(t.shape, generator=generator)
        for name, t in load_file(model_dir / "model.safetensors").items()
    }
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return tensors


def replica(model_dir: pathlib.Path, port: int, *, initial_policy_version: int = 0) -> ServiceProcess:
    args = [
        inference_binary(),
        *("--engine.model", str(model_dir), "--engine.dtype", "float32", "--engine.enforce_eager", "true"),
        *("--engine.max_model_len", "256", "--engine.max_num_seqs", "4", "--engine.kv_cache_gib", "0.25"),
        *("--replica.initial_policy_version", str(initial_policy_version)),
        *("--server.host", "127.0.0.1", "--server.port", str(port), "--server.drain_delay_s", "0"),
    ]
    return ServiceProcess(args, port=port)


async def served_version(process: ServiceProcess) -> int:
    async with make_channel(process.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        return (await stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=5)).load.policy_version


async def logprobs(process: ServiceProcess, *, completion: bool = True) -> list[float]:
    """Prompt logprobs and (with `completion`) those of 4 tokens sampled with a fixed seed,
    over all PROMPTS."""
    values: list[float] = []
    async with make_channel(process.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for prompt in PROMPTS:
            request = inference_pb2.GenerateRequest(
                input=generation_pb2.GenerationInput(
                    prompt_token_ids=prompt,
                    sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3),
                    stream=generation_pb2.StreamOptions(final_only=True),
                    return_prompt_logprobs=True,
                )
            )
            outputs = [response.output async for response in stub.Generate(request, timeout=60)]
            assert outputs[-1].finished
            values += list(outputs[-1].prompt_logprobs[1:])
            if completion:
                values += list(outputs[-1].logprobs)
    return values


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
