"""The broadcaster keeping real inference replicas (primerl-inference, a tiny float32 dense
model, one process each) on the latest version: push, restart, failure, exact logprobs."""

import asyncio
import os
import pathlib
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.client import make_channel
from primerl_common.testing import ServiceProcess, free_port
from primerl_common.tiny_model import make_tiny_model

from .fakes import eventually, publish, replica_states, running_broadcaster, wait_for

pytestmark = pytest.mark.slow

PROMPTS = [list(range(40, 72)), [(5 * i) % 200 + 30 for i in range(24)]]
# float32 engines on the same weights agree to rounding.
TOLERANCE = 1e-4
# A vLLM engine starts in ~10 s on an idle 2-core box; far slower when the box is busy.
START_TIMEOUT_S = 240.0


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
    return ServiceProcess(args, port=port, env={"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"})


async def served_version(process: ServiceProcess) -> int:
    async with make_channel(process.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        return (await stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=5)).load.policy_version


async def logprobs(process: ServiceProcess) -> list[float]:
    """Prompt logprobs and those of 4 tokens sampled with a fixed seed, over all PROMPTS."""
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
            values += list(outputs[-1].prompt_logprobs[1:]) + list(outputs[-1].logprobs)
    return values


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_replicas_follow_published_versions(tmp_path: pathlib.Path):
    model = make_tiny_model(tmp_path / "tiny-dense", kind="dense", dtype="float32")
    version_1 = perturbed(model, tmp_path / "v1", seed=1)
    version_2 = perturbed(model, tmp_path / "v2", seed=2)
    a, b = replica(model, free_port()), replica(model, free_port())
    started = [a, b]  # everything started, stopped at the end whatever happens
    try:
        await asyncio.gather(a.start(START_TIMEOUT_S), b.start(START_TIMEOUT_S))
        async with running_broadcaster(probe_interval_s=0.5) as stub:
            for process, name in ((a, "a"), (b, "b")):
                await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id=name, address=process.address))
            original = await logprobs(a)

            # Version 1 reaches both replicas.
            await publish(stub, 1, version_1)
            await wait_for(stub, 1, 2, timeout_s=120)
            assert [await served_version(a), await served_version(b)] == [1, 1]
            updated = await logprobs(a)
            assert max_difference(updated, original) > 0.5
            assert max_difference(await logprobs(b), updated) <= TOLERANCE

            # b is killed and restarts on its checkpoint (version 0): it is brought back to 1 unasked.
            b.process.kill()
            await b.wait()
            b = replica(model, b.port)
            started.append(b)
            await b.start(START_TIMEOUT_S)
            await eventually(lambda: _serves(b, 1), timeout_s=60)
            assert max_difference(await logprobs(b), updated) <= TOLERANCE

            # b is down while version 2 is pushed: a moves on, b is FAILED, then catches up on return.
            b.process.kill()
            await b.wait()
            await publish(stub, 2, version_2)
            await wait_for(stub, 2, 1)
            assert await served_version(a) == 2
            await eventually(lambda: _state_is(stub, "b", pb2.REPLICA_STATE_FAILED))
            # With b comes a reference engine started on version 2's weights (they start together).
            b = replica(model, b.port)
            reference = replica(tmp_path / "v2", free_port(), initial_policy_version=2)
            started += [b, reference]
            await asyncio.gather(b.start(START_TIMEOUT_S), reference.start(START_TIMEOUT_S))
            await wait_for(stub, 2, 2, timeout_s=120)
            assert await served_version(b) == 2

        # Both serve exactly what an engine started on version 2's weights serves.
        expected = await logprobs(reference)
        assert max_difference(await logprobs(a), expected) <= TOLERANCE
        assert max_difference(await logprobs(b), expected) <= TOLERANCE
        assert max_difference(expected, updated) > 0.5
    finally:
        await asyncio.gather(*(process.stop() for process in started))


async def _serves(process: ServiceProcess, policy_version: int) -> bool:
    try:
        return await served_version(process) == policy_version
    except Exception:
        return False


async def _state_is(stub, replica_id: str, state: int) -> bool:
    return (await replica_states(stub))[replica_id][0] == state
