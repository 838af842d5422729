"""Merging the prefill and decode halves' outputs (the end-to-end run with real replicas is
services/inference/tests/test_kv_handoff.py)."""

import numpy as np
import pytest

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl_common.errors import ServiceError
from primerl_router.disaggregation import merge_outputs

PROMPT, COMPLETION, LAYERS, TOP_K = 5, 3, 2, 2


def routing(rows: np.ndarray) -> tensor_pb2.Tensor:
    header = tensor_pb2.TensorHeader(
        name="routed_experts", dtype=tensor_pb2.DTYPE_UINT8, shape=list(rows.shape), num_bytes=rows.nbytes
    )
    return tensor_pb2.Tensor(header=header, data=rows.tobytes())


def rows_of(tensor: tensor_pb2.Tensor) -> np.ndarray:
    assert tensor.header.num_bytes == len(tensor.data)
    return np.frombuffer(tensor.data, np.uint8).reshape(tuple(tensor.header.shape))


def outputs(decode_start: int) -> tuple[generation_pb2.GenerationOutput, generation_pb2.GenerationOutput]:
    """The prefill half: prompt rows 1.., and its sampled token's; the decode half: 100.. from
    token `decode_start` on."""
    prefill_rows = np.arange(1, 1 + (PROMPT + 1) * LAYERS * TOP_K, dtype=np.uint8).reshape(PROMPT + 1, LAYERS, TOP_K)
    num_decode = PROMPT + COMPLETION - decode_start
    decode_rows = np.arange(100, 100 + num_decode * LAYERS * TOP_K, dtype=np.uint8).reshape(num_decode, LAYERS, TOP_K)
    prefill = generation_pb2.GenerationOutput(
        finished=True,
        prompt_logprobs=[float("nan"), -1.0, -2.0, -3.0, -4.0],
        routed_experts=routing(prefill_rows),
        stats=generation_pb2.GenerationStats(total_time_s=0.5),
    )
    decode = generation_pb2.GenerationOutput(
        finished=True,
        token_ids=[7, 8, 9],
        routed_experts=routing(decode_rows),
        routed_experts_start=decode_start,
        stats=generation_pb2.GenerationStats(num_cached_prompt_tokens=4, time_to_first_token_s=0.1, total_time_s=1.0),
    )
    return prefill, decode


@pytest.mark.parametrize("decode_start", [0, PROMPT])
def test_prompt_rows_come_from_prefill_and_completion_rows_from_decode(decode_start: int) -> None:
    prefill, decode = outputs(decode_start)
    prefill_rows, decode_rows = rows_of(prefill.routed_experts), rows_of(decode.routed_experts)

    merge_outputs(prefill, decode, PROMPT)

    merged = rows_of(decode.routed_experts)
    assert merged.shape == (PROMPT + COMPLETION, LAYERS, TOP_K)
    assert decode.routed_experts_start == 0
    np.testing.assert_array_equal(merged[:PROMPT], prefill_rows[:PROMPT])
    np.testing.assert_array_equal(merged[PROMPT:], decode_rows[PROMPT - decode_start :])
    assert list(decode.prompt_logprobs)[1:] == [-1.0, -2.0, -3.0, -4.0]
    assert decode.stats.num_cached_prompt_tokens == 4
    assert (decode.stats.time_to_first_token_s, decode.stats.total_time_s) == pytest.approx((0.6, 1.5))


def test_routing_that_does_not_fit_the_prompt_is_an_error() -> None:
    prefill, decode = outputs(0)
    decode.routed_experts_start = PROMPT + COMPLETION  # no row of the completion left

    with pytest.raises(ServiceError, match="do not fit a prompt of 5 tokens"):
        merge_outputs(prefill, decode, PROMPT)
