"""Packing samples into micro-batches of at most seq_len tokens.

First fit decreasing: samples, longest first, go into the first micro-batch with room, so a
batch needs few micro-batches and every run packs the same samples the same way. Position ids
restart at 0 at each sample. A sample longer than seq_len is truncated to its first seq_len
tokens (counted); one left with no loss token is dropped (counted too).

An image's tokens are never cut: a cut that would fall inside them moves back to the image's
first token (counted), so the image goes out whole or not at all, and the images whose tokens
are kept go with the micro-batch (pixel_values and image_grid_thw, in the order of their tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from primerl_orchestrator.samples import PromptImage, Sample

__all__ = ["MicroBatchTensors", "PackedBatch", "TrainingSample", "pack"]


@dataclass(frozen=True)
class TrainingSample:
    sample: Sample
    advantage: float


@dataclass(frozen=True)
class MicroBatchTensors:
    """The tensors of one trainer.v1 MicroBatch, each [T] (routed experts [T, layers, top_k])."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor
    policy_versions: torch.Tensor
    routed_experts: torch.Tensor | None
    # [patches, patch_dim] and [images, 3], or None without images.
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "loss_mask": self.loss_mask,
            "advantages": self.advantages,
            "inference_logprobs": self.inference_logprobs,
            "temperatures": self.temperatures,
            "policy_versions": self.policy_versions,
        }
        optional = {
            "routed_experts": self.routed_experts,
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
        }
        return tensors | {name: tensor for name, tensor in optional.items() if tensor is not None}


@dataclass(frozen=True)
class PackedBatch:
    micro_batches: list[MicroBatchTensors]
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    min_policy_version: int
    max_policy_version: int
    num_truncated: int
    num_dropped_empty: int
    # Truncations moved back to the start of an image whose tokens they would have cut.
    num_truncated_before_image: int = 0


def pack(samples: Sequence[TrainingSample], *, seq_len: int, with_routed_experts: bool) -> PackedBatch:
    fitted: list[tuple[TrainingSample, int]] = []
    num_truncated = num_dropped_empty = num_before_image = 0
    for item in samples:
        length = len(item.sample)
        if length > seq_len:
            num_truncated += 1
            length = _cut_outside_images(item.sample, seq_len)
            num_before_image += length < seq_len
            if not any(item.sample.loss_mask[:length]):
                num_dropped_empty += 1
                continue
        fitted.append((item, length))

    bins: list[list[tuple[TrainingSample, int]]] = []
    room: list[int] = []
    # sorted() is stable: equal lengths keep their order.
    for item, length in sorted(fitted, key=lambda entry: -entry[1]):
        for index, free in enumerate(room):
            if length <= free:
                bins[index].append((item, length))
                room[index] -= length
                break
        else:
            bins.append([(item, length)])
            room.append(seq_len - length)

    micro_batches = [_micro_batch(contents, with_routed_experts=with_routed_experts) for contents in bins]
    loss_versions = [
        version
        for item, length in fitted
        for version, counted in zip(item.sample.policy_versions[:length], item.sample.loss_mask[:length], strict=True)
        if counted
    ]
    return PackedBatch(
        micro_batches=micro_batches,
        num_samples=len(fitted),
        num_tokens=sum(length for _, length in fitted),
        num_loss_tokens=len(loss_versions),
        min_policy_version=min(loss_versions, default=0),
        max_policy_version=max(loss_versions, default=0),
        num_truncated=num_truncated,
        num_dropped_empty=num_dropped_empty,
        num_truncated_before_image=num_before_image,
    )


def _cut_outside_images(sample: Sample, length: int) -> int:
    """`length`, or the first token of the image whose tokens it would cut."""
    for start, image in zip(sample.image_starts, sample.images, strict=True):
        if start < length < start + image.num_tokens:
            return start
    return length


def _micro_batch(contents: list[tuple[TrainingSample, int]], *, with_routed_experts: bool) -> MicroBatchTensors:
    input_ids: list[int] = []
    position_ids: list[int] = []
    loss_mask: list[bool] = []
    advantages: list[float] = []
    logprobs: list[float] = []
    temperatures: list[float] = []
    versions: list[int] = []
    routed: list[torch.Tensor] = []
    images: list[PromptImage] = []
    for item, length in contents:
        sample = item.sample
        mask = sample.loss_mask[:length]
        input_ids += sample.token_ids[:length]
        position_ids += range(length)
        loss_mask += mask
        advantages += [item.advantage if counted else 0.0 for counted in mask]
        logprobs += sample.logprobs[:length]
        temperatures += sample.temperatures[:length]
        versions += sample.policy_versions[:length]
        if with_routed_experts:
            rows = sample.routed_experts()
            assert rows is not None, "router replay needs every sample's routed experts"
            routed.append(rows[:length])
        images += [image for image, start in zip(sample.images, sample.image_starts, strict=True) if start < length]
    return MicroBatchTensors(
        input_ids=torch.tensor(input_ids, dtype=torch.int32),
        position_ids=torch.tensor(position_ids, dtype=torch.int32),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        inference_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        policy_versions=torch.tensor(versions, dtype=torch.int64),
        routed_experts=torch.cat(routed) if with_routed_experts else None,
        pixel_values=torch.cat([image.pixel_values for image in images]) if images else None,
        image_grid_thw=torch.tensor([image.grid_thw for image in images], dtype=torch.int64) if images else None,
    )
