"""primerl.inference.v1.InferenceService: proto <-> domain translation only."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import grpc
import torch

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common import security
from primerl_common.errors import InvalidArgument, draining_on_error
from primerl_common.observability import policy_version_var
from primerl_common.server import ServiceDefinition
from primerl_common.tensors import TensorChunkView, tensor_to_proto
from primerl_inference.adapters import AdapterSpec
from primerl_inference.collective_receiver import collective_update_from_proto
from primerl_inference.engine import InferenceEngine, PauseMode
from primerl_inference.generation import (
    GenerateRequest,
    GenerationChunk,
    KvTransferMode,
    SamplingSpec,
    StreamPolicy,
)
from primerl_inference.load import LoadReport
from primerl_inference.update_requests import parse_update_request
from primerl_inference.weights import WeightFormat, WeightUpdate

_FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}
_ROLES = {
    "both": generation_pb2.REPLICA_ROLE_BOTH,
    "prefill": generation_pb2.REPLICA_ROLE_PREFILL,
    "decode": generation_pb2.REPLICA_ROLE_DECODE,
}
_KV_TRANSFER_MODES: dict[int, KvTransferMode] = {
    generation_pb2.KV_TRANSFER_MODE_UNSPECIFIED: "",
    generation_pb2.KV_TRANSFER_MODE_PREFILL_ONLY: "prefill",
    generation_pb2.KV_TRANSFER_MODE_DECODE_FROM_STORE: "decode",
}
_PAUSE_MODES: dict[int, PauseMode] = {
    inference_pb2.PAUSE_MODE_KEEP: "keep",
    inference_pb2.PAUSE_MODE_WAIT: "wait",
    inference_pb2.PAUSE_MODE_ABORT: "abort",
}
_WEIGHT_FORMATS: dict[int, WeightFormat] = {
    tensor_pb2.WEIGHT_FORMAT_UNSPECIFIED: "unspecified",
    tensor_pb2.WEIGHT_FORMAT_HF: "hf",
    tensor_pb2.WEIGHT_FORMAT_KERNEL: "kernel",
    tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8: "kernel_fp8",
}


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, definition: ServiceDefinition, engine: InferenceEngine, *, watch_interval_ms: int) -> None:
        self._definition = definition
        self._engine = engine
        self._watch_interval_ms = watch_interval_ms

    async def GetServiceInfo(
        self, request: inference_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetServiceInfoResponse:
        return inference_pb2.GetServiceInfoResponse(info=self._definition.info())

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        policy_version_var.set(self._engine.policy_version)
        generate_request = generate_request_from_proto(request.input)
        caller = security.caller_of(context)
        # aclosing: when the client goes away the request is aborted in the engine at once.
        async with contextlib.aclosing(self._engine.generate(generate_request, caller=caller)) as chunks:
            async for chunk in chunks:
                response = inference_pb2.GenerateResponse()
                fill_output(
                    response.output,
                    chunk,
                    generate_request.request_id,
                    self._engine.replica_id,
                    with_prompt=bool(generate_request.images),
                )
                yield response

    async def UpdateWeights(
        self, request_iterator: AsyncIterable[bytes], context: grpc.aio.ServicerContext
    ) -> inference_pb2.UpdateWeightsResponse:
        """Registered with no request deserializer (server.py): requests arrive serialized, and
        each chunk's data is staged from the bytes it came in (`parse_update_request`)."""
        policy_version_var.set(self._engine.policy_version)
        raw_requests = aiter(request_iterator)
        return await draining_on_error(raw_requests, self._update_weights(_parsed(raw_requests)))

    async def _update_weights(
        self, requests: AsyncIterator[inference_pb2.UpdateWeightsRequest | TensorChunkView]
    ) -> inference_pb2.UpdateWeightsResponse:
        first = await anext(requests, None)
        if not isinstance(first, inference_pb2.UpdateWeightsRequest) or first.WhichOneof("item") != "begin":
            raise InvalidArgument("the first message must be `begin`", field="begin")
        update = weight_update_from_proto(first.begin)
        collective = collective_update_from_proto(first.begin)
        result = await self._engine.weight_updater.update(update, _update_chunks(requests), collective)
        return inference_pb2.UpdateWeightsResponse(
            policy_version=result.policy_version,
            num_tensors=result.num_tensors,
            num_bytes=result.num_bytes,
            pause_s=result.pause_s,
            total_s=result.total_s,
        )

    async def PauseGeneration(
        self, request: inference_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.PauseGenerationResponse:
        mode = _PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidArgument("must be PAUSE_MODE_KEEP, PAUSE_MODE_WAIT or PAUSE_MODE_ABORT", field="mode")
        await self._engine.pause(mode)
        return inference_pb2.PauseGenerationResponse(load=self._load())

    async def ResumeGeneration(
        self, request: inference_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ResumeGenerationResponse:
        await self._engine.resume()
        return inference_pb2.ResumeGenerationResponse(load=self._load())

    async def ResetPrefixCache(
        self, request: inference_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ResetPrefixCacheResponse:
        return inference_pb2.ResetPrefixCacheResponse(reset=await self._engine.reset_prefix_cache())

    async def GetLoad(
        self, request: inference_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetLoadResponse:
        return inference_pb2.GetLoadResponse(load=self._load())

    async def WatchLoad(
        self, request: inference_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.WatchLoadResponse]:
        interval_s = (request.interval_ms or self._watch_interval_ms) / 1000
        while True:
            load = self._load()
            yield inference_pb2.WatchLoadResponse(load=load)
            if load.draining:
                # The last report says so; a stream that went on would hold a graceful stop for
                # its whole grace period.
                return
            await asyncio.sleep(interval_s)

    def _load(self) -> generation_pb2.LoadReport:
        load = load_to_proto(self._engine.load_report())
        load.adapter_versions.update({spec.name: spec.policy_version for spec in self._engine.adapters()})
        load.adapter_owners.update(self._engine.adapter_owners())
        return load

    async def LoadAdapter(
        self, request_iterator: AsyncIterable[inference_pb2.LoadAdapterRequest], context: grpc.aio.ServicerContext
    ) -> inference_pb2.LoadAdapterResponse:
        requests = aiter(request_iterator)
        return await draining_on_error(requests, self._load_adapter(requests))

    async def _load_adapter(
        self, requests: AsyncIterator[inference_pb2.LoadAdapterRequest]
    ) -> inference_pb2.LoadAdapterResponse:
        first = await anext(requests, None)
        if first is None or first.WhichOneof("item") != "spec":
            raise InvalidArgument("the first message must be `spec`", field="spec")
        spec = adapter_spec_from_proto(first.spec)
        replaced = await self._engine.load_adapter(spec, _items(requests, "chunk", after="spec"))
        return inference_pb2.LoadAdapterResponse(name=spec.name, replaced=replaced)

    async def UnloadAdapter(
        self, request: inference_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.UnloadAdapterResponse:
        return inference_pb2.UnloadAdapterResponse(unloaded=await self._engine.unload_adapter(request.name))

    async def ListAdapters(
        self, request: inference_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListAdaptersResponse:
        return inference_pb2.ListAdaptersResponse(adapters=[adapter_spec_to_proto(s) for s in self._engine.adapters()])


async def _parsed(
    raw_requests: AsyncIterator[bytes],
) -> AsyncIterator[inference_pb2.UpdateWeightsRequest | TensorChunkView]:
    async for raw in raw_requests:
        yield parse_update_request(raw)


async def _update_chunks(
    requests: AsyncIterator[inference_pb2.UpdateWeightsRequest | TensorChunkView],
) -> AsyncIterator[TensorChunkView]:
    """The chunks of an UpdateWeights stream after its `begin`."""
    async for request in requests:
        if isinstance(request, TensorChunkView):
            yield request
        elif request.WhichOneof("item") == "chunk":
            yield TensorChunkView.of(request.chunk)
        else:
            raise InvalidArgument("may only be the first message of the stream", field="begin")


async def _items(requests: AsyncIterator[Any], field: str, *, after: str) -> AsyncIterator[Any]:
    """The `field` of each message of a oneof stream whose first message was `after`."""
    async for message in requests:
        if message.WhichOneof("item") != field:
            raise InvalidArgument("may only be the first message of the stream", field=after)
        yield getattr(message, field)


def generate_request_from_proto(input: generation_pb2.GenerationInput) -> GenerateRequest:
    sampling = input.sampling
    kv_transfer = _KV_TRANSFER_MODES.get(input.kv_transfer.mode)
    if kv_transfer is None:
        raise InvalidArgument(f"unknown mode {input.kv_transfer.mode}", field="input.kv_transfer.mode")

    def optional(name: str, default: Any) -> Any:
        return getattr(sampling, name) if sampling.HasField(name) else default

    return GenerateRequest(
        request_id=input.request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(input.prompt_token_ids),
        sampling=SamplingSpec(
            temperature=optional("temperature", 1.0),
            top_p=optional("top_p", 1.0),
            top_k=optional("top_k", 0),
            min_p=optional("min_p", 0.0),
            max_tokens=sampling.max_tokens or None,
            min_tokens=sampling.min_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids),
            seed=optional("seed", None),
            ignore_eos=sampling.ignore_eos,
            repetition_penalty=optional("repetition_penalty", 1.0),
            presence_penalty=optional("presence_penalty", 0.0),
            frequency_penalty=optional("frequency_penalty", 0.0),
        ),
        stream=StreamPolicy(
            every_n_tokens=input.stream.every_n_tokens,
            every_ms=input.stream.every_ms,
            final_only=input.stream.final_only,
        ),
        cache_salt=input.cache_salt,
        lora_adapter=input.lora_adapter,
        return_prompt_logprobs=input.return_prompt_logprobs,
        return_routed_experts=input.return_routed_experts,
        min_policy_version=input.min_policy_version,
        kv_transfer=kv_transfer,
        images=tuple((image.data, image.mime_type) for image in input.images),
    )


def fill_output(
    output: generation_pb2.GenerationOutput,
    chunk: GenerationChunk,
    request_id: str,
    replica_id: str,
    *,
    with_prompt: bool = False,
) -> None:
    """Writes `chunk` into `output` (in place: one message per token, no copies).
    `with_prompt`: the final one also gets the prompt as the engine ran it (for a prompt with
    images, whose tokens the engine expanded)."""
    output.request_id = request_id
    output.offset = chunk.offset
    output.token_ids.extend(chunk.token_ids)
    output.logprobs.extend(chunk.logprobs)
    output.policy_versions.extend(chunk.policy_versions)
    output.finished = chunk.finished
    output.replica_id = replica_id
    if chunk.finish_reason is not None:
        output.finish_reason = _FINISH_REASONS[chunk.finish_reason]
    if chunk.prompt_logprobs is not None:
        output.prompt_logprobs.extend(chunk.prompt_logprobs)
    if with_prompt and chunk.prompt_token_ids is not None:
        output.prompt_token_ids.extend(chunk.prompt_token_ids)
    if chunk.routed_experts is not None:
        output.routed_experts.CopyFrom(tensor_to_proto(torch.from_numpy(chunk.routed_experts)))
        output.routed_experts_start = chunk.routed_experts_start
    if chunk.stats is not None:
        stats = chunk.stats
        output.stats.num_prompt_tokens = stats.num_prompt_tokens
        output.stats.num_cached_prompt_tokens = stats.num_cached_prompt_tokens
        output.stats.num_output_tokens = stats.num_output_tokens
        output.stats.time_to_first_token_s = stats.time_to_first_token_s
        output.stats.total_time_s = stats.total_time_s


def load_to_proto(load: LoadReport) -> generation_pb2.LoadReport:
    return generation_pb2.LoadReport(
        num_waiting=load.num_waiting,
        num_running=load.num_running,
        kv_cache_usage=load.kv_cache_usage,
        policy_version=load.policy_version,
        updating_weights=load.updating_weights,
        paused=load.paused,
        draining=load.draining,
        role=_ROLES[load.role],
        num_prompt_tokens_total=load.num_prompt_tokens_total,
        num_generated_tokens_total=load.num_generated_tokens_total,
        num_prefix_cache_hit_tokens_total=load.num_prefix_cache_hit_tokens_total,
        num_kv_pool_hit_tokens_total=load.num_kv_pool_hit_tokens_total,
    )


def weight_update_from_proto(begin: inference_pb2.WeightUpdateBegin) -> WeightUpdate:
    weight_format = _WEIGHT_FORMATS.get(begin.format)
    if weight_format is None:
        raise InvalidArgument(f"unknown weight format {begin.format}", field="begin.format")
    return WeightUpdate(
        policy_version=begin.policy_version,
        format=weight_format,
        num_tensors=begin.num_tensors,
        num_bytes=begin.num_bytes,
        delta=begin.delta,
        base_policy_version=begin.base_policy_version,
        shared_fs_path=begin.shared_fs_path,
        shm_path=begin.shm_path,
        stripe_session=begin.stripe_session,
        num_stripes=begin.num_stripes,
        stripe_index=begin.stripe_index,
    )


def adapter_spec_from_proto(spec: inference_pb2.AdapterSpec) -> AdapterSpec:
    return AdapterSpec(
        name=spec.name,
        path=spec.path,
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=tuple(spec.target_modules),
        policy_version=spec.policy_version,
        owner=spec.owner,
    )


def adapter_spec_to_proto(spec: AdapterSpec) -> inference_pb2.AdapterSpec:
    return inference_pb2.AdapterSpec(
        name=spec.name,
        path=spec.path,
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=list(spec.target_modules),
        policy_version=spec.policy_version,
        owner=spec.owner,
    )
