"""The M-grouped FP8 products of a layer of experts (forward y = x @ W^T, input gradient
dx = dy @ W) on DeepGEMM's Hopper kernels: model.fp8_backend "deep_gemm".

DeepGEMM (github.com/deepseek-ai/DeepGEMM, not on PyPI: the package of that name there is a
placeholder) is optional: built from source on a machine with the CUDA toolkit (the trainer's
README says how), it compiles its kernels at first use. Its SM90 product takes the operands
exactly as kernels.fp8_grouped quantizes them (1x128 activation tiles, 128x128 weight blocks,
float32 scales), and on an H200 it gave the same products bit for bit as this project's Triton
kernel; the kernel alone ran at about twice the speed of bf16 torch._grouped_mm
(bench/results/fp8_kernels-deep_gemm-2026-11-30.txt, which also says what the layout copies cost).

Its grouped layout is "contiguous": every expert's rows start at a multiple of ALIGN rows, and a
per-row index names each row's expert (-1: padding, skipped a whole block at a time). The rows,
sorted by expert as GroupedExperts holds them, are copied into such a buffer sized for the
worst case (N + E * (ALIGN - 1) rows), so the host never reads the expert sizes; the product
fills the padded rows and the real ones are gathered back. Rows past offsets_E[-1] (no expert)
go past the last expert's segment, where the index is -1, and come back zero (read from a zero
row: no masking pass over the output).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["ALIGN", "PaddedRows", "deep_gemm_problem", "fits", "m_grouped", "padded_rows"]

ALIGN = 128  # DeepGEMM's row alignment of an expert's segment on SM90 (its M block)


def deep_gemm_problem() -> str | None:
    """Why the "deep_gemm" backend cannot run here, or None."""
    try:
        _deep_gemm()
    except (ImportError, OSError, RuntimeError) as error:  # absent, or a build that does not load here
        return (
            f"model.fp8_backend 'deep_gemm' needs DeepGEMM (github.com/deepseek-ai/DeepGEMM, built from source: "
            f"services/trainer/README.md), which does not import here: {error}"
        )
    return None


def fits(depth: int, num_out: int, out_dtype: torch.dtype) -> bool:
    """Whether DeepGEMM takes an M-grouped product of this shape: whole 128-blocks along the
    contraction and the output (the kernels' TMA tiles) and a bfloat16 output; kernels.fp8_grouped's
    Triton product computes the others (the same numbers)."""
    return depth % ALIGN == 0 and num_out % ALIGN == 0 and out_dtype == torch.bfloat16


@dataclass(frozen=True)
class PaddedRows:
    """Where each of N rows lies in the padded buffer (dest_N, all distinct), each padded row's
    expert or -1 (expert_M), and where each row's product is read back from (source_N: dest_N,
    or for a row of no expert the row past the padded ones, which m_grouped keeps zero)."""

    dest_N: torch.Tensor
    expert_M: torch.Tensor
    source_N: torch.Tensor


# A layer's four products (w13 and w2, forward and input gradient) share one offsets tensor:
# its layout is computed once (a dozen small kernels, whose launches a small layer waits on).
# An entry holds its offsets tensor, so no other live tensor has its storage, and is used only
# at the same version counter (unchanged values).
_LAYOUTS: collections.OrderedDict[tuple, tuple[torch.Tensor, PaddedRows]] = collections.OrderedDict()
_LAYOUTS_KEPT = 8


def padded_rows(offsets_E: torch.Tensor, num_rows: int) -> PaddedRows:
    """The contiguous layout of rows sorted by expert (offsets_E: each expert's end), on the
    device, without a host sync; the last few asked for are kept."""
    if offsets_E.is_inference():  # no version counter to tell a change
        return _padded_rows(offsets_E, num_rows)
    key = (offsets_E.data_ptr(), offsets_E.device, offsets_E.dtype, offsets_E.shape, offsets_E.stride(), num_rows)
    key += (offsets_E._version,)
    if key in _LAYOUTS:
        _LAYOUTS.move_to_end(key)
        return _LAYOUTS[key][1]
    layout = _padded_rows(offsets_E, num_rows)
    _LAYOUTS[key] = (offsets_E, layout)
    while len(_LAYOUTS) > _LAYOUTS_KEPT:
        _LAYOUTS.popitem(last=False)
    return layout


def _padded_rows(offsets_E: torch.Tensor, num_rows: int) -> PaddedRows:
    num_experts = offsets_E.shape[0]
    ends_E = offsets_E.to(torch.int64)
    starts_E = F.pad(ends_E[:-1], (1, 0))
    aligned_E = (ends_E - starts_E + ALIGN - 1) // ALIGN * ALIGN
    padded_starts_E = aligned_E.cumsum(0) - aligned_E
    rows_N = torch.arange(num_rows, device=offsets_E.device)
    expert_N = torch.searchsorted(ends_E, rows_N, right=True)
    valid_N = expert_N < num_experts
    expert_c = expert_N.clamp(max=num_experts - 1)
    # Rows past the last expert's end follow its (aligned) segment, in blocks of their own.
    beyond_N = aligned_E.sum() + rows_N - ends_E[-1]
    dest_N = torch.where(valid_N, padded_starts_E[expert_c] + rows_N - starts_E[expert_c], beyond_N)
    total = -(-(num_rows + num_experts * (ALIGN - 1)) // ALIGN) * ALIGN
    expert_M = torch.full((total,), -1, dtype=torch.int32, device=offsets_E.device)
    expert_M.index_copy_(0, dest_N, torch.where(valid_N, expert_N, -1).to(torch.int32))
    return PaddedRows(dest_N, expert_M, torch.where(valid_N, dest_N, total))


def m_grouped(
    aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor, rows: PaddedRows
) -> torch.Tensor:
    """out[r] = a[r] @ b[expert of r]^T in bfloat16, as kernels.fp8_grouped's M-grouped product:
    a [N, K] float8 with scales [N, K/128]; b [E, O, K] float8 (K contiguous) with its 128x128
    blocks' scales [E, O/128, K/128]."""
    total = rows.expert_M.shape[0]
    # The rows move as 8-byte words (fits() keeps them whole multiples of 128 bytes): the index
    # kernels then copy 8 times fewer elements, and index_copy_ has no float8 kernel anyway.
    a_padded = aq.new_empty(total, aq.shape[1]).view(torch.int64)
    a_padded = a_padded.index_copy_(0, rows.dest_N, aq.view(torch.int64)).view(aq.dtype)
    scales_padded = as_.new_empty(total, as_.shape[1]).index_copy_(0, rows.dest_N, as_)
    # One row more than the product fills: zero, read back for the rows of no expert.
    out = torch.empty(total + 1, bq.shape[1], dtype=torch.bfloat16, device=aq.device)
    out[total].zero_()
    _deep_gemm().m_grouped_fp8_gemm_nt_contiguous(
        (a_padded, scales_padded), (bq, bs.contiguous()), out[:total], rows.expert_M, disable_ue8m0_cast=True
    )
    return out.view(torch.int64).index_select(0, rows.source_N).view(torch.bfloat16)


@functools.cache  # imported where first asked for (it initializes CUDA state on import)
def _deep_gemm() -> ModuleType:
    import deep_gemm

    if getattr(deep_gemm, "get_mk_alignment_for_contiguous_layout", lambda: ALIGN)() != ALIGN:
        deep_gemm.set_mk_alignment_for_contiguous_layout(ALIGN)
    return deep_gemm
