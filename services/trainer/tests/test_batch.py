"""Micro-batch decoding from the proto and validation: every malformed field is named."""

import dataclasses
from collections.abc import Callable

import pytest
import torch

from primerl.trainer.v1 import trainer_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.tensors import tensor_to_proto
from primerl_trainer.batch import (
    BatchSpec,
    MicroBatch,
    micro_batch_from_proto,
    shard_micro_batches,
    validate_batch,
    validate_micro_batch,
)

SPEC = BatchSpec(seq_len=16, vocab_size=320)
REPLAY_SPEC = BatchSpec(
    seq_len=16, vocab_size=320, router_replay=True, num_moe_layers=2, num_experts_per_token=2, num_experts=8
)


def _micro_batch(**overrides: torch.Tensor | None) -> MicroBatch:
    """Two samples packed: [prompt 2, completion 3] + [prompt 1, completion 2]."""
    fields: dict[str, torch.Tensor | None] = {
        "input_ids": torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
        "position_ids": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
        "loss_mask": torch.tensor([False, False, True, True, True, False, True, True]),
        "temperatures": torch.full((8,), 0.7),
        "advantages": torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, -0.5, -0.5]),
        "inference_logprobs": torch.tensor([0.0, 0.0, -1.0, -2.0, -0.1, 0.0, -3.0, -0.2]),
        "policy_versions": torch.tensor([3, 3, 3, 3, 4, 4, 4, 4]),
    }
    return MicroBatch(**(fields | overrides))  # type: ignore[arg-type]


def _to_proto(micro_batch: MicroBatch) -> trainer_pb2.MicroBatch:
    return trainer_pb2.MicroBatch(
        **{
            field.name: tensor_to_proto(value, name=field.name)
            for field in dataclasses.fields(micro_batch)
            if (value := getattr(micro_batch, field.name)) is not None
        }
    )


def test_decodes_a_proto_micro_batch_widening_int32_ids() -> None:
    expected = _micro_batch()
    msg = _to_proto(
        dataclasses.replace(expected, input_ids=expected.input_ids.int(), position_ids=expected.position_ids.int())
    )
    decoded = micro_batch_from_proto(msg, SPEC, mode="rl")
    for field in dataclasses.fields(MicroBatch):
        actual, wanted = getattr(decoded, field.name), getattr(expected, field.name)
        if wanted is None:
            assert actual is None
        else:
            assert actual.dtype == wanted.dtype and torch.equal(actual, wanted), field.name
    assert decoded.num_tokens == 8 and decoded.num_loss_tokens == 5


def test_sft_needs_only_ids_positions_and_mask_and_defaults_temperature_to_one() -> None:
    full = _micro_batch()
    msg = _to_proto(
        MicroBatch(
            input_ids=full.input_ids,
            position_ids=full.position_ids,
            loss_mask=full.loss_mask,
            temperatures=full.temperatures,
        )
    )
    msg.ClearField("temperatures")
    decoded = micro_batch_from_proto(msg, SPEC, mode="sft")
    assert torch.equal(decoded.temperatures, torch.ones(8))
    assert decoded.advantages is None and decoded.inference_logprobs is None
    with pytest.raises(InvalidArgument) as excinfo:
        micro_batch_from_proto(msg, SPEC, mode="rl")
    assert excinfo.value.field == "micro_batch.temperatures"


def test_routed_experts_are_decoded_only_when_replayed() -> None:
    experts = torch.randint(0, 8, (8, 2, 2), dtype=torch.uint8)
    msg = _to_proto(_micro_batch(routed_experts=experts))
    assert torch.equal(micro_batch_from_proto(msg, REPLAY_SPEC, mode="rl").routed_experts, experts)
    assert micro_batch_from_proto(msg, SPEC, mode="rl").routed_experts is None


def _set_token(name: str, index: int, value: float | int | bool) -> Callable[[MicroBatch], MicroBatch]:
    def edit(micro_batch: MicroBatch) -> MicroBatch:
        tensor = getattr(micro_batch, name).clone()
        tensor[index] = value
        return dataclasses.replace(micro_batch, **{name: tensor})

    return edit


def _replace(**fields: torch.Tensor | None) -> Callable[[MicroBatch], MicroBatch]:
    return lambda micro_batch: dataclasses.replace(micro_batch, **fields)


BAD_MICRO_BATCHES = {
    "advantages shorter than the ids": (_replace(advantages=torch.zeros(7)), "advantages", "shape"),
    "temperatures 2-D": (_replace(temperatures=torch.ones(8, 1)), "temperatures", "shape"),
    "token id = vocab size": (_set_token("input_ids", 3, 320), "input_ids", "token 3 is 320"),
    "negative token id": (_set_token("input_ids", 0, -1), "input_ids", "token 0 is -1"),
    "ids 2-D": (_replace(input_ids=torch.ones(1, 8, dtype=torch.int64)), "input_ids", "shape"),
    "longer than seq_len": (
        _replace(
            **{
                name: torch.zeros(17, dtype=dtype)
                for name, dtype in [("input_ids", torch.int64), ("position_ids", torch.int64)]
            }
        ),
        "input_ids",
        "seq_len 16",
    ),
    "empty": (_replace(input_ids=torch.zeros(0, dtype=torch.int64)), "input_ids", "shape"),
    "NaN advantage": (_set_token("advantages", 2, float("nan")), "advantages", "token 2 is nan"),
    "inf advantage": (_set_token("advantages", 0, float("inf")), "advantages", "token 0 is inf"),
    "-inf inference logprob": (
        _set_token("inference_logprobs", 4, float("-inf")),
        "inference_logprobs",
        "token 4 is -inf",
    ),
    "NaN inference logprob": (_set_token("inference_logprobs", 7, float("nan")), "inference_logprobs", "token 7"),
    "zero temperature": (_set_token("temperatures", 1, 0.0), "temperatures", "token 1"),
    "negative temperature": (_set_token("temperatures", 6, -1.0), "temperatures", "token 6"),
    "NaN temperature": (_set_token("temperatures", 6, float("nan")), "temperatures", "token 6"),
    "positions skip": (_set_token("position_ids", 3, 4), "position_ids", "token 3 has position 4 after 2"),
    "positions do not start at 0": (_set_token("position_ids", 0, 1), "position_ids", "token 0"),
    "loss on a sample's first token": (_set_token("loss_mask", 5, True), "loss_mask", "token 5 starts a sample"),
    "float64 advantages": (_replace(advantages=torch.zeros(8, dtype=torch.float64)), "advantages", "dtype"),
    "int loss mask": (_replace(loss_mask=torch.ones(8, dtype=torch.int64)), "loss_mask", "dtype"),
    "missing advantages": (_replace(advantages=None), "advantages", "required"),
    "missing inference logprobs": (_replace(inference_logprobs=None), "inference_logprobs", "required"),
    "negative policy version": (_set_token("policy_versions", 2, -1), "policy_versions", "token 2"),
}


@pytest.mark.parametrize("case", list(BAD_MICRO_BATCHES), ids=list(BAD_MICRO_BATCHES))
def test_rejects_a_malformed_micro_batch_naming_the_field(case: str) -> None:
    edit, name, message = BAD_MICRO_BATCHES[case]
    with pytest.raises(InvalidArgument) as excinfo:
        validate_micro_batch(edit(_micro_batch()), SPEC, mode="rl", index=2)
    assert excinfo.value.field == f"micro_batch.{name}"
    assert message in excinfo.value.message
    assert "micro-batch 2" in excinfo.value.message


BAD_ROUTED_EXPERTS = {
    "missing": (None, "required"),
    "too few layers": (torch.zeros(8, 1, 2, dtype=torch.uint8), "shape [8, 1, 2], expected [8, 2, 2]"),
    "one token short": (torch.zeros(7, 2, 2, dtype=torch.uint8), "shape"),
    "int64": (torch.zeros(8, 2, 2, dtype=torch.int64), "dtype"),
    "expert out of range": (
        torch.zeros(8, 2, 2, dtype=torch.uint8).index_fill_(0, torch.tensor([5]), 8),
        "token 5 names expert 8 of 8",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROUTED_EXPERTS), ids=list(BAD_ROUTED_EXPERTS))
def test_rejects_bad_routed_experts_when_replaying(case: str) -> None:
    experts, message = BAD_ROUTED_EXPERTS[case]
    with pytest.raises(InvalidArgument) as excinfo:
        validate_micro_batch(_micro_batch(routed_experts=experts), REPLAY_SPEC, mode="rl")
    assert excinfo.value.field == "micro_batch.routed_experts"
    assert message in excinfo.value.message


def test_accepts_uint16_routed_experts() -> None:
    spec = dataclasses.replace(REPLAY_SPEC, num_experts=300)
    validate_micro_batch(_micro_batch(routed_experts=torch.full((8, 2, 2), 299, dtype=torch.uint16)), spec, mode="rl")


def test_decoding_names_the_field_of_a_corrupt_tensor() -> None:
    msg = _to_proto(_micro_batch())
    msg.advantages.data = msg.advantages.data[:-4]
    with pytest.raises(InvalidArgument) as excinfo:
        micro_batch_from_proto(msg, SPEC, mode="rl")
    assert excinfo.value.field == "micro_batch.advantages"
    msg = _to_proto(_micro_batch(input_ids=torch.arange(8, dtype=torch.int16)))
    with pytest.raises(InvalidArgument) as excinfo:
        micro_batch_from_proto(msg, SPEC, mode="rl")
    assert excinfo.value.field == "micro_batch.input_ids"
    assert "dtype" in excinfo.value.message


def test_validate_batch_returns_the_loss_token_count_and_checks_the_announced_one() -> None:
    micro_batches = [_micro_batch(), _micro_batch()]
    assert validate_batch(micro_batches, SPEC, mode="rl") == 10
    assert validate_batch(micro_batches, SPEC, mode="rl", num_loss_tokens=10) == 10
    with pytest.raises(InvalidArgument) as excinfo:
        validate_batch(micro_batches, SPEC, mode="rl", num_loss_tokens=9)
    assert excinfo.value.field == "begin.num_loss_tokens"


def test_validate_batch_names_the_bad_micro_batch_among_good_ones() -> None:
    micro_batches = [_micro_batch(), _micro_batch(), _set_token("advantages", 0, float("nan"))(_micro_batch())]
    with pytest.raises(InvalidArgument) as excinfo:
        validate_batch(micro_batches, SPEC, mode="rl")
    assert excinfo.value.field == "micro_batch.advantages"
    assert "micro-batch 2" in excinfo.value.message


def test_validate_batch_rejects_empty_batches_and_batches_without_loss_tokens() -> None:
    with pytest.raises(InvalidArgument) as excinfo:
        validate_batch([], SPEC, mode="rl")
    assert excinfo.value.field == "begin.num_micro_batches"
    no_loss = _micro_batch(loss_mask=torch.zeros(8, dtype=torch.bool))
    with pytest.raises(InvalidArgument) as excinfo:
        validate_batch([no_loss], SPEC, mode="rl")
    assert excinfo.value.field == "micro_batch.loss_mask"


def test_batch_spec_rejects_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        BatchSpec(seq_len=0, vocab_size=10)
    with pytest.raises(ValueError, match="router replay"):
        BatchSpec(seq_len=8, vocab_size=10, router_replay=True)


def test_shards_round_robin_and_pads_short_ranks_with_loss_free_copies() -> None:
    micro_batches = [_micro_batch(advantages=torch.full((8,), float(i))) for i in range(3)]
    rank0 = shard_micro_batches(micro_batches, rank=0, world_size=2)
    rank1 = shard_micro_batches(micro_batches, rank=1, world_size=2)
    assert len(rank0) == 2 and rank0[0] is micro_batches[0] and rank0[1] is micro_batches[2]
    assert rank1[0] is micro_batches[1]
    assert len(rank1) == 2 and rank1[1].num_loss_tokens == 0
    # More ranks than micro-batches: every rank still runs one.
    shards = [shard_micro_batches(micro_batches[:1], rank=r, world_size=3) for r in range(3)]
    assert [len(s) for s in shards] == [1, 1, 1]
    assert [s[0].num_loss_tokens for s in shards] == [5, 0, 0]
    with pytest.raises(ValueError, match="rank 2"):
        shard_micro_batches(micro_batches, rank=2, world_size=2)


def test_routed_experts_arrive_for_every_layer_and_the_moe_layers_are_replayed() -> None:
    spec = dataclasses.replace(REPLAY_SPEC, num_hidden_layers=4, moe_layers=(1, 3))
    wire = torch.randint(0, 8, (8, 4, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    # Columns of dense layers hold whatever the engine left there (vLLM: zeros); never checked.
    wire[:, 0] = 255
    decoded = micro_batch_from_proto(_to_proto(_micro_batch(routed_experts=wire)), spec, mode="rl")
    assert torch.equal(decoded.routed_experts, wire[:, [1, 3]])
    # The MoE layers alone are not the wire format.
    with pytest.raises(InvalidArgument) as excinfo:
        micro_batch_from_proto(_to_proto(_micro_batch(routed_experts=wire[:, [1, 3]])), spec, mode="rl")
    assert excinfo.value.field == "micro_batch.routed_experts"
    assert "num_hidden_layers 4" in excinfo.value.message
    with pytest.raises(ValueError, match="moe_layers"):
        dataclasses.replace(REPLAY_SPEC, num_hidden_layers=4, moe_layers=(1, 4))


# --- images (vision-language models) ---------------------------------------------------

IMAGE_TOKEN = 300
VL_SPEC = BatchSpec(seq_len=16, vocab_size=320, image_token_id=IMAGE_TOKEN, patches_per_image_token=4)


def _with_images(**overrides: torch.Tensor | None) -> MicroBatch:
    """The two samples, the first prompt holding one image of 2x4 patches (2 image tokens)."""
    fields = {
        "input_ids": torch.tensor([1, IMAGE_TOKEN, IMAGE_TOKEN, 4, 5, 6, 7, 8]),
        "pixel_values": torch.randn(8, 12),
        "image_grid_thw": torch.tensor([[1, 2, 4]]),
    }
    return _micro_batch(**(fields | overrides))


def test_images_decode_and_validate() -> None:
    expected = _with_images()
    decoded = micro_batch_from_proto(_to_proto(expected), VL_SPEC, mode="rl")
    assert decoded.pixel_values is not None and torch.equal(decoded.pixel_values, expected.pixel_values)
    assert decoded.image_grid_thw is not None and torch.equal(decoded.image_grid_thw, expected.image_grid_thw)
    # bfloat16 pixels (a bf16 image processor's output) are taken as they come.
    validate_micro_batch(_with_images(pixel_values=torch.randn(8, 12).bfloat16()), VL_SPEC, mode="rl")


@pytest.mark.parametrize(
    ("micro_batch", "spec", "field", "words"),
    [
        (_with_images(), SPEC, "pixel_values", "the model takes no images"),
        (
            _with_images(pixel_values=None, image_grid_thw=None),
            VL_SPEC,
            "pixel_values",
            "is required: input_ids hold 2 image tokens",
        ),
        (_with_images(pixel_values=None), VL_SPEC, "pixel_values", "give both"),
        (_with_images(image_grid_thw=None), VL_SPEC, "image_grid_thw", "give both"),
        (_with_images(image_grid_thw=torch.tensor([1, 2, 4])), VL_SPEC, "image_grid_thw", "expected [images, 3]"),
        (_with_images(image_grid_thw=torch.tensor([[1, 0, 4]])), VL_SPEC, "image_grid_thw", "positive sizes"),
        (_with_images(pixel_values=torch.randn(6, 12)), VL_SPEC, "pixel_values", "expected [8 patches, patch_dim]"),
        (
            _with_images(pixel_values=torch.full((8, 12), float("nan"))),
            VL_SPEC,
            "pixel_values",
            "holds NaN or Inf",
        ),
        # An image token cut from the prompt (truncation): its image no longer fits the tokens.
        (
            _with_images(input_ids=torch.tensor([1, IMAGE_TOKEN, 3, 4, 5, 6, 7, 8])),
            VL_SPEC,
            "input_ids",
            "hold 1 image tokens, the images 8 patches: 2 tokens",
        ),
    ],
)
def test_bad_images_are_refused_naming_the_field(micro_batch: MicroBatch, spec: BatchSpec, field: str, words: str):
    with pytest.raises(InvalidArgument) as error:
        validate_micro_batch(micro_batch, spec, mode="rl")
    assert error.value.field == f"micro_batch.{field}"
    assert words in str(error.value)
