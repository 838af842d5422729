"""Micro-batches: decoded from `primerl.trainer.v1.MicroBatch` and checked before any training.

A micro-batch is samples packed back to back into one sequence of T <= seq_len tokens; every
tensor has one entry per token (alignment: see losses.py), position_ids restart at 0 at each
sample's first token. A batch (one optimizer step) is validated whole before any of it is
trained on, so a bad micro-batch never leaves a half-taken step behind; errors are
`InvalidArgument` naming the field ("micro_batch.advantages").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from primerl.trainer.v1 import trainer_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.tensors import tensor_from_proto
from primerl_trainer.config_types import TrainingMode

__all__ = [
    "BatchSpec",
    "MicroBatch",
    "TrainingMode",
    "micro_batch_from_proto",
    "shard_micro_batches",
    "validate_batch",
    "validate_micro_batch",
]

_INDEX_DTYPES = (torch.int32, torch.int64)
_EXPERT_DTYPES = (torch.uint8, torch.uint16)
_PIXEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class BatchSpec:
    """What the trainer accepts (the answer to GetBatchSpec).

    Routed experts arrive as [T, num_hidden_layers, top_k], the layer axis indexed by layer
    number over every decoder layer (vLLM's convention); `moe_layers` are the layers whose
    columns are replayed, in order. Left unset, `num_hidden_layers` is `num_moe_layers` and
    `moe_layers` all of them (a model whose every layer is a mixture of experts).
    """

    seq_len: int
    vocab_size: int
    router_replay: bool = False
    num_moe_layers: int = 0
    num_experts_per_token: int = 0
    num_experts: int = 0
    num_hidden_layers: int | None = None
    moe_layers: tuple[int, ...] | None = None
    # Vision-language models: the token standing for one merged patch, and the patches per
    # such token (None: the model takes no images).
    image_token_id: int | None = None
    patches_per_image_token: int = 0
    # Token ids inference never samples (a vision-language model's placeholders,
    # primerl_common.images.vision_placeholder_token_ids): logprobs leave them out as its do.
    unsampled_token_ids: tuple[int, ...] = ()
    # The LoRA adapter published alone (publish.kind "adapter"), which rollouts must use; "" for none.
    lora_adapter: str = ""

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.vocab_size <= 0:
            raise ValueError(f"seq_len and vocab_size must be positive, got {self.seq_len} and {self.vocab_size}")
        if self.router_replay and min(self.num_moe_layers, self.num_experts_per_token, self.num_experts) <= 0:
            raise ValueError("router replay needs positive num_moe_layers, num_experts_per_token and num_experts")
        if self.image_token_id is not None and self.patches_per_image_token <= 0:
            raise ValueError("a model that takes images needs patches_per_image_token > 0")
        if self.num_hidden_layers is None:
            object.__setattr__(self, "num_hidden_layers", self.num_moe_layers)
        if self.moe_layers is None:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_moe_layers)))
        assert self.num_hidden_layers is not None and self.moe_layers is not None
        if len(self.moe_layers) != self.num_moe_layers or not all(
            0 <= layer < self.num_hidden_layers for layer in self.moe_layers
        ):
            raise ValueError(
                f"moe_layers {list(self.moe_layers)} must be {self.num_moe_layers} layer numbers "
                f"below num_hidden_layers {self.num_hidden_layers}"
            )


# eq=False: field-wise == on tensors has no single truth value.
@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One packed sequence of T tokens, on the CPU until the train step moves it."""

    input_ids: torch.Tensor  # int64 [T]
    position_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    temperatures: torch.Tensor  # float32 [T]
    advantages: torch.Tensor | None = None  # float32 [T], RL only
    inference_logprobs: torch.Tensor | None = None  # float32 [T], RL only
    routed_experts: torch.Tensor | None = None  # uint8/uint16 [T, moe layers, top_k], with router replay
    policy_versions: torch.Tensor | None = None  # int64 [T]
    # The samples' images, in the order of their image tokens (vision-language models).
    pixel_values: torch.Tensor | None = None  # float32/bfloat16 [patches, patch_dim]
    image_grid_thw: torch.Tensor | None = None  # int64 [images, 3]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def micro_batch_from_proto(
    msg: trainer_pb2.MicroBatch, spec: BatchSpec, *, mode: TrainingMode, index: int = 0
) -> MicroBatch:
    """Decode and validate one micro-batch of a PushBatch stream (`index`: its place in the batch).

    Token ids and positions may come as int32 (widened to int64). Routed experts are decoded
    only when the spec replays them: [T, num_hidden_layers, top_k] on the wire, the MoE layers'
    columns [T, num_moe_layers, top_k] in the micro-batch.
    """
    present = {field.name for field, _ in msg.ListFields()}

    def decode(name: str, dtypes: tuple[torch.dtype, ...], *, required: bool) -> torch.Tensor | None:
        if name not in present:
            if required:
                raise _invalid(index, name, "is required")
            return None
        try:
            tensor = tensor_from_proto(getattr(msg, name))
        except ValueError as e:
            raise _invalid(index, name, str(e)) from None
        if tensor.dtype not in dtypes:
            raise _invalid(index, name, f"has dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")
        return tensor

    rl = mode == "rl"
    input_ids = decode("input_ids", _INDEX_DTYPES, required=True)
    position_ids = decode("position_ids", _INDEX_DTYPES, required=True)
    loss_mask = decode("loss_mask", (torch.bool,), required=True)
    temperatures = decode("temperatures", (torch.float32,), required=rl)
    assert input_ids is not None and position_ids is not None and loss_mask is not None
    micro_batch = MicroBatch(
        input_ids=input_ids.long(),
        position_ids=position_ids.long(),
        loss_mask=loss_mask,
        # SFT trains at temperature 1 unless told otherwise.
        temperatures=torch.ones(input_ids.shape, dtype=torch.float32) if temperatures is None else temperatures,
        advantages=decode("advantages", (torch.float32,), required=rl),
        inference_logprobs=decode("inference_logprobs", (torch.float32,), required=rl),
        routed_experts=_moe_columns(decode("routed_experts", _EXPERT_DTYPES, required=True), spec, index=index)
        if spec.router_replay
        else None,
        policy_versions=decode("policy_versions", (torch.int64,), required=False),
        pixel_values=decode("pixel_values", _PIXEL_DTYPES, required=False),
        image_grid_thw=decode("image_grid_thw", (torch.int64,), required=False),
    )
    validate_micro_batch(micro_batch, spec, mode=mode, index=index)
    return micro_batch


def validate_micro_batch(micro_batch: MicroBatch, spec: BatchSpec, *, mode: TrainingMode, index: int = 0) -> None:
    """Raise `InvalidArgument` naming the first bad field of a micro-batch, if any."""
    input_ids = micro_batch.input_ids
    if input_ids.dim() != 1 or not 0 < input_ids.numel() <= spec.seq_len:
        raise _invalid(
            index, "input_ids", f"has shape {list(input_ids.shape)}, expected [T] with 0 < T <= seq_len {spec.seq_len}"
        )
    num_tokens = input_ids.numel()

    def check_tokenwise(name: str, dtypes: tuple[torch.dtype, ...], *, required: bool) -> torch.Tensor | None:
        tensor = getattr(micro_batch, name)
        if tensor is None:
            if required:
                raise _invalid(index, name, "is required")
            return None
        if tensor.dtype not in dtypes:
            raise _invalid(index, name, f"has dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")
        if tensor.shape != (num_tokens,):
            raise _invalid(index, name, f"has shape {list(tensor.shape)}, expected [{num_tokens}] like input_ids")
        return tensor

    rl = mode == "rl"
    check_tokenwise("input_ids", (torch.int64,), required=True)
    position_ids = check_tokenwise("position_ids", (torch.int64,), required=True)
    loss_mask = check_tokenwise("loss_mask", (torch.bool,), required=True)
    temperatures = check_tokenwise("temperatures", (torch.float32,), required=True)
    advantages = check_tokenwise("advantages", (torch.float32,), required=rl)
    inference_logprobs = check_tokenwise("inference_logprobs", (torch.float32,), required=rl)
    policy_versions = check_tokenwise("policy_versions", (torch.int64,), required=False)
    assert position_ids is not None and loss_mask is not None and temperatures is not None

    if (bad := _first(~((input_ids >= 0) & (input_ids < spec.vocab_size)))) is not None:
        raise _invalid(index, "input_ids", f"token {bad} is {int(input_ids[bad])}, outside [0, {spec.vocab_size})")
    previous = torch.cat([position_ids.new_full((1,), -1), position_ids[:-1]])
    if (bad := _first((position_ids != 0) & (position_ids != previous + 1))) is not None:
        raise _invalid(
            index,
            "position_ids",
            f"token {bad} has position {int(position_ids[bad])} after {int(previous[bad])}: positions start at 0 "
            "at each sample and count up by one",
        )
    if (bad := _first(loss_mask & (position_ids == 0))) is not None:
        raise _invalid(index, "loss_mask", f"token {bad} starts a sample: nothing before it predicts it")
    if (bad := _first(~(torch.isfinite(temperatures) & (temperatures > 0)))) is not None:
        raise _invalid(index, "temperatures", f"token {bad} has temperature {float(temperatures[bad])}, not > 0")
    if rl:
        assert advantages is not None and inference_logprobs is not None
        for name, values in (("advantages", advantages), ("inference_logprobs", inference_logprobs)):
            if (bad := _first(~torch.isfinite(values))) is not None:
                raise _invalid(index, name, f"token {bad} is {float(values[bad])}")
    if policy_versions is not None and (bad := _first(policy_versions < 0)) is not None:
        raise _invalid(index, "policy_versions", f"token {bad} has negative version {int(policy_versions[bad])}")
    if spec.router_replay:
        _validate_routed_experts(micro_batch.routed_experts, spec, num_tokens=num_tokens, index=index)
    _validate_images(micro_batch, spec, index=index)


def validate_batch(
    micro_batches: Sequence[MicroBatch],
    spec: BatchSpec,
    *,
    mode: TrainingMode,
    num_loss_tokens: int | None = None,
) -> int:
    """Validate a whole batch; return its loss-token count (the loss normaliser).

    `num_loss_tokens`: the count the sender announced (BatchBegin), checked when given.
    """
    if not micro_batches:
        raise InvalidArgument("a batch needs at least one micro-batch", field="begin.num_micro_batches")
    for index, micro_batch in enumerate(micro_batches):
        validate_micro_batch(micro_batch, spec, mode=mode, index=index)
    total = sum(micro_batch.num_loss_tokens for micro_batch in micro_batches)
    if num_loss_tokens is not None and num_loss_tokens != total:
        raise InvalidArgument(
            f"announced {num_loss_tokens} loss tokens, the micro-batches' loss_mask holds {total}",
            field="begin.num_loss_tokens",
        )
    if total == 0:
        raise InvalidArgument("no token of the batch counts in the loss", field="micro_batch.loss_mask")
    return total


def shard_micro_batches(micro_batches: Sequence[MicroBatch], *, rank: int, world_size: int) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches: every `world_size`-th one from `rank`.

    Every rank gets the same number, ceil(M / world_size): FSDP's collectives need each rank to
    run as many forward and backward passes as the others. A rank short of one repeats the first
    micro-batch with an all-False loss mask, which adds nothing to the loss or the gradient.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    assert micro_batches, "an empty batch is rejected by validate_batch"
    share = list(micro_batches[rank::world_size])
    num_per_rank = math.ceil(len(micro_batches) / world_size)
    filler = dataclasses.replace(micro_batches[0], loss_mask=torch.zeros_like(micro_batches[0].loss_mask))
    return share + [filler] * (num_per_rank - len(share))


def _moe_columns(routed_experts: torch.Tensor | None, spec: BatchSpec, *, index: int) -> torch.Tensor:
    """The replayed layers' columns of routed experts as the wire carries them (all layers)."""
    assert routed_experts is not None and spec.moe_layers is not None
    if routed_experts.dim() != 3 or routed_experts.shape[1:] != (spec.num_hidden_layers, spec.num_experts_per_token):
        raise _invalid(
            index,
            "routed_experts",
            f"has shape {list(routed_experts.shape)}, expected [T, num_hidden_layers {spec.num_hidden_layers}, "
            f"top_k {spec.num_experts_per_token}]",
        )
    if spec.moe_layers == tuple(range(spec.num_hidden_layers)):
        return routed_experts
    return routed_experts[:, list(spec.moe_layers)].contiguous()


def _validate_images(micro_batch: MicroBatch, spec: BatchSpec, *, index: int) -> None:
    """The images agree with each other and with the image tokens of input_ids: a prompt whose
    image tokens were cut (or whose images went missing) is refused here, not trained on."""
    pixel_values, grid = micro_batch.pixel_values, micro_batch.image_grid_thw
    num_image_tokens = 0 if spec.image_token_id is None else int((micro_batch.input_ids == spec.image_token_id).sum())
    if pixel_values is None and grid is None:
        if num_image_tokens:
            raise _invalid(index, "pixel_values", f"is required: input_ids hold {num_image_tokens} image tokens")
        return
    if spec.image_token_id is None:
        raise _invalid(index, "pixel_values", "the model takes no images (its batch spec names no image_token_id)")
    if pixel_values is None or grid is None:
        raise _invalid(index, "image_grid_thw" if grid is None else "pixel_values", "goes with the other: give both")
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or bool((grid <= 0).any()):
        raise _invalid(index, "image_grid_thw", f"has shape {list(grid.shape)}, expected [images, 3] of positive sizes")
    num_patches = int(grid.prod(dim=1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != num_patches:
        raise _invalid(
            index, "pixel_values", f"has shape {list(pixel_values.shape)}, expected [{num_patches} patches, patch_dim]"
        )
    if not bool(torch.isfinite(pixel_values).all()):
        raise _invalid(index, "pixel_values", "holds NaN or Inf")
    if num_patches != num_image_tokens * spec.patches_per_image_token:
        raise _invalid(
            index,
            "input_ids",
            f"hold {num_image_tokens} image tokens, the images {num_patches} patches: "
            f"{num_patches // spec.patches_per_image_token} tokens ({spec.patches_per_image_token} patches each)",
        )


def _validate_routed_experts(
    routed_experts: torch.Tensor | None, spec: BatchSpec, *, num_tokens: int, index: int
) -> None:
    if routed_experts is None:
        raise _invalid(index, "routed_experts", "is required: the trainer replays routed experts")
    expected = (num_tokens, spec.num_moe_layers, spec.num_experts_per_token)
    if routed_experts.shape != expected:
        raise _invalid(index, "routed_experts", f"has shape {list(routed_experts.shape)}, expected {list(expected)}")
    if routed_experts.dtype not in _EXPERT_DTYPES:
        raise _invalid(index, "routed_experts", f"has dtype {routed_experts.dtype}, expected uint8 or uint16")
    # uint16 has no comparison kernels on every device; the indices fit in int32.
    experts = routed_experts.to(torch.int32)
    if (bad := _first((experts >= spec.num_experts).any(dim=(1, 2)))) is not None:
        raise _invalid(
            index, "routed_experts", f"token {bad} names expert {int(experts[bad].max())} of {spec.num_experts}"
        )


def _first(flags: torch.Tensor) -> int | None:
    """Index of the first True of a 1-D bool tensor, or None."""
    hits = flags.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


def _invalid(index: int, name: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"micro-batch {index}: {message}", field=f"micro_batch.{name}")
