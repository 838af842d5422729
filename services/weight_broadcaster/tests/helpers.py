"""Helpers of the broadcaster's tests: the broadcaster in-process on a free port, publishing
to it and waiting on it, and real inference replicas (`primerl-inference` processes on a tiny
float32 dense model) with the logprobs they compute."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import sys
from collections.abc import AsyncIterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.testing import ServiceProcess, in_process_service
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build

# Short probe and retry intervals, so that restarts and failures resolve in test time.
FAST_PUSH = {"probe_interval_s": 0.2, "retry_initial_s": 0.1, "retry_max_s": 0.5, "probe_timeout_s": 2.0}


@contextlib.asynccontextmanager
async def running_broadcaster(
    replicas: list[dict[str, object]] | None = None,
    shared_fs: dict[str, object] | None = None,
    store: dict[str, object] | None = None,
    **push: float,
) -> AsyncIterator[weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub]:
    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0},
        push={**FAST_PUSH, **push},
        replicas=replicas or [],
        shared_fs=shared_fs or {},
        store=store or {},
    )
    async with in_process_service(await build(config), config) as served:
        yield weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel)


async def publish(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    policy_version: int,
    tensors: dict[str, torch.Tensor],
) -> pb2.PublishWeightsResponse:
    async def requests():
        yield pb2.PublishWeightsRequest(
            begin=pb2.PublishBegin(
                policy_version=policy_version,
                kind=pb2.PUBLISH_KIND_FULL,
                num_tensors=len(tensors),
                num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            )
        )
        for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=1024):
            yield pb2.PublishWeightsRequest(chunk=chunk)

    return await stub.PublishWeights(requests())


async def wait_for(
    stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub,
    policy_version: int,
    min_replicas: int,
    *,
    timeout_s: float = 30.0,
) -> pb2.WaitForVersionResponse:
    request = pb2.WaitForVersionRequest(
        policy_version=policy_version, min_replicas=min_replicas, timeout_ms=int(timeout_s * 1000)
    )
    reply = await stub.WaitForVersion(request)
    assert reply.reached, reply
    return reply


async def replica_states(stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub) -> dict[str, tuple[int, int]]:
    status = await stub.GetStatus(pb2.GetStatusRequest())
    return {r.replica_id: (r.state, r.policy_version) for r in status.replicas}


# ----------------------------------------------------------------------------- real replicas

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
