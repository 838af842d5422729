"""One generation request in vLLM terms: its SamplingParams, and the turning of vLLM's
output stream into GenerationChunks (stream policy and its timer, per-token policy
versions, prompt logprobs, stats)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.logprobs import FlatLogprobs, PromptLogprobs, SampleLogprobs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineGenerateError
from vllm.v1.engine.output_processor import OutputProcessor

from primerl_common.errors import InvalidArgument
from primerl_inference.engine_versions import parse_engine_version_stamp
from primerl_inference.generation import (
    GenerateRequest,
    GenerationChunk,
    GenerationStats,
    PolicyVersionChanged,
    StreamBatcher,
)
from primerl_inference.version_salts import ServedAt

__all__ = ["sampling_params", "stream_chunks"]


def sampling_params(request: GenerateRequest, *, bad_words: Sequence[str] = ()) -> SamplingParams:
    """`bad_words`: tokens never sampled (vision placeholders; see images.py)."""
    sampling = request.sampling
    try:
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            repetition_penalty=sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            bad_words=list(bad_words) or None,
            logprobs=0,  # the sampled token's own logprob, no alternatives
            prompt_logprobs=0 if request.return_prompt_logprobs else None,
            # Logprobs as flat lists, not a dict and a Logprob object per token: less work for
            # vLLM's output processor at every step, and read here as slices.
            flat_logprobs=True,
            detokenize=False,  # token ids in, token ids out
            output_kind=RequestOutputKind.FINAL_ONLY if request.stream.final_only else RequestOutputKind.DELTA,
        )
    except VLLMValidationError as exc:
        # Limits vLLM has beyond GenerateRequest.validate (e.g. temperature above 2).
        raise _invalid_argument(exc, default_field="input.sampling") from None


def _invalid_argument(exc: VLLMValidationError, *, default_field: str) -> InvalidArgument:
    field = f"input.sampling.{exc.parameter}" if exc.parameter else default_field
    return InvalidArgument(str(exc.args[0]), field=field)


async def stream_chunks(
    request: GenerateRequest,
    engine_request_id: str,
    outputs: AsyncIterator[RequestOutput],
    output_processor: OutputProcessor,
    *,
    salted: ServedAt | None = None,
) -> AsyncIterator[GenerationChunk]:
    """The chunks of one request, from `outputs` (AsyncLLM.generate of `request` under
    `engine_request_id`). Closing this iterator before the last chunk aborts the request.
    Its tokens are tagged with the policy version of its LoRA adapter, or of the base weights
    without one. `salted`: the versions its cache salt names; PolicyVersionChanged (the
    request aborted, none of its tokens yielded) when its first token is sampled at others."""
    started = time.monotonic()
    first_token_at: float | None = None
    batcher = StreamBatcher(request.stream)
    prompt_logprobs: list[float] | None = None
    # With a time-based stream policy the next output is awaited with a timeout, as a task
    # that survives it (cancelling the read itself would abort the request).
    pending: asyncio.Task[RequestOutput | None] | None = None
    finished = False
    try:
        while True:
            wait_s = batcher.seconds_until_due()
            if pending is None and wait_s is None:
                output = await anext(outputs, None)
            else:
                pending = pending or asyncio.ensure_future(anext(outputs, None))
                done, _ = await asyncio.wait({pending}, timeout=wait_s)
                if not done:
                    yield batcher.take()
                    continue
                output, pending = pending.result(), None
            if output is None:
                raise RuntimeError(f"vLLM ended request {engine_request_id} without a finished output")
            if output.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = _prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs)
            completion = output.outputs[0]
            # FINAL_ONLY outputs hold the whole completion, DELTA ones the new tokens.
            begin = 0 if request.stream.final_only else batcher.num_tokens
            token_ids = list(completion.token_ids)
            if token_ids:
                first_token_at = first_token_at or time.monotonic()
                logprobs = _sampled_logprobs(completion.logprobs, len(token_ids))
                spans = _version_spans(output_processor, engine_request_id, completion, begin, len(token_ids))
                if begin == 0 and salted is not None:
                    _check_first_token(salted, spans[0][0])
                versions = _policy_versions(spans, request.lora_adapter)
                batcher.add(token_ids, logprobs, versions)
            if output.finished:
                finished = True
                chunk = batcher.take()
                chunk.finished = True
                chunk.finish_reason = completion.finish_reason  # "stop", "length" or "abort"
                chunk.prompt_logprobs = prompt_logprobs
                chunk.prompt_token_ids = list(output.prompt_token_ids)
                chunk.stats = GenerationStats(
                    num_prompt_tokens=len(chunk.prompt_token_ids),
                    num_cached_prompt_tokens=output.num_cached_tokens or 0,
                    num_output_tokens=batcher.num_tokens,
                    time_to_first_token_s=(first_token_at or time.monotonic()) - started,
                    total_time_s=time.monotonic() - started,
                )
                yield chunk
                return
            if batcher.due():
                yield batcher.take()
    except VLLMValidationError as exc:
        # What vLLM's input processing refuses: a prompt that images expand past max_model_len.
        raise _invalid_argument(exc, default_field="input.prompt_token_ids") from None
    except EngineGenerateError as exc:
        if request.images and isinstance(exc.__cause__, ValueError):
            # The model's image processor refuses an image (Qwen's: an aspect ratio above 200).
            raise InvalidArgument(f"the model's processor refused it: {exc.__cause__}", field="input.images") from None
        raise
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
        if finished:
            await anext(outputs, None)  # lets vLLM's generator end on its own
        else:
            await outputs.aclose()  # aborts the request in the engine


def _sampled_logprobs(logprobs: SampleLogprobs | None, count: int) -> list[float]:
    """The logprob of each of the `count` sampled tokens of an output (flat_logprobs with
    logprobs=0: one entry per token, the sampled token's own)."""
    if not isinstance(logprobs, FlatLogprobs) or len(logprobs.logprobs) != count:
        raise RuntimeError(f"vLLM returned {type(logprobs).__name__} logprobs that are not one flat entry per token")
    return logprobs.logprobs


def _version_spans(
    output_processor: OutputProcessor, engine_request_id: str, completion: CompletionOutput, begin: int, count: int
) -> list[tuple[str, int]]:
    """(engine version stamp, number of tokens) of each run of output tokens `begin ..
    begin+count` of a request sampled under one stamp (engine_versions.py).

    vLLM's output processor records, per request, where each weight-version span starts
    (from the versions the engine core stamps on its outputs). Finished outputs carry the
    spans themselves; for a running request they are read from its state (vLLM internals:
    OutputProcessor.external_req_ids, RequestState.weight_version_starts)."""
    if completion.weight_versions is not None:
        starts: Sequence[tuple[str, int]] = [(span.version, span.start) for span in completion.weight_versions]
    else:
        (internal_id,) = output_processor.external_req_ids.get(engine_request_id, ())
        starts = output_processor.request_states[internal_id].weight_version_starts
    end = begin + count
    if not starts or starts[0][1] > begin:
        raise RuntimeError(f"token {begin} of request {engine_request_id} has no weight version")
    spans = []
    for index, (stamp, start) in enumerate(starts):  # a span runs to the next one's start
        span_end = starts[index + 1][1] if index + 1 < len(starts) else end
        overlap = min(span_end, end) - max(start, begin)
        if overlap > 0:
            spans.append((stamp, overlap))
    return spans


def _policy_versions(spans: Sequence[tuple[str, int]], adapter: str) -> list[int]:
    """The policy version of each token of `spans`: its adapter's at the step that sampled it,
    the base weights' for a request without adapter."""
    versions: list[int] = []
    for stamp, count in spans:
        versions += [parse_engine_version_stamp(stamp).policy_version(adapter)] * count
    return versions


def _check_first_token(salted: ServedAt, stamp: str) -> None:
    """PolicyVersionChanged when the first token was sampled at other versions than the salt names."""
    at = parse_engine_version_stamp(stamp)
    if at.base != salted.base or (salted.adapter and at.policy_version(salted.adapter) != salted.adapter_version):
        raise PolicyVersionChanged(salted.policy_version, at.policy_version(salted.adapter))


def _prompt_logprobs(prompt_token_ids: Sequence[int], steps: PromptLogprobs) -> list[float]:
    """One per prompt token as the engine ran it (images expanded); the first has no context
    and is NaN (flat_logprobs with prompt_logprobs=0: one entry per later prompt token, that
    token's own)."""
    if not isinstance(steps, FlatLogprobs) or steps.token_ids != list(prompt_token_ids[1:]):
        raise RuntimeError("vLLM returned prompt logprobs that are not one flat entry per prompt token")
    return [float("nan"), *steps.logprobs]
