"""Prefill/decode disaggregation: one Generate served in two halves through the kvstore.

With `routing.disaggregate` on, a request that names no role goes first to a prefill
replica (`KV_TRANSFER_MODE_PREFILL_ONLY`: it computes the prompt's KV, saves its whole
blocks to the pool, stops after one token, answers once), then to a decode replica
(`KV_TRANSFER_MODE_DECODE_FROM_STORE`: it loads those blocks, computes the rest of the
prompt and decodes), whose stream goes to the client. Both halves carry one transfer id
(the request id, or a new one) and go through the ordinary forwarding path with their role
set in the routing hints, so replica choice, retries before the first message and request
accounting are those of any request. The prefill half's sampled token is dropped: the
decode half samples the completion from its first token on, with the request's own seed.

The decode half's final message is completed from the prefill half's answer:
- routed experts: the prompt's rows come from the prefill replica, the completion's from
  the decode replica. Prefill wins for the prompt: it computed (or loaded with their
  routing) every prompt token. The decode replica's own prompt rows (the loaded blocks'
  routing, stored with them by the prefill replica, and the tail it recomputed) equal them
  up to kernel noise and are replaced; where its prompt blocks came without routing it
  sends the completion's rows only (`routed_experts_start` = prompt length). Either way
  the merged payload has a row for every prompt and completion token.
- prompt logprobs: asked of the prefill half only (a request with prompt logprobs reads no
  cache, so the decode half would recompute the whole prompt).
- stats: the decode half's (its cached prompt tokens show what the pool supplied), with the
  prefill half's time added to time to first token and total time.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence

import grpc

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.router.v1 import router_pb2
from primerl_common.errors import InvalidArgument, ServiceError, Unavailable

__all__ = ["Disaggregation", "merge_outputs"]

# What Forwarder.generate takes: (request bytes, call context).
Generate = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[None]]


class _HalfContext:
    """The client's call context for one half: same metadata, deadline and abort, but the
    half's response messages go to `on_message` instead of the client."""

    def __init__(self, context: grpc.aio.ServicerContext, on_message: Callable[[bytes], Awaitable[None]]) -> None:
        self._context = context
        self.write = on_message

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None:
        return self._context.invocation_metadata()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    async def abort(self, *args: object) -> None:
        await self._context.abort(*args)


class Disaggregation:
    def __init__(self, generate: Generate) -> None:
        self._generate = generate

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            message = router_pb2.GenerateRequest.FromString(request)
        except Exception:  # protobuf's DecodeError and friends
            raise InvalidArgument("not a valid GenerateRequest encoding", field="input") from None
        transfer_id = message.input.request_id or uuid.uuid4().hex
        prefill = await self._prefill(message, transfer_id, context)
        decode = _half(message, generation_pb2.REPLICA_ROLE_DECODE, transfer_id)
        decode.input.return_prompt_logprobs = False
        wants_merge = message.input.return_routed_experts or message.input.return_prompt_logprobs

        async def forward(data: bytes) -> None:
            if wants_merge:
                response = router_pb2.GenerateResponse.FromString(data)
                if response.output.finished:
                    merge_outputs(prefill, response.output, len(message.input.prompt_token_ids))
                    data = response.SerializeToString()
            await context.write(data)

        await self._generate(decode.SerializeToString(), _HalfContext(context, forward))

    async def _prefill(
        self, message: router_pb2.GenerateRequest, transfer_id: str, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerationOutput:
        half = _half(message, generation_pb2.REPLICA_ROLE_PREFILL, transfer_id)
        half.input.stream.CopyFrom(generation_pb2.StreamOptions(final_only=True))
        half.input.sampling.max_tokens = 1
        half.input.sampling.min_tokens = 0
        final: list[generation_pb2.GenerationOutput] = []

        async def keep(data: bytes) -> None:
            output = router_pb2.GenerateResponse.FromString(data).output
            if output.finished:
                final.append(output)

        await self._generate(half.SerializeToString(), _HalfContext(context, keep))
        if not final:
            raise Unavailable("the prefill replica's answer had no final message", reason="PREFILL_INCOMPLETE")
        return final[-1]


def _half(message: router_pb2.GenerateRequest, role: int, transfer_id: str) -> router_pb2.GenerateRequest:
    half = router_pb2.GenerateRequest()
    half.CopyFrom(message)
    half.routing.role = role
    mode = (
        generation_pb2.KV_TRANSFER_MODE_PREFILL_ONLY
        if role == generation_pb2.REPLICA_ROLE_PREFILL
        else generation_pb2.KV_TRANSFER_MODE_DECODE_FROM_STORE
    )
    half.input.kv_transfer.CopyFrom(generation_pb2.KvTransferParams(mode=mode, transfer_id=transfer_id))
    return half


def merge_outputs(
    prefill: generation_pb2.GenerationOutput, decode: generation_pb2.GenerationOutput, num_prompt_tokens: int
) -> None:
    """Completes the decode half's final output (in place) with the prefill half's prompt
    logprobs and routed experts (see the module docstring)."""
    if prefill.prompt_logprobs:
        del decode.prompt_logprobs[:]
        decode.prompt_logprobs.extend(prefill.prompt_logprobs)
    if prefill.HasField("routed_experts") and decode.HasField("routed_experts"):
        merged = _merged_routing(
            prefill.routed_experts, decode.routed_experts, decode.routed_experts_start, num_prompt_tokens
        )
        decode.routed_experts.CopyFrom(merged)
        decode.routed_experts_start = 0
    if prefill.HasField("stats"):
        decode.stats.time_to_first_token_s += prefill.stats.total_time_s
        decode.stats.total_time_s += prefill.stats.total_time_s


def _merged_routing(
    prefill: tensor_pb2.Tensor, decode: tensor_pb2.Tensor, decode_start: int, num_prompt_tokens: int
) -> tensor_pb2.Tensor:
    """The prefill half's rows of the prompt's tokens, then the decode half's rows of the
    tokens after them (its rows start at token `decode_start`)."""
    prefill_shape, decode_shape = list(prefill.header.shape), list(decode.header.shape)
    num_decode_prompt_rows = num_prompt_tokens - decode_start
    if (
        prefill.header.dtype != decode.header.dtype
        or prefill_shape[1:] != decode_shape[1:]
        or prefill_shape[0] < num_prompt_tokens
        or not 0 <= num_decode_prompt_rows < decode_shape[0]
    ):
        raise ServiceError(
            f"routed experts of the prefill half {prefill_shape} and of the decode half {decode_shape} (from token "
            f"{decode_start}) do not fit a prompt of {num_prompt_tokens} tokens",
            reason="ROUTED_EXPERTS_MISMATCH",
        )
    row_bytes = len(decode.data) // decode_shape[0]
    completion = decode.data[num_decode_prompt_rows * row_bytes :]
    data = prefill.data[: num_prompt_tokens * row_bytes] + completion
    num_rows = len(data) // row_bytes
    header = tensor_pb2.TensorHeader(
        name=decode.header.name, dtype=decode.header.dtype, shape=[num_rows, *decode_shape[1:]], num_bytes=len(data)
    )
    return tensor_pb2.Tensor(header=header, data=data)
