"""What a model turn is asked with, and what its environment is told when inference fails it."""

from __future__ import annotations

import math

import grpc

from primerl.common.v1 import generation_pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from primerl_orchestrator.config import SamplingDefaults
from primerl_orchestrator.generation import GenerationError

__all__ = ["sampling_params", "turn_error"]


def sampling_params(
    defaults: SamplingDefaults, overrides: generation_pb2.SamplingParams | None, *, room: int
) -> generation_pb2.SamplingParams:
    """The environment's defaults with the turn's overrides; max_tokens capped by the `room`
    the prompt leaves in the context."""
    params = generation_pb2.SamplingParams(
        temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k, max_tokens=defaults.max_tokens
    )
    if overrides is not None:
        # Proto merge: the fields set in the override replace the defaults.
        params.MergeFrom(overrides)
    if not (math.isfinite(params.temperature) and params.temperature > 0):
        raise InvalidArgument(
            f"temperature {params.temperature} is not > 0 (the trainer divides its logits by it)",
            field="sampling.temperature",
        )
    params.max_tokens = min(params.max_tokens, room)
    return params


def turn_error(exc: GenerationError, field: str) -> ServiceError:
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(f"inference refused the prompt: {exc.message}", field=field)
    if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(f"inference cannot serve the turn: {exc.message}", reason="INFERENCE_PRECONDITION")
    return Unavailable(f"the turn failed in inference ({exc.code.name}: {exc.message}); retry it", retry_after_s=1.0)
