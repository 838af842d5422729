"""What the service does when the engine fails or is overloaded: weights holding NaN or Inf are
refused before anything is loaded (streamed, in a shared folder, over a collective group); a load
that fails inside the engine after its checks leaves the replica serving the previous weights bit
for bit (nothing written yet) or out of service until a whole version is in (part written); a
trickling update stream and 10x the admitted Generate calls are refused within a stated bound on
the growth of the replica's RSS (it is served in this process), and the next call is served; and
a dead engine makes a dead service (a real process whose engine process is killed)."""

import asyncio
import itertools
import pathlib
import signal
import sys
import time

import grpc
import psutil
import pytest
import torch
import torch.distributed as dist
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.admission import RETRY_AFTER_METADATA
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.tensors import dtype_to_proto, iter_tensor_chunks
from primerl_common.testing import eventually, rss_bytes
from primerl_common.weights.collective import GroupSpec, TensorSpec, connect, send_tensors
from primerl_common.weights.manifest import write_weights

from .serving import (
    Served,
    checkpoint,
    generate,
    kernel_format,
    perturbed_model,
    policy_version,
    refusal,
    sample,
    status_of,
    update_stream,
    update_weights,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = [list(range(40, 72)), [(5 * i) % 200 + 30 for i in range(24)]]
SERVICE = "primerl.inference.v1.InferenceService"
MiB = 1024 * 1024


async def logprobs(served: Served) -> list[list[float]]:
    return await sample(served.stub, PROMPTS, num_tokens=4, seed=3)


async def version_and_logprobs(served: Served) -> tuple[int, list[list[float]]]:
    """The policy version served now and PROMPTS' logprobs under it: what a refused update
    must leave as it was."""
    return await policy_version(served.stub), await logprobs(served)


async def health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    return reply.status


def long_generation() -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        input=generation_pb2.GenerationInput(
            prompt_token_ids=PROMPTS[0],
            sampling=generation_pb2.SamplingParams(max_tokens=400, ignore_eos=True, seed=1),
        )
    )


async def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(
    served: Served, model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    stub = served.stub
    version, before = await version_and_logprobs(served)
    original = checkpoint(model_dir)
    name = "model.layers.1.mlp.down_proj.weight"
    with_nan = {**original, name: original[name].clone()}
    with_nan[name][3, 5] = float("nan")
    kernel = kernel_format(original)
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    kernel[fused] = kernel[fused].clone()
    kernel[fused][-1, -1] = float("-inf")
    folder = tmp_path / "nan"
    write_weights(folder, with_nan.items(), policy_version=version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_HF)
    cases = {
        "hf stream": (update_stream(with_nan, version + 1), name, "chunk.data"),
        "kernel stream": (
            update_stream(kernel, version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_KERNEL),
            fused,
            "chunk.data",
        ),
        "shared folder": (update_stream(with_nan, version + 1, shared_fs_path=folder), name, "begin.shared_fs_path"),
    }
    errors = {case: await refusal(stub.UpdateWeights(stream)) for case, (stream, _, _) in cases.items()}
    errors["collective group"] = await collective_update(stub, with_nan, version + 1)
    cases["collective group"] = (None, name, "begin.collective_tensors")

    for case, (_, tensor, field) in cases.items():
        error = errors[case]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert f"tensor {tensor!r} holds NaN or Inf" in error.details(), case
        assert field in str(error.trailing_metadata()), case

    assert await policy_version(stub) == version
    assert await logprobs(served) == before  # bit for bit


async def collective_update(
    stub: inference_pb2_grpc.InferenceServiceStub, tensors: dict[str, torch.Tensor], version: int
) -> grpc.aio.AioRpcError:
    """An update over a gloo group this test hosts (rank 0 sends, as the broadcaster would);
    the error it fails with."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = GroupSpec(f"127.0.0.1:{store.port}", "nan-test", 0, 2, "gloo", 60.0, 1 << 20)
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]

    def send() -> None:
        for _ in send_tensors(connect(group), group, specs, tensors.items()):
            pass

    sending = asyncio.get_running_loop().run_in_executor(None, send)
    begin = inference_pb2.WeightUpdateBegin(
        policy_version=version,
        format=tensor_pb2.WEIGHT_FORMAT_HF,
        num_tensors=len(specs),
        num_bytes=sum(spec.num_bytes for spec in specs),
        collective=inference_pb2.CollectiveGroup(
            store_address=group.store_address,
            group_name=group.group_name,
            rank=1,
            world_size=2,
            backend="gloo",
            timeout_ms=60_000,
            bucket_bytes=group.bucket_bytes,
        ),
        collective_tensors=[
            tensor_pb2.TensorHeader(name=spec.name, dtype=dtype_to_proto(spec.dtype), shape=list(spec.shape))
            for spec in specs
        ],
    )
    error = await refusal(stub.UpdateWeights(iter([inference_pb2.UpdateWeightsRequest(begin=begin)])))
    await sending
    return error


async def test_a_load_failing_before_it_writes_leaves_the_weights_bit_for_bit(
    served: Served, model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    stub = served.stub
    version, before = await version_and_logprobs(served)
    perturbed = perturbed_model(model_dir, tmp_path / "perturbed", seed=1)
    await served.engine.llm.collective_rpc("primerl_fail_next_load", args=(0,))

    error = await refusal(update_weights(stub, perturbed))

    assert error.code() == grpc.StatusCode.INTERNAL
    assert "nothing was written" in error.details() and "injected load failure" in error.details()
    assert await health(served.channel) == health_pb2.HealthCheckResponse.SERVING
    assert await policy_version(stub) == version
    assert await logprobs(served) == before


async def test_a_load_failing_half_way_takes_the_replica_out_of_service_until_a_whole_version_loads(
    served: Served, model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    stub = served.stub
    version, before = await version_and_logprobs(served)
    original = checkpoint(model_dir)
    perturbed = perturbed_model(model_dir, tmp_path / "perturbed", seed=1)
    in_flight = stub.Generate(long_generation())
    await in_flight.read()  # running in the engine
    await served.engine.llm.collective_rpc("primerl_fail_next_load", args=(len(perturbed) // 2,))

    failed = await refusal(update_weights(stub, perturbed))
    cut = await refusal(in_flight)
    refused = await refusal(generate(stub, long_generation().input))
    layer_1 = {n: t for n, t in original.items() if ".layers.1." in n}
    delta = await status_of(
        stub.UpdateWeights(update_stream(layer_1, version + 1, delta=True, base_policy_version=version))
    )
    status_while_out = await health(served.channel)
    restored = await update_weights(stub, original)

    assert failed.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed inside the engine after writing" in failed.details()
    for error in (cut, refused):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"loading policy version {version + 1} failed" in error.details()
    assert delta == grpc.StatusCode.FAILED_PRECONDITION
    assert status_while_out == health_pb2.HealthCheckResponse.NOT_SERVING
    assert restored.policy_version == version + 1  # the failed version's number was never served
    assert await health(served.channel) == health_pb2.HealthCheckResponse.SERVING
    assert await logprobs(served) == before


@pytest.mark.slow
async def test_a_trickling_update_stream_ends_on_its_idle_deadline_and_changes_nothing(
    served: Served, model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`begin` and the first chunk of a two-chunk tensor, then nothing: the service's admission
    idle deadline (1 s here) ends the call DEADLINE_EXCEEDED (STREAM_IDLE); the update is
    abandoned whole (version, logprobs as before, not updating) and frees the update lock. The
    replica holds at most that chunk (256 KiB) meanwhile: its RSS grows by less than 32 MiB."""
    # The running service's own admission settings, which its interceptor reads at each call.
    monkeypatch.setattr(served.service.config.admission, "stream_idle_timeout_s", 1.0)
    stub = served.stub
    version, before = await version_and_logprobs(served)
    original = checkpoint(model_dir)
    name, tensor = max(original.items(), key=lambda item: item[1].numel())
    half = tensor.numel() * tensor.element_size() // 2
    first, second = iter_tensor_chunks([(name, tensor)], chunk_bytes=half)  # two chunks of one tensor
    assert first.HasField("header") and not second.HasField("header")
    stalled = asyncio.Event()

    async def trickle():  # type: ignore[no-untyped-def]
        (begin,) = itertools.islice(update_stream(original, version + 1), 1)
        yield begin
        yield inference_pb2.UpdateWeightsRequest(chunk=first)
        stalled.set()
        await asyncio.sleep(60)  # never sends the rest

    rss_before = rss_bytes()
    started = time.monotonic()
    error = await refusal(stub.UpdateWeights(trickle()))
    took_s = time.monotonic() - started
    grown = rss_bytes() - rss_before

    assert stalled.is_set()
    assert grown < 32 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert "admission.stream_idle_timeout_s" in error.details()
    assert [d.reason for d in error_details(error) if isinstance(d, error_details_pb2.ErrorInfo)] == ["STREAM_IDLE"]
    assert 1.0 <= took_s < 3.5, took_s
    load = (await stub.GetLoad(inference_pb2.GetLoadRequest())).load
    assert (load.policy_version, load.updating_weights) == (version, False)
    assert await logprobs(served) == before
    # The update lock was freed: a whole update goes through at once.
    reply = await update_weights(stub, original, version + 1)
    assert reply.policy_version == version + 1 == await policy_version(stub)


async def test_ten_times_the_admitted_generate_calls_are_refused_at_once_and_the_next_is_served(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With admission.max_concurrent_streams at 2 and two generations running, 20 more Generate
    calls are each refused RESOURCE_EXHAUSTED with a retry hint, at once (nothing reaches the
    engine), the replica's RSS growing by less than 32 MiB; once the two end, the next is served."""
    allowed = 2
    assert served.service.admission is not None
    streams = served.service.admission.streams
    monkeypatch.setattr(streams, "limit", allowed)  # read at each call
    stub = served.stub
    running = [stub.Generate(long_generation()) for _ in range(allowed)]
    try:
        for call in running:
            await call.read()  # generating in the engine
        num_requests = served.engine.llm.get_num_unfinished_requests()
        before = rss_bytes()
        started = time.monotonic()
        calls = (refusal(generate(stub, long_generation().input)) for _ in range(10 * allowed))
        errors = await asyncio.gather(*calls)
        took_s = time.monotonic() - started
        grown = rss_bytes() - before
        num_requests_after = served.engine.llm.get_num_unfinished_requests()
    finally:
        for call in running:
            call.cancel()
    await eventually(lambda: streams.num_held == 0, timeout_s=10, what="the cancelled generations ended")
    served_next = await generate(stub, sample_input(max_tokens=4))

    for error in errors:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert f"admission.max_concurrent_streams = {allowed}" in error.details()
        assert int(dict(error.trailing_metadata())[RETRY_AFTER_METADATA]) > 0
        assert any(isinstance(d, error_details_pb2.RetryInfo) for d in error_details(error))
    assert took_s < 5, took_s
    assert num_requests_after == num_requests == allowed  # none of the refused reached the engine
    assert grown < 32 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
    assert served_next[-1].finished and sum(len(output.token_ids) for output in served_next) == 4


def sample_input(*, max_tokens: int) -> generation_pb2.GenerationInput:
    return generation_pb2.GenerationInput(
        prompt_token_ids=PROMPTS[1],
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1),
    )


async def test_a_dead_engine_is_a_dead_service(model_dir: pathlib.Path) -> None:
    port = free_port()
    process = ServiceProcess(
        [
            str(pathlib.Path(sys.executable).parent / "primerl-inference"),
            *("--engine.model", str(model_dir), "--engine.dtype", "float32", "--engine.enforce_eager", "true"),
            *("--engine.max_model_len", "512", "--engine.max_num_seqs", "4"),
            # A window in which health and new calls can be seen before the server stops.
            *("--server.host", "127.0.0.1", "--server.port", str(port), "--server.drain_delay_s", "3"),
        ],
        port=port,
    )
    # No size given anywhere: the service sizes the CPU KV cache itself (kv_cache_size.py).
    process.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        await process.start(timeout_s=600)
        async with make_channel(process.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            in_flight = stub.Generate(long_generation())
            await in_flight.read()
            (engine_core,) = [
                child
                for child in psutil.Process(process.pid).children(recursive=True)
                if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name()
            ]
            engine_core.send_signal(signal.SIGKILL)
            killed_at = asyncio.get_running_loop().time()

            cut = await refusal(in_flight)
            await eventually(
                lambda: _not_serving(channel), timeout_s=5, what="health NOT_SERVING after the engine died"
            )
            not_serving_after_s = asyncio.get_running_loop().time() - killed_at
            refused = await refusal(generate(stub, long_generation().input))
        exit_code = await process.wait(timeout_s=60)
    finally:
        await process.stop()
        log = process.output()
        process.close()

    for error in (cut, refused):
        assert error.code() == grpc.StatusCode.UNAVAILABLE, log
        assert "the vLLM engine process died" in error.details()
    assert not_serving_after_s < 5
    assert exit_code == 1, log
    assert "CPU KV cache: 0.250 GiB (4 sequences x 512 tokens" in log


async def _not_serving(channel: grpc.aio.Channel) -> bool:
    return await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
