"""One model turn through the router (router.v1 Generate): token ids (and images) in, the
completion with per-token logprobs and policy versions (and, when asked, the routed experts) out.

A router of a release before images would drop a request's images and have the turn sampled
without them: a turn with images goes only to a router whose GetServiceInfo lists
ROUTER_CAPABILITY_IMAGES, asked before each such turn (a router may be replaced by another
version at any time); the router in turn sends it only to replicas that take images."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import FailedPrecondition
from primerl_common.images import ROUTER_CAPABILITY_IMAGES
from primerl_common.tensors import tensor_from_proto
from primerl_orchestrator.kv_namespaces import TurnsInFlight
from primerl_orchestrator.rendering import RenderedPrompt

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
    # (bytes, MIME type) of the prompt's images, in the order of their tokens (one each).
    images: tuple[tuple[bytes, str], ...] = ()
    # With images: the prompt as the model reads it, each image's token repeated to its size;
    # inference must have expanded it the same way.
    expanded_prompt_token_ids: list[int] | None = None

    @classmethod
    def of(
        cls,
        prompt: RenderedPrompt,
        *,
        request_id: str,
        episode_id: str,
        sampling: generation_pb2.SamplingParams,
        min_policy_version: int,
        return_routed_experts: bool,
    ) -> GenerationRequest:
        """The request of a turn with `prompt`, salted by the replica alone (it puts the policy
        version it serves the turn at in the salt)."""
        return cls(
            request_id=request_id,
            episode_id=episode_id,
            prompt_token_ids=prompt.engine_token_ids,
            sampling=sampling,
            cache_salt="",
            min_policy_version=min_policy_version,
            return_routed_experts=return_routed_experts,
            images=tuple((image.data, image.mime_type) for image in prompt.images),
            expanded_prompt_token_ids=prompt.token_ids if prompt.images else None,
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens as the model reads them."""
        return len(self.expanded_prompt_token_ids or self.prompt_token_ids)


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
    ran, so trying it again repeats nothing. `lora_adapter`: every turn is generated with that
    adapter (the run's), whose versions min_policy_version and the tokens' versions are."""

    def __init__(self, address: str, *, timeout_s: float, retry_s: float = 60.0, lora_adapter: str = "") -> None:
        self.address = address
        self.lora_adapter = lora_adapter
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

    async def _check_router_takes_images(self) -> None:
        try:
            response = await self._stub.GetServiceInfo(router_pb2.GetServiceInfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise GenerationError(exc.code(), exc.details() or "") from None
        if ROUTER_CAPABILITY_IMAGES not in response.info.capabilities:
            raise FailedPrecondition(
                f"the router at {self.address} (version {response.info.package_version or 'unknown'}) does not route "
                f"images (capability {ROUTER_CAPABILITY_IMAGES}): it would drop them",
                subject=ROUTER_CAPABILITY_IMAGES,
                reason="CAPABILITY_MISSING",
            )

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        if request.images:
            await self._check_router_takes_images()
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
                lora_adapter=self.lora_adapter,
                images=[generation_pb2.ImageData(data=data, mime_type=mime) for data, mime in request.images],
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
        expanded = request.expanded_prompt_token_ids
        if expanded is not None and list(final.prompt_token_ids) != expanded:
            raise GenerationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"inference expanded the prompt's images to {len(final.prompt_token_ids)} prompt tokens, the "
                f"orchestrator's image processor to {len(expanded)}: they read the images "
                "differently (another processor or model)",
            )
        routed = None
        if request.return_routed_experts:
            routed = tensor_from_proto(final.routed_experts)
            expected_rows = request.num_prompt_tokens + len(token_ids)
            if routed.dim() != 3 or routed.shape[0] != expected_rows:
                raise GenerationError(
                    grpc.StatusCode.INTERNAL,
                    f"routed experts of shape {list(routed.shape)}, expected {expected_rows} rows",
                )
        return GenerationResult(token_ids, logprobs, versions, final.finish_reason, routed)
