"""One model turn through the router (router.v1 Generate): token ids in, the completion with
per-token logprobs and policy versions (and, when asked, the routed experts) out."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.tensors import tensor_from_proto
from primerl_orchestrator.kv_namespaces import TurnsInFlight

__all__ = ["GenerationError", "GenerationRequest", "GenerationResult", "RouterGeneration"]

logger = logging.getLogger(__name__)

_INITIAL_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 2.0


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    episode_id: str
    prompt_token_ids: list[int]
    sampling: generation_pb2.SamplingParams
    # The caller's part of the salt: replicas put the policy version they serve the turn at
    # before it, so prefixes are reused only within one version ("" for none of its own).
    cache_salt: str
    min_policy_version: int
    return_routed_experts: bool


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: int  # generation_pb2.FinishReason
    # [prompt + completion, num_hidden_layers, top_k] when asked for.
    routed_experts: torch.Tensor | None


class GenerationError(Exception):
    """The router or a replica failed the turn; `code` is the gRPC status it answered."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class _NothingReceived(Exception):
    """UNAVAILABLE before any output: the turn did not run."""

    def __init__(self, error: GenerationError) -> None:
        super().__init__(str(error))
        self.error = error


class RouterGeneration:
    """`retry_s`: how long a turn is tried again while the router answers UNAVAILABLE before
    any output (it is restarting, or has no replica that can take the turn): such a turn never
    ran, so trying it again repeats nothing."""

    def __init__(self, address: str, *, timeout_s: float, retry_s: float = 60.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._channel = make_channel(address)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        # Turns sent and not yet answered (which KV namespaces may still be in use).
        self.in_flight = TurnsInFlight()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with self.in_flight.track():
            return await self._generate(request)

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        backoff = _INITIAL_BACKOFF_S
        while True:
            try:
                return await self._generate_once(request, timeout_s=self._timeout_s - (loop.time() - started))
            except _NothingReceived as unavailable:
                waited = loop.time() - started
                if waited + backoff > min(self._retry_s, self._timeout_s):
                    raise unavailable.error from None
                logger.info(
                    "router at %s unavailable (%s); turn %s again in %.1fs",
                    self.address,
                    unavailable.error.message,
                    request.request_id,
                    backoff,
                )
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)

    async def _generate_once(self, request: GenerationRequest, *, timeout_s: float) -> GenerationResult:
        message = router_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                # One message at the end: the orchestrator needs the whole turn before it answers.
                stream=generation_pb2.StreamOptions(final_only=True),
                cache_salt=request.cache_salt,
                return_routed_experts=request.return_routed_experts,
                min_policy_version=request.min_policy_version,
            ),
            routing=router_pb2.RoutingHints(session_key=request.episode_id),
        )
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        final: generation_pb2.GenerationOutput | None = None
        try:
            async for response in self._stub.Generate(message, timeout=timeout_s):
                output = response.output
                if output.offset != len(token_ids):
                    raise GenerationError(
                        grpc.StatusCode.INTERNAL, f"chunk at offset {output.offset} after {len(token_ids)} tokens"
                    )
                token_ids += output.token_ids
                logprobs += output.logprobs
                versions += output.policy_versions
                if output.finished:
                    final = output
        except grpc.aio.AioRpcError as exc:
            error = GenerationError(exc.code(), exc.details() or "")
            if exc.code() == grpc.StatusCode.UNAVAILABLE and not token_ids:
                raise _NothingReceived(error) from None
            raise error from None
        if final is None:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "the stream ended before the turn finished")
        if final.finish_reason == generation_pb2.FINISH_REASON_ABORT or not token_ids:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "the turn was aborted (replica draining?)")
        if not len(token_ids) == len(logprobs) == len(versions):
            raise GenerationError(grpc.StatusCode.INTERNAL, "token ids, logprobs and versions differ in length")
        routed = None
        if request.return_routed_experts:
            routed = tensor_from_proto(final.routed_experts)
            expected_rows = len(request.prompt_token_ids) + len(token_ids)
            if routed.dim() != 3 or routed.shape[0] != expected_rows:
                raise GenerationError(
                    grpc.StatusCode.INTERNAL,
                    f"routed experts of shape {list(routed.shape)}, expected {expected_rows} rows",
                )
        return GenerationResult(token_ids, logprobs, versions, final.finish_reason, routed)
