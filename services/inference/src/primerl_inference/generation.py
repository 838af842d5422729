"""Generation requests and the pieces of their output stream, free of gRPC and of vLLM.

`GenerateRequest.validate` refuses what no engine could serve (with the request field at
fault); `StreamBatcher` decides when buffered tokens are sent, following the request's
stream options.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Literal

import numpy as np

from primerl_common.errors import InvalidArgument

__all__ = [
    "FinishReason",
    "GenerateRequest",
    "GenerationChunk",
    "GenerationStats",
    "KvTransferMode",
    "PolicyVersionChanged",
    "SamplingSpec",
    "StreamBatcher",
    "StreamPolicy",
]

FinishReason = Literal["stop", "length", "abort"]
# A prefill/decode hand-off through the KV store: "prefill" computes the prompt's KV, saves it
# and stops after prefill; "decode" loads it and decodes ("": no hand-off).
KvTransferMode = Literal["", "prefill", "decode"]


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    min_p: float = 0.0
    max_tokens: int | None = None  # None: up to the context length
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclasses.dataclass(frozen=True)
class StreamPolicy:
    """All zero: every new token is sent at once (see primerl.common.v1.StreamOptions)."""

    every_n_tokens: int = 0
    every_ms: int = 0
    final_only: bool = False


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec = SamplingSpec()
    stream: StreamPolicy = StreamPolicy()
    cache_salt: str = ""
    lora_adapter: str = ""
    return_prompt_logprobs: bool = False
    return_routed_experts: bool = False
    min_policy_version: int = 0
    kv_transfer: KvTransferMode = ""
    # (bytes, MIME type) of each image of the prompt, not decoded.
    images: tuple[tuple[bytes, str], ...] = ()

    def validate(self, *, vocab_size: int, max_model_len: int) -> None:
        """Raises InvalidArgument naming the first bad field (paths as in GenerateRequest)."""
        prompt = self.prompt_token_ids
        if not prompt:
            raise InvalidArgument("must not be empty", field="input.prompt_token_ids")
        if max(prompt) >= vocab_size:
            raise InvalidArgument(
                f"token id {max(prompt)} is out of the vocabulary (size {vocab_size})", field="input.prompt_token_ids"
            )
        if len(prompt) >= max_model_len:
            raise InvalidArgument(
                f"{len(prompt)} prompt tokens leave no room for a completion (max_model_len {max_model_len})",
                field="input.prompt_token_ids",
            )
        _validate_sampling(self.sampling, vocab_size)


def _validate_sampling(sampling: SamplingSpec, vocab_size: int) -> None:
    def bad(field: str, message: str) -> InvalidArgument:
        return InvalidArgument(message, field=f"input.sampling.{field}")

    if not 0 <= sampling.temperature <= 2:  # vLLM's range (NaN fails too)
        raise bad("temperature", f"must be in [0, 2], got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise bad("top_k", f"must be >= 0 (0: no top-k filtering), got {sampling.top_k}")
    if not 0 <= sampling.min_p <= 1:
        raise bad("min_p", f"must be in [0, 1], got {sampling.min_p}")
    if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
        raise bad("min_tokens", f"{sampling.min_tokens} is more than max_tokens {sampling.max_tokens}")
    if any(token >= vocab_size for token in sampling.stop_token_ids):
        raise bad("stop_token_ids", f"ids must be below the vocabulary size {vocab_size}")
    if not math.isfinite(sampling.repetition_penalty) or sampling.repetition_penalty <= 0:
        raise bad("repetition_penalty", f"must be a finite number > 0, got {sampling.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sampling, name) <= 2:
            raise bad(name, f"must be in [-2, 2], got {getattr(sampling, name)}")


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_output_tokens: int
    time_to_first_token_s: float
    total_time_s: float


@dataclasses.dataclass
class GenerationChunk:
    """Tokens `offset ..` of a completion; the last chunk of a request has `finished` set and
    carries what is only known at the end."""

    offset: int
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[float] | None = None
    # The prompt as the engine ran it: each image's token expanded to the image's size.
    prompt_token_ids: list[int] | None = None
    # [prompt + completion tokens, layers, top_k] expert indices, from token routed_experts_start on.
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0
    stats: GenerationStats | None = None


class PolicyVersionChanged(Exception):
    """A weight update landed between a request's admission and its first token, so its
    prefix may be looked up (and reused) under the older version's salt: it starts again."""

    def __init__(self, salted_version: int, new_version: int) -> None:
        super().__init__(
            f"salted with policy version {salted_version}; version {new_version} came before its first token"
        )
        self.salted_version = salted_version
        self.new_version = new_version


class StreamBatcher:
    """Buffers generated tokens and says when they are due to be sent."""

    def __init__(self, policy: StreamPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._clock = clock
        self._last_sent = clock()
        self._offset = 0
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._policy_versions: list[int] = []

    @property
    def num_tokens(self) -> int:
        """Tokens added so far, sent or not."""
        return self._offset + len(self._token_ids)

    def add(self, token_ids: list[int], logprobs: list[float], policy_versions: list[int]) -> None:
        self._token_ids += token_ids
        self._logprobs += logprobs
        self._policy_versions += policy_versions

    def due(self) -> bool:
        policy = self._policy
        if not self._token_ids or policy.final_only:
            return False
        if not (policy.every_n_tokens or policy.every_ms):
            return True
        if policy.every_n_tokens and len(self._token_ids) >= policy.every_n_tokens:
            return True
        return bool(policy.every_ms) and self.seconds_until_due() == 0

    def seconds_until_due(self) -> float | None:
        """How long buffered tokens may still wait; None when no timer applies."""
        if not self._token_ids or not self._policy.every_ms or self._policy.final_only:
            return None
        return max(0.0, self._last_sent + self._policy.every_ms / 1000 - self._clock())

    def take(self) -> GenerationChunk:
        """The buffered tokens as a chunk; the buffer starts over."""
        chunk = GenerationChunk(self._offset, self._token_ids, self._logprobs, self._policy_versions)
        self._offset += len(self._token_ids)
        self._token_ids, self._logprobs, self._policy_versions = [], [], []
        self._last_sent = self._clock()
        return chunk
