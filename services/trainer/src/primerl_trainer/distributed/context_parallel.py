"""Context parallel (CP): one packed row (a micro-batch) shared by the ranks of the cp group.

The row is padded to a multiple of 2*cp tokens and cut into 2*cp equal chunks; rank r holds
chunks r and 2cp-1-r (the zig-zag split), so that under the causal rule every rank has the same
amount of attention work. Every tensor of the micro-batch is split the same way. Pad tokens
form a sample of their own after the last one, with no loss: they change nothing.

Token alignment (losses.py): the logits at row index t predict token t+1, and under CP row t and
token t+1 may sit on different ranks. So the per-token terms of the loss (targets, their
temperatures, loss mask, advantages, inference logprobs) are moved one place to the left before
the split ("prediction-aligned": index t holds token t+1's), and results are moved back when
gathered (`RowShard.gather_tokens`).

Attention (models/common/attention.py) sees each rank's queries with the row index of each
(`RowLayout.global_positions`) and the document ids of the whole row, and gathers the keys and
values of every rank in each layer (distributed/cp_collectives.py). Everything else in a
transformer is per token, and rotary embeddings take the split position ids as they are.
With cp_size 1 the layout is the whole row, unpadded: the trainer takes one code path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from primerl_trainer.batch import MicroBatch
from primerl_trainer.distributed.cp_collectives import zigzag_to_row
from primerl_trainer.models.common.attention import document_ids

__all__ = ["RowLayout", "RowShard", "apply_context_parallel", "shard_micro_batch"]


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Where one cp rank's tokens sit in a packed row of `num_tokens` tokens."""

    cp_rank: int
    cp_size: int
    num_tokens: int
    # The row's length after padding: a multiple of 2 * cp_size (num_tokens when cp_size is 1).
    padded_len: int
    # [padded_len] int64: the sample each token of the padded row belongs to (attention.document_ids).
    document_ids: torch.Tensor

    @classmethod
    def of(cls, position_ids: torch.Tensor, *, cp_rank: int, cp_size: int) -> RowLayout:
        """The layout of a row with these position ids ([T], restarting at each sample)."""
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp rank {cp_rank} outside [0, {cp_size})")
        num_tokens = position_ids.numel()
        multiple = 2 * cp_size if cp_size > 1 else 1
        padded_len = -(-num_tokens // multiple) * multiple
        padded = torch.cat([position_ids, torch.arange(padded_len - num_tokens, dtype=position_ids.dtype)])
        return cls(cp_rank, cp_size, num_tokens, padded_len, document_ids(padded[None])[0])

    @property
    def chunk_len(self) -> int:
        return self.padded_len // (2 * self.cp_size) if self.cp_size > 1 else self.padded_len

    @property
    def chunk_starts(self) -> tuple[int, ...]:
        """Row index of the first token of each of this rank's chunks, in local order."""
        if self.cp_size == 1:
            return (0,)
        return (self.cp_rank * self.chunk_len, (2 * self.cp_size - 1 - self.cp_rank) * self.chunk_len)

    @property
    def num_local_tokens(self) -> int:
        return len(self.chunk_starts) * self.chunk_len

    @functools.cached_property
    def global_positions(self) -> torch.Tensor:
        """[num_local_tokens] int64: the row index of each of this rank's tokens."""
        return torch.cat([torch.arange(start, start + self.chunk_len) for start in self.chunk_starts])

    @functools.cached_property
    def single_document(self) -> bool:
        """Whether the row's real tokens are one sample (causal attention needs no mask then:
        pad tokens come after them and see what they like, without loss)."""
        return self.num_tokens == 0 or int(self.document_ids[self.num_tokens - 1]) == 0

    def split(self, values: torch.Tensor, *, pad_value: float | bool = 0) -> torch.Tensor:
        """This rank's part of `values` [num_tokens, ...], the row padded with `pad_value`."""
        if values.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} values along dim 0, got {values.shape[0]}")
        pad = values.new_full((self.padded_len - self.num_tokens, *values.shape[1:]), pad_value)
        return self.local(torch.cat([values, pad]))

    def local(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's part of `padded` [padded_len, ...]."""
        return torch.cat([padded[start : start + self.chunk_len] for start in self.chunk_starts])

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Every rank's `local` [num_local_tokens, ...] (the output of `split` or of the model)
        -> [num_tokens, ...] in row order, on every rank. Collective over the cp group; not
        differentiable."""
        if local.shape[0] != self.num_local_tokens:
            raise ValueError(f"expected {self.num_local_tokens} local values along dim 0, got {local.shape[0]}")
        if self.cp_size == 1:
            return local[: self.num_tokens]
        local = local.detach().contiguous()
        gathered = local.new_empty((self.cp_size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=group)
        return zigzag_to_row(gathered, self.cp_size)[: self.num_tokens]


@dataclass(frozen=True, eq=False)
class RowShard:
    """One cp rank's part of a micro-batch, as the model and the loss take it.

    `input_ids`, `position_ids` and `routed_experts` are the rank's tokens; the other tensors
    are prediction-aligned (index i holds the terms of the token after local token i; see the
    module docstring). All on the CPU until the trainer moves them."""

    layout: RowLayout
    input_ids: torch.Tensor  # int64 [t]
    position_ids: torch.Tensor  # int64 [t]
    routed_experts: torch.Tensor | None  # [t, moe layers, top_k]
    targets: torch.Tensor  # int64 [t]
    target_temperatures: torch.Tensor  # float32 [t]
    loss_mask: torch.Tensor  # bool [t]
    advantages: torch.Tensor | None  # float32 [t]
    inference_logprobs: torch.Tensor | None  # float32 [t]
    # The row's images (vision-language models take them on whole rows only).
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def gather_tokens(self, values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Prediction-aligned local values (e.g. the logprobs of `targets`) -> token-aligned
        [num_tokens] in row order, 0 at index 0 (losses.token_logprobs' alignment)."""
        rows = self.layout.gather(values, group)
        return torch.cat([rows.new_zeros(1), rows[:-1]])


def shard_micro_batch(micro_batch: MicroBatch, *, cp_rank: int, cp_size: int) -> RowShard:
    """This cp rank's `RowShard` of `micro_batch` (cp_size 1: the whole row)."""
    layout = RowLayout.of(micro_batch.position_ids, cp_rank=cp_rank, cp_size=cp_size)
    num_pad = layout.padded_len - layout.num_tokens

    def predicted(values: torch.Tensor | None, pad_value: float | bool) -> torch.Tensor | None:
        # Index t takes token t+1's value; the last index (and the pad tokens) the pad value.
        if values is None:
            return None
        return layout.split(torch.cat([values[1:], values.new_full((1,), pad_value)]), pad_value=pad_value)

    # The pad tokens' positions restart at 0: a sample of their own.
    pad_positions = torch.arange(num_pad, dtype=micro_batch.position_ids.dtype)
    return RowShard(
        layout=layout,
        input_ids=layout.split(micro_batch.input_ids),
        position_ids=layout.local(torch.cat([micro_batch.position_ids, pad_positions])),
        routed_experts=None if micro_batch.routed_experts is None else layout.split(micro_batch.routed_experts),
        targets=predicted(micro_batch.input_ids, 0),
        target_temperatures=predicted(micro_batch.temperatures, 1.0),
        loss_mask=predicted(micro_batch.loss_mask, False),
        advantages=predicted(micro_batch.advantages, 0.0),
        inference_logprobs=predicted(micro_batch.inference_logprobs, 0.0),
        pixel_values=micro_batch.pixel_values,
        image_grid_thw=micro_batch.image_grid_thw,
    )


def apply_context_parallel(model: nn.Module, *, cp_mesh: DeviceMesh) -> None:
    """Lets `model` (an own implementation of the registry) take rows split over `cp_mesh`:
    its attention gathers keys and values over the mesh's group when the forward is given a
    `RowLayout` of cp_size > 1."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"the cp mesh must be 1-D, got {cp_mesh.ndim} dimensions")
    if not hasattr(model, "cp_group"):
        raise ValueError(
            f"context parallel (parallel.cp > 1) needs the own model implementation, not {type(model).__name__}"
        )
    model.cp_group = cp_mesh.get_group()
