"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the linear-attention layer of Qwen3.5 and
Qwen3-Next: a short causal convolution over the projected queries, keys and values, then the
gated delta rule (gated_delta_rule.py: its recurrent and chunked forms in PyTorch, the CPU path
and the reference), then an RMSNorm of each output head gated by silu(z) and the output
projection. On CUDA the layer runs flash-linear-attention's kernels (package `fla-core`) when
importable and usable on the device (`fla_unusable_reason`), else the PyTorch path, saying why once.

Packed rows: `Segments` names where each sample starts. The convolution and the recurrence
start from zero state at every sample start, so nothing flows from one sample into the next.

Context parallel (`ContextParallelRow`, a row split zig-zag into 2 * cp chunks, two per rank):
the PyTorch path passes the state between ranks. Each rank scans its two chunks from zero state
while tracking how the result depends on the state entering them (the rule is linear in its
state: the scan of [v | 0] from [0 | I] gives S = B + A S_in and o = o_B + o_A S_in); the ranks
all-gather each chunk's (A, B) and the convolution's last inputs, chain the states through the
chunks in row order, and add o_A S_in to their outputs. Samples that start inside a chunk start
from zero state as anywhere. fla's kernels instead gather the inputs of the whole row (one
all-gather per layer, as attention gathers keys and values), scan it on every rank and keep
their tokens.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.distributed.cp_collectives import gather_sequence
from primerl_trainer.models.common.attention import AttentionMask, document_ids
from primerl_trainer.models.common.gated_delta_rule import (
    DEFAULT_CHUNK_SIZE,
    causal_conv1d,
    chunked_gated_delta_rule,
    compute_dtype,
    l2_normalize,
)
from primerl_trainer.models.common.norms import RMSNorm

if TYPE_CHECKING:
    import torch.distributed as dist

    from primerl_trainer.distributed.context_parallel import RowLayout

logger = logging.getLogger(__name__)

GatedDeltaNetImpl = Literal["auto", "torch", "fla"]
GATED_DELTA_NET_IMPLS: tuple[GatedDeltaNetImpl, ...] = ("auto", "torch", "fla")


@dataclass(frozen=True)
class Segments:
    """The samples of a batch of packed rows [B, T], as spans of the flattened B*T tokens:
    sample n is tokens cu_seqlens[n]..cu_seqlens[n+1]-1, never crossing a row's end.

    `padded_index` [B*T] places token t at row n, column t - cu_seqlens[n] of a [N, max_len]
    right-padded batch of the samples (n * max_len + column), where the PyTorch path runs them."""

    cu_seqlens: torch.Tensor
    padded_index: torch.Tensor
    num_samples: int
    max_len: int

    @classmethod
    def of(cls, document_ids_BT: torch.Tensor) -> Segments:
        """From [B, T] sample ids that never decrease along a row (attention.document_ids).
        Reads the sample count and longest sample back to the host: one sync per forward."""
        device = document_ids_BT.device
        starts = torch.ones_like(document_ids_BT, dtype=torch.bool)
        starts[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
        starts = starts.reshape(-1)
        num_tokens = starts.numel()
        start_index = starts.nonzero().squeeze(-1)
        cu_seqlens = torch.cat([start_index, start_index.new_full((1,), num_tokens)])
        sample_of_token = starts.long().cumsum(0) - 1
        lengths = cu_seqlens.diff()
        num_samples, max_len = start_index.numel(), int(lengths.max())
        column = torch.arange(num_tokens, device=device) - cu_seqlens[sample_of_token]
        return cls(cu_seqlens, sample_of_token * max_len + column, num_samples, max_len)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, max_len, ...], zeros after each sample's end."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_zeros(self.num_samples * self.max_len, *x.shape[2:])
        return out.index_copy(0, self.padded_index, flat).view(self.num_samples, self.max_len, *x.shape[2:])

    def unpad(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        """[N, max_len, ...] -> [B, T, ...], the inverse of `pad`."""
        return x.reshape(-1, *x.shape[2:])[self.padded_index].view(batch_size, -1, *x.shape[2:])


@dataclass(frozen=True)
class ContextParallelRow:
    """This rank's share of one row split zig-zag over `cp_size` ranks (the process group named
    `group_name`): its tokens are the row's at `local_positions` [t]."""

    group_name: str
    cp_size: int
    local_positions: torch.Tensor
    # [padded row length]: the sample of every token of the row (attention.document_ids).
    document_ids: torch.Tensor

    @functools.cached_property
    def pieces(self) -> Segments:
        """This rank's tokens cut at its chunk boundary and at sample starts."""
        docs = self.document_ids[self.local_positions]
        starts = torch.ones_like(docs, dtype=torch.bool)
        starts[1:] = docs[1:] != docs[:-1]
        starts[self.chunk_len] = True
        return Segments.of((starts.long().cumsum(0) - 1)[None])

    @property
    def chunk_len(self) -> int:
        return self.local_positions.numel() // 2

    def chunk_starts(self) -> list[int]:
        """Row index of the first token of each of this rank's two chunks."""
        return [int(self.local_positions[c * self.chunk_len]) for c in range(2)]

    def continues(self, row_index: int) -> bool:
        """Whether the token at `row_index` continues the sample of the token before it."""
        return row_index > 0 and bool(self.document_ids[row_index - 1] == self.document_ids[row_index])

    def first_pieces(self) -> list[int]:
        """The piece (of `pieces`) each of this rank's two chunks starts with."""
        return [int(self.pieces.padded_index[c * self.chunk_len]) // self.pieces.max_len for c in range(2)]

    def conv_states(self, inputs: torch.Tensor, conv_width: int) -> torch.Tensor:
        """The states a causal convolution of width `conv_width` enters each piece with: for the
        first piece of each chunk the inputs [1, t, channels] before it in its sample (from the
        ranks before, zeros where the sample starts with the chunk), zeros for the others ->
        [num pieces, channels, conv_width - 1]. All-gathers every chunk's last inputs: every rank
        must call it (so must their backwards)."""
        chunk_len, num_channels = self.chunk_len, inputs.shape[-1]
        # The convolution's last inputs of every chunk of the row (fewer in chunks shorter than that).
        tail = min(conv_width - 1, chunk_len)
        tails = inputs[0].view(2, chunk_len, num_channels)[:, chunk_len - tail :].reshape(2 * tail, -1)
        row_tails = gather_sequence(tails, self.group_name, self.cp_size)
        tail_positions = (
            torch.arange(2 * self.cp_size, device=tails.device)[:, None] * chunk_len + chunk_len - tail
        ) + torch.arange(tail, device=tails.device)
        # Computed for both chunks even where a sample starts with the chunk: every rank's backward
        # then takes part in the gather's.
        states = []
        for start in self.chunk_starts():
            before = row_tails[: (start // chunk_len) * tail][-(conv_width - 1) :]
            positions = tail_positions.flatten()[: (start // chunk_len) * tail][-(conv_width - 1) :]
            before = before * (self.document_ids[positions] == self.document_ids[start])[:, None]
            states.append(F.pad(before.T, (conv_width - 1 - before.shape[0], 0)))
        return inputs.new_zeros(self.pieces.num_samples, num_channels, conv_width - 1).index_copy(
            0, torch.tensor(self.first_pieces(), device=inputs.device), torch.stack(states).to(inputs.dtype)
        )

    def gather(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each [1, t, ...] -> [1, cp_size * t, ...], the whole row in order, in one collective
        (through the widest dtype and back, which is exact). Differentiable."""
        dtype = compute_dtype(*tensors)
        flat = [t.reshape(t.shape[1], -1) for t in tensors]
        row = gather_sequence(torch.cat([t.to(dtype) for t in flat], dim=-1), self.group_name, self.cp_size)
        parts = row.split([t.shape[-1] for t in flat], dim=-1)
        return [part.to(t.dtype).reshape(1, -1, *t.shape[2:]) for part, t in zip(parts, tensors, strict=True)]


def segments_of(position_ids: torch.Tensor | None) -> Segments | None:
    """The samples of rows whose position ids restart at each sample; None when each row is one
    sample (position_ids None, or counting up from the row's first token)."""
    if position_ids is None:
        return None
    docs = document_ids(position_ids)
    if not bool((docs[:, -1] == 0).all()):
        return Segments.of(docs)
    return None


class GatedRMSNorm(RMSNorm):
    """RMSNorm of each output head, times silu of the gate z (in float32 at least), in x's dtype."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(gate.to(compute_dtype(gate)))).to(x.dtype)


@functools.cache
def _fla_ops():
    """flash-linear-attention's varlen kernels (chunked rule, causal conv), or why not importable."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    except ImportError as error:
        return None, f"flash-linear-attention is not importable ({error}); install the trainer's `fla` extra"
    return (fla_causal_conv1d, fla_chunk_gated_delta_rule), None


def _release(version: str) -> tuple[int, ...]:
    """'3.6.0+git1a2b' -> (3, 6, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def fla_hopper_triton_problem(
    capability: tuple[int, int], triton_version: str | None, has_tilelang: bool
) -> str | None:
    """fla's rule for its gated chunked backward (fla #640): Triton 3.4.0 up to before 3.7.1 computes it
    wrongly on Hopper (compute capability 9.x), so fla raises in the backward unless tilelang stands in.
    Returns the reason its kernels are unusable, or None."""
    if capability[0] != 9 or triton_version is None or has_tilelang:
        return None
    if (3, 4, 0) <= _release(triton_version) < (3, 7, 1):
        return (
            f"flash-linear-attention's gated chunked backward is wrong with Triton {triton_version} on Hopper "
            f"(compute capability {capability[0]}.{capability[1]}; fla #640) and fla refuses it: "
            "upgrade Triton to >= 3.7.1 or install tilelang"
        )
    return None


@functools.cache
def fla_unusable_reason(device_index: int) -> str | None:
    """Why flash-linear-attention's kernels cannot run on CUDA device `device_index` (None: they
    can), decided up front rather than by fla raising in the backward; warns once per device."""
    reason = _fla_ops()[1]
    if reason is None:
        try:
            triton_version: str | None = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton_version = None
        reason = fla_hopper_triton_problem(
            torch.cuda.get_device_capability(device_index),
            triton_version,
            importlib.util.find_spec("tilelang") is not None,
        )
    if reason is not None:
        logger.warning("Gated DeltaNet on CUDA runs its PyTorch path (slow): %s", reason)
    return reason


def _device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


class GatedDeltaNet(nn.Module):
    """The layer: in_proj_qkv -> causal conv -> q, k, v heads; in_proj_b -> beta = sigmoid;
    in_proj_a -> g = -exp(A_log) softplus(a + dt_bias); the rule; norm(o, in_proj_z) -> out_proj.
    Key heads are shared by num_v_heads / num_k_heads value heads each (consecutive ones).

    `impl`: "torch" the PyTorch path (chunked form), "fla" flash-linear-attention's kernels
    (CUDA; ValueError when absent or unusable), "auto" fla on CUDA when usable, else torch."""

    def __init__(
        self,
        *,
        dim: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_width: int,
        norm_eps: float,
        impl: GatedDeltaNetImpl = "auto",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})"
            )
        if impl not in GATED_DELTA_NET_IMPLS:
            raise ValueError(f"gated delta net impl must be one of {GATED_DELTA_NET_IMPLS}, got {impl!r}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.impl = impl
        self.chunk_size = chunk_size
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_channels = 2 * key_dim + value_dim
        self.in_proj_qkv = nn.Linear(dim, self.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, num_v_heads, bias=False)
        # Depthwise: one filter of conv_width taps per channel, stored as Hugging Face's Conv1d.
        self.conv1d = nn.Conv1d(
            self.conv_channels, self.conv_channels, conv_width, groups=self.conv_channels, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)

    def forward(
        self, x: torch.Tensor, segments: Segments | None = None, cp: ContextParallelRow | None = None
    ) -> torch.Tensor:
        """x [B, T, dim]; `segments` the samples of packed rows (None: one per row); `cp`: x is
        this rank's share of one row (B = 1) and `segments` the whole row's samples."""
        batch_size, seq_len, _ = x.shape
        mixed_qkv = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid()
        # In float32 at least: in bf16 exp(A_log) and the softplus lose the small decays.
        dtype = compute_dtype(x)
        g = -self.A_log.to(dtype).exp() * F.softplus(self.in_proj_a(x).to(dtype) + self.dt_bias)
        if cp is not None and not self._use_fla(x):
            out = self.context_parallel_core(mixed_qkv, g, beta, cp)
        elif cp is not None:
            out = self.core(*cp.gather(mixed_qkv, g, beta), segments)[:, cp.local_positions]
        else:
            out = self.core(mixed_qkv, g, beta, segments)
        z = self.in_proj_z(x).view(batch_size, seq_len, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(out, z).reshape(batch_size, seq_len, -1))

    # Left out of compiled graphs: the PyTorch scan is a Python loop over chunks (unrolled, and
    # recompiled for every new row shape), fla's kernels prepare their chunk indices on the host.
    @torch.compiler.disable
    def core(
        self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: Segments | None
    ) -> torch.Tensor:
        """The projected q, k, v [B, T, channels], decays and write strengths [B, T, Hv] -> the
        rule's output [B, T, Hv, Dv] (convolution, heads, normalisation and the scan)."""
        if self._use_fla(mixed_qkv):
            return self._fla_core(mixed_qkv, g, beta, segments)
        if segments is None:
            return self._torch_core(mixed_qkv, g, beta)[0]
        padded, _ = self._torch_core(segments.pad(mixed_qkv), segments.pad(g), segments.pad(beta))
        return segments.unpad(padded, mixed_qkv.shape[0])

    def _split_heads(self, mixed_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = mixed_qkv.split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        shape = mixed_qkv.shape[:-1]
        return (
            q.reshape(*shape, self.num_k_heads, self.head_k_dim),
            k.reshape(*shape, self.num_k_heads, self.head_k_dim),
            v.reshape(*shape, self.num_v_heads, self.head_v_dim),
        )

    def _torch_core(
        self,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        conv_state: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        tracked_dims: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows that are one sample each: [N, L, channels] -> (rule output [N, L, Hv, Dv], final
        states [N, Hv, Dk, Dv]).

        `conv_state`, `initial_state`: the convolution's and the rule's states entering each row.
        `tracked_dims`: values get that many zero columns after theirs, in the compute dtype (the
        rule's output and states then carry the dependence on the entering state)."""
        mixed_qkv, _ = causal_conv1d(mixed_qkv, self.conv1d.weight.squeeze(1), conv_state)
        q, k, v = self._split_heads(mixed_qkv)
        group = self.num_v_heads // self.num_k_heads
        q, k = (l2_normalize(t.to(compute_dtype(t))).repeat_interleave(group, dim=2) for t in (q, k))
        if tracked_dims:
            v = F.pad(v.to(compute_dtype(v, g)), (0, tracked_dims))
        out, final_state = chunked_gated_delta_rule(
            q, k, v, g, beta, scale=self.head_k_dim**-0.5, chunk_size=self.chunk_size, initial_state=initial_state
        )
        return out, final_state

    @torch.compiler.disable
    def context_parallel_core(
        self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cp: ContextParallelRow
    ) -> torch.Tensor:
        """`core` of this rank's share of a row [1, t, ...], the state passed between ranks
        (module docstring)."""
        pieces, chunk_len = cp.pieces, cp.chunk_len
        k_dim, v_dim = self.head_k_dim, self.head_v_dim
        dtype = compute_dtype(mixed_qkv, g)
        conv_state = cp.conv_states(mixed_qkv, self.conv1d.weight.shape[-1])
        continuing = [
            piece for piece, start in zip(cp.first_pieces(), cp.chunk_starts(), strict=True) if cp.continues(start)
        ]
        # The rule's state entering a continuing piece: [0 | I], the tracked dependence on S_in.
        rule_state = torch.zeros(
            pieces.num_samples, self.num_v_heads, k_dim, v_dim + k_dim, dtype=dtype, device=g.device
        )
        rule_state[continuing, :, :, v_dim:] = torch.eye(k_dim, dtype=dtype, device=g.device)
        out, final_state = self._torch_core(
            pieces.pad(mixed_qkv), pieces.pad(g), pieces.pad(beta),
            conv_state=conv_state, initial_state=rule_state, tracked_dims=k_dim,
        )  # fmt: skip
        # Each chunk's map S_end = B + A S_in ([B | A], its last piece's final state), chained in row order.
        last_pieces = pieces.padded_index[[chunk_len - 1, 2 * chunk_len - 1]] // pieces.max_len
        maps = gather_sequence(final_state[last_pieces].flatten(1), cp.group_name, cp.cp_size)
        maps = maps.view(2 * cp.cp_size, *final_state.shape[1:])
        state, entering = maps.new_zeros(*maps.shape[1:3], v_dim), []
        for chunk in range(2 * cp.cp_size):
            entering.append(state)
            state = maps[chunk, ..., :v_dim] + maps[chunk, ..., v_dim:] @ state
        piece_chunks = cp.local_positions[pieces.cu_seqlens[:-1]] // chunk_len
        correction = torch.einsum("nlhk,nhkv->nlhv", out[..., v_dim:], torch.stack(entering)[piece_chunks])
        return pieces.unpad((out[..., :v_dim] + correction).to(mixed_qkv.dtype), 1)

    def _fla_core(
        self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: Segments | None
    ) -> torch.Tensor:
        (fla_causal_conv1d, fla_chunk_gated_delta_rule), _ = _fla_ops()
        batch_size, seq_len, _ = mixed_qkv.shape
        cu_seqlens = None
        if segments is not None:
            # Varlen: one row of all tokens, the kernels restart at each cu_seqlens entry.
            mixed_qkv, g, beta = (t.reshape(1, batch_size * seq_len, *t.shape[2:]) for t in (mixed_qkv, g, beta))
            # On the kernels' device: Triton cannot read a host tensor.
            cu_seqlens = segments.cu_seqlens.to(mixed_qkv.device)
        mixed_qkv, _ = fla_causal_conv1d(
            mixed_qkv, self.conv1d.weight.squeeze(1), activation="silu", cu_seqlens=cu_seqlens
        )
        q, k, v = self._split_heads(mixed_qkv)
        out, _ = fla_chunk_gated_delta_rule(
            q, k, v, g, beta, scale=self.head_k_dim**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens
        )
        return out.reshape(batch_size, seq_len, self.num_v_heads, self.head_v_dim)

    def _use_fla(self, x: torch.Tensor) -> bool:
        if self.impl == "torch":
            return False
        if self.impl == "fla":
            if not x.is_cuda:
                raise ValueError("gated delta net impl 'fla' needs CUDA tensors")
            if (reason := fla_unusable_reason(_device_index(x))) is not None:
                raise ValueError(f"gated delta net impl 'fla' is unusable here: {reason}")
            return True
        return x.is_cuda and fla_unusable_reason(_device_index(x)) is None

    def extra_repr(self) -> str:
        return f"heads k/v {self.num_k_heads}/{self.num_v_heads}, dims k/v {self.head_k_dim}/{self.head_v_dim}"


@dataclass(frozen=True)
class LayerMasks:
    """What each kind of layer gets in place of the mask: the attention layers the attention
    mask, the DeltaNet layers the samples of packed rows (None: one per row) and, under context
    parallel, this rank's share of the row."""

    attention: AttentionMask
    segments: Segments | None
    cp: ContextParallelRow | None = None


def layer_masks(
    attention_mask: AttentionMask,
    position_ids: torch.Tensor | None,
    *,
    device: torch.device,
    row_layout: RowLayout | None,
    cp_group: dist.ProcessGroup | None,
) -> LayerMasks:
    """The masks of a hybrid model's layers: `attention_mask` (the model's, whose building has
    checked the cp group against the layout) for attention, and the samples and context-parallel
    share of the row for the recurrent layers."""
    if row_layout is None:
        return LayerMasks(attention_mask, segments_of(position_ids))
    # The whole row's samples (its pad tokens, after them, are samples of their own).
    docs = row_layout.document_ids[None].to(device)
    if row_layout.cp_size == 1:
        return LayerMasks(attention_mask, None if row_layout.single_document else Segments.of(docs))
    cp = ContextParallelRow(cp_group.group_name, row_layout.cp_size, row_layout.global_positions.to(device), docs[0])
    return LayerMasks(attention_mask, None if bool((docs == 0).all()) else Segments.of(docs), cp)
