"""Linear layers whose matrix products run in float8 e4m3 with block scales, DeepSeek-V3's
recipe (`model.fp8`): `fp8_linear` for a dense layer, `fp8_grouped_linear` for a layer of
experts. The weight stays what it is (the master copy and the optimizer state keep their
precision); only the operands of each product are quantized, afresh on every call, with
primerl_common.weights.fp8, and each product is summed in float32 and rounded once to its
output dtype.

What is quantized how, for y = x @ W^T with x [M tokens, I in], W [O out, I in], dy = dL/dy:

| product                    | left operand               | right operand            | out     |
| -------------------------- | -------------------------- | ------------------------ | ------- |
| forward   y  = x @ W^T     | x: 1x128 tiles along I     | W: 128x128 blocks        | x.dtype |
| input     dx = dy @ W      | dy: 1x128 tiles along O    | W^T: 128x128 blocks      | x.dtype |
| weight    dW = dy^T @ x    | dy^T: 1x128 tiles along M  | x^T: 1x128 tiles along M | W.dtype |

A 1x128 tile is one row and 128 consecutive entries of the contraction dimension, with one
float32 scale; a 128x128 block has one scale. Every scale is the tile's amax / 448. W^T's
blocks are W's blocks transposed (the same scales), so the input gradient uses W's
quantization, transposed. The weight gradient contracts over tokens, so dy and x are
quantized again along the token dimension, per 128 tokens, from their unquantized values
(DeepSeek-V3's 128x1 tiles of the backward). The forward saves x and W as F.linear does
(nothing in FP8: W, an FSDP-gathered parameter, is quantized again in the backward rather
than held quantized between the passes).

Two backends compute the same products:

- "scaled_mm": torch.nn.functional.scaled_mm on cuBLAS's block-scaled FP8 kernels, which
  torch runs on Hopper (compute capability 9.x) only. Operands: the left one row-major,
  the right one column-major (cuBLAS's "TN", the only layout Hopper takes); the left
  scales ScalingType.BlockWise1x128, [rows, ceil(K/128)] column-major; the right ones
  BlockWise128x128 as [round_up(ceil(K/128), 4), ceil(cols/128)] with strides (1, that
  padded count), or BlockWise1x128 as [cols, ceil(K/128)] column-major (torch 2.11's
  checks; its older torch._scaled_mm takes the 128x128 scales unpadded and, on an H200,
  computed wrong products when ceil(K/128) % 4 != 0, so this module uses F.scaled_mm only).
  The token dimension is padded with zero rows to a multiple of 16 (cuBLAS refused 77 rows
  on an H200); the layer's dimensions must be multiples of 16 (torch's check). Partial
  128-blocks of the feature dimensions are fine. On an H200 its results are within about
  1e-4 (float32 output) of the emulated ones: cuBLAS sums in another order.
- "deep_gemm": "scaled_mm", except that the experts' forward and input-gradient products run on
  DeepGEMM's kernels (kernels.deep_gemm_grouped; optional, built from source), where they take
  the layer's shape: the same products; the kernel alone about twice as fast as bf16 on an H200.
- "emulated": both quantized operands dequantized to float32 and multiplied in float32: the
  value the FP8 product computes (up to the summation order), on any device.
  The CPU tests use it; the GPU tests check "scaled_mm" against it.

`fp8_grouped_linear` computes the same products per expert. Its "scaled_mm" backend runs
kernels.fp8_grouped's fused Triton kernels (no host sync, no loop over the experts on the
host); its "emulated" one loops over the experts (a host sync for the expert sizes in the
forward and one in the backward) and is the fused kernels' reference: the weight gradient's
1x128 tiles along the tokens restart at each expert's first token, an expert's last tile
partial (zero-padded), in both. Both functions are custom ops, whole to torch.compile.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

from primerl_common.weights.fp8 import (
    dequantize_blockwise,
    dequantize_rows_1x128,
    quantize_blockwise,
    quantize_rows_1x128,
)
from primerl_trainer.kernels.deep_gemm_grouped import deep_gemm_problem
from primerl_trainer.kernels.fp8_grouped import grouped_backward, grouped_forward
from primerl_trainer.kernels.grouped_weight_grad import adds_into_grad

__all__ = [
    "FP8_BACKENDS",
    "FP8_WEIGHT_GRADS",
    "Fp8Backend",
    "Fp8WeightGrad",
    "check_fp8_device",
    "fp8_grouped_linear",
    "fp8_linear",
]

Fp8Backend = Literal["scaled_mm", "deep_gemm", "emulated"]
FP8_BACKENDS: tuple[Fp8Backend, ...] = ("scaled_mm", "deep_gemm", "emulated")
# How the weight gradient is computed (model.fp8_weight_grad): "fp8" as the module docstring's
# table says; "model_dtype" from the unquantized dy and x, in their dtype (torchao's
# "rowwise_with_gw_hp" recipe keeps it so too), where the K-grouped FP8 product is slower than
# the weights' dtype's: experts that see few tokens contract over a short dimension.
Fp8WeightGrad = Literal["fp8", "model_dtype"]
FP8_WEIGHT_GRADS: tuple[Fp8WeightGrad, ...] = ("fp8", "model_dtype")
# The backends that run the real FP8 products on a Hopper GPU.
_GPU_BACKENDS = ("scaled_mm", "deep_gemm")

# torch's FP8 products take dimensions in multiples of 16 (cuBLAS refused 77 rows).
_ALIGN = 16


def check_fp8_device(device: torch.device | str, backend: Fp8Backend = "scaled_mm") -> None:
    """Raises ValueError (naming `model.fp8` or `model.fp8_backend`) unless `backend` runs on
    `device` ("emulated" runs anywhere)."""
    if backend == "emulated":
        return
    problem = _fp8_device_problem(torch.device(device))
    if problem is None and backend == "deep_gemm":
        problem = deep_gemm_problem()
    if problem is not None:
        raise ValueError(problem)


@functools.cache  # asked on every product: the answer is the device's
def _fp8_device_problem(device: torch.device) -> str | None:
    if device.type != "cuda":
        return (
            f"model.fp8 needs a CUDA GPU with FP8 tensor cores (Hopper, compute capability 9.x); "
            f"the tensors are on {device}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        return f"model.fp8 needs FP8 tensor cores (compute capability 8.9+): {name} has {major}.{minor}"
    if major != 9:
        return (
            f"model.fp8's block-scaled products (1x128 activations, 128x128 weights) run through cuBLAS "
            f"on Hopper (compute capability 9.x) only in torch: {name} has {major}.{minor}"
        )
    if not hasattr(F, "scaled_mm"):
        return f"model.fp8 needs torch.nn.functional.scaled_mm, which torch {torch.__version__} lacks"
    return None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: Fp8Backend = "scaled_mm",
    weight_grad: Fp8WeightGrad = "fp8",
) -> torch.Tensor:
    """F.linear(x, weight, bias) with the products in block-scaled FP8 (module docstring);
    x [..., in], weight [out, in], bias [out] (added in x's dtype)."""
    _check_backend(backend, weight_grad)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not fit a weight of shape {tuple(weight.shape)}")
    if backend in _GPU_BACKENDS:
        _check_layer_shape(weight.shape)
    y = _fp8_linear_op(x.reshape(-1, x.shape[-1]), weight, backend, weight_grad)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def fp8_grouped_linear(
    x_NI: torch.Tensor,
    w_EOI: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    backend: Fp8Backend = "scaled_mm",
    weight_grad: Fp8WeightGrad = "fp8",
) -> torch.Tensor:
    """Row block e of x_NI times w_EOI[e]^T -> [N, O], each product as fp8_linear's: x_NI
    sorted by expert, offsets_E [E] the end of each expert's rows (GroupedExperts' layout).
    On a GPU backend, where kernels.grouped_weight_grad.adds_into_grad allows, the backward adds
    the weight's gradient into w.grad inside its product, as the bf16 experts do."""
    _check_backend(backend, weight_grad)
    if w_EOI.dim() != 3 or x_NI.dim() != 2 or x_NI.shape[1] != w_EOI.shape[2]:
        raise ValueError(
            f"fp8_grouped_linear: x {tuple(x_NI.shape)} does not fit expert weights of shape {tuple(w_EOI.shape)}"
        )
    if offsets_E.shape != (w_EOI.shape[0],):
        raise ValueError(f"fp8_grouped_linear: {w_EOI.shape[0]} experts but offsets of shape {tuple(offsets_E.shape)}")
    if backend in _GPU_BACKENDS:
        _check_layer_shape(w_EOI.shape[1:])
    into_grad = backend in _GPU_BACKENDS and adds_into_grad(w_EOI)
    return _fp8_grouped_linear_op(x_NI, w_EOI, offsets_E, backend, weight_grad, into_grad)


def _check_backend(backend: str, weight_grad: str) -> None:
    if backend not in FP8_BACKENDS:
        raise ValueError(f"FP8 backend must be one of {FP8_BACKENDS}, got {backend!r}")
    if weight_grad not in FP8_WEIGHT_GRADS:
        raise ValueError(f"FP8 weight gradient must be one of {FP8_WEIGHT_GRADS}, got {weight_grad!r}")


def _check_layer_shape(weight_shape: torch.Size) -> None:
    out_features, in_features = weight_shape
    if out_features % _ALIGN or in_features % _ALIGN:
        raise ValueError(
            f"model.fp8: cuBLAS's FP8 products need a linear layer's dimensions in multiples of {_ALIGN}; "
            f"this layer's weight is {out_features}x{in_features} (out x in)"
        )


# The products are custom ops with their own backward (not autograd.Functions), so that
# torch.compile keeps them whole (a compiled block with fullgraph=True): it would otherwise trace
# into the Triton quantizers' launch code and the experts' loop over host-side sizes.


@torch.library.custom_op("primerl::fp8_linear", mutates_args=())
def _fp8_linear_op(x_MI: torch.Tensor, w_OI: torch.Tensor, backend: str, weight_grad: str) -> torch.Tensor:
    _check_device(x_MI, backend)
    return _forward(x_MI, w_OI, backend)


@_fp8_linear_op.register_fake
def _(x_MI: torch.Tensor, w_OI: torch.Tensor, backend: str, weight_grad: str) -> torch.Tensor:
    return x_MI.new_empty(x_MI.shape[0], w_OI.shape[0])


@torch.library.custom_op("primerl::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward_op(
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    w_OI: torch.Tensor,
    backend: str,
    weight_grad: str,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw); an unneeded one is empty (a custom op returns tensors only)."""
    dx, dw = _backward(dy_MO, x_MI, w_OI, backend, weight_grad, need_x, need_w)
    return _or_empty(dx, x_MI), _or_empty(dw, w_OI)


@_fp8_linear_backward_op.register_fake
def _(
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    w_OI: torch.Tensor,
    backend: str,
    weight_grad: str,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_grads(x_MI, w_OI, need_x, need_w)


def _fp8_linear_setup_context(ctx, inputs, output) -> None:
    x_MI, w_OI, backend, weight_grad = inputs
    ctx.save_for_backward(x_MI, w_OI)
    ctx.backend, ctx.weight_grad = backend, weight_grad


def _fp8_linear_backward(ctx, dy_MO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_MI, w_OI = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    dx, dw = _fp8_linear_backward_op(dy_MO, x_MI, w_OI, ctx.backend, ctx.weight_grad, need_x, need_w)
    return dx if need_x else None, dw if need_w else None, None, None


_fp8_linear_op.register_autograd(_fp8_linear_backward, setup_context=_fp8_linear_setup_context)


@torch.library.custom_op("primerl::fp8_grouped_linear", mutates_args=())
def _fp8_grouped_linear_op(
    x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, backend: str, weight_grad: str, into_grad: bool
) -> torch.Tensor:
    _check_device(x_NI, backend)
    if backend in _GPU_BACKENDS:
        return grouped_forward(x_NI, w_EOI, offsets_E, deep_gemm=backend == "deep_gemm")
    y_NO = x_NI.new_zeros(x_NI.shape[0], w_EOI.shape[1])
    for expert, rows in _expert_rows(offsets_E):
        y_NO[rows] = _forward(x_NI[rows], w_EOI[expert], backend)
    return y_NO


@_fp8_grouped_linear_op.register_fake
def _(
    x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, backend: str, weight_grad: str, into_grad: bool
) -> torch.Tensor:
    return x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("primerl::fp8_grouped_linear_backward", mutates_args=())
def _fp8_grouped_linear_backward_op(
    dy_NO: torch.Tensor,
    x_NI: torch.Tensor,
    w_EOI: torch.Tensor,
    offsets_E: torch.Tensor,
    backend: str,
    weight_grad: str,
    into_grad: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw); an unneeded one is empty, and so is dw where `into_grad` added it into w.grad.
    An expert without rows gets a zero weight gradient."""
    if backend in _GPU_BACKENDS:
        dx, dw = grouped_backward(
            dy_NO,
            x_NI,
            w_EOI,
            offsets_E,
            need_x,
            need_w,
            deep_gemm=backend == "deep_gemm",
            weight_grad=weight_grad,
            into_grad=into_grad,
        )
        return _or_empty(dx, x_NI), _or_empty(dw, w_EOI)
    dx_NI = torch.zeros_like(x_NI) if need_x else x_NI.new_empty(0)
    dw_EOI = torch.zeros_like(w_EOI) if need_w else w_EOI.new_empty(0)
    for expert, rows in _expert_rows(offsets_E):
        dx, dw = _backward(dy_NO[rows], x_NI[rows], w_EOI[expert], backend, weight_grad, need_x, need_w)
        if need_x:
            dx_NI[rows] = dx
        if need_w:
            dw_EOI[expert] = dw
    return dx_NI, dw_EOI


@_fp8_grouped_linear_backward_op.register_fake
def _(
    dy_NO: torch.Tensor,
    x_NI: torch.Tensor,
    w_EOI: torch.Tensor,
    offsets_E: torch.Tensor,
    backend: str,
    weight_grad: str,
    into_grad: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_grads(x_NI, w_EOI, need_x, need_w and not into_grad)


def _fp8_grouped_linear_setup_context(ctx, inputs, output) -> None:
    x_NI, w_EOI, offsets_E, backend, weight_grad, into_grad = inputs
    ctx.save_for_backward(x_NI, w_EOI, offsets_E)
    ctx.backend, ctx.weight_grad, ctx.into_grad = backend, weight_grad, into_grad


def _fp8_grouped_linear_backward(ctx, dy_NO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_NI, w_EOI, offsets_E = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    dx, dw = _fp8_grouped_linear_backward_op(
        dy_NO, x_NI, w_EOI, offsets_E, ctx.backend, ctx.weight_grad, ctx.into_grad, need_x, need_w
    )
    dw = dw if need_w and not ctx.into_grad else None  # into_grad: already in w.grad
    return dx if need_x else None, dw, None, None, None, None


_fp8_grouped_linear_op.register_autograd(_fp8_grouped_linear_backward, setup_context=_fp8_grouped_linear_setup_context)


def _check_device(x: torch.Tensor, backend: str) -> None:
    # Inside the ops (run, not traced, under torch.compile); the answer is cached per device.
    check_fp8_device(x.device, backend)


def _expert_rows(offsets_E: torch.Tensor) -> list[tuple[int, slice]]:
    """(expert, its rows) of the experts that have rows; reads the offsets back to the host
    (a sync per call, as GroupedExperts' reference loop has)."""
    ends = offsets_E.tolist()
    return [(e, slice(s, t)) for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends, strict=True)) if t > s]


def _or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if grad is None else grad


def _fake_grads(x: torch.Tensor, w: torch.Tensor, need_x: bool, need_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x) if need_x else x.new_empty(0)), (torch.empty_like(w) if need_w else w.new_empty(0))


def _forward(x_MI: torch.Tensor, w_OI: torch.Tensor, backend: Fp8Backend) -> torch.Tensor:
    rows = x_MI.shape[0]
    x_MI = _pad_rows(x_MI, backend)
    xq, xs = quantize_rows_1x128(x_MI)
    wq, ws = quantize_blockwise(w_OI)
    return _product(xq, xs, wq, ws, right_blocked=True, out_dtype=x_MI.dtype, backend=backend)[:rows]


def _backward(
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    w_OI: torch.Tensor,
    backend: Fp8Backend,
    weight_grad: str,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    rows = dy_MO.shape[0]
    dw = (dy_MO.t() @ x_MI).to(w_OI.dtype) if need_w and weight_grad == "model_dtype" else None
    need_w = need_w and dw is None
    dy_MO, x_MI = _pad_rows(dy_MO, backend), _pad_rows(x_MI, backend)
    dx = None
    if need_x:
        dyq, dys = quantize_rows_1x128(dy_MO)
        # W^T's 128x128 blocks are W's transposed (the same values and scales), quantized
        # straight from the transposed view into the row-major layout the product takes.
        wtq, wts = quantize_blockwise(w_OI.t())
        dx = _product(dyq, dys, wtq, wts, right_blocked=True, out_dtype=x_MI.dtype, backend=backend)[:rows]
    if need_w:
        dytq, dyts = quantize_rows_1x128(dy_MO.t())
        xtq, xts = quantize_rows_1x128(x_MI.t())
        dw = _product(dytq, dyts, xtq, xts, right_blocked=False, out_dtype=w_OI.dtype, backend=backend)
    return dx, dw


def _pad_rows(t: torch.Tensor, backend: Fp8Backend) -> torch.Tensor:
    """Zero rows up to a multiple of 16 for cuBLAS (a copy, only where the count is not one)."""
    missing = -t.shape[0] % _ALIGN
    if backend == "emulated" or missing == 0:
        return t
    return F.pad(t, (0, 0, 0, missing))


def _product(
    aq: torch.Tensor,
    as_: torch.Tensor,
    bq: torch.Tensor,
    bs: torch.Tensor,
    *,
    right_blocked: bool,
    out_dtype: torch.dtype,
    backend: Fp8Backend,
) -> torch.Tensor:
    """a @ b^T for a [M, K] in 1x128 tiles along K and b [N, K] in 128x128 blocks
    (right_blocked) or in 1x128 tiles along K."""
    if backend == "emulated":
        a = dequantize_rows_1x128(aq, as_)
        b = dequantize_blockwise(bq, bs) if right_blocked else dequantize_rows_1x128(bq, bs)
        return (a @ b.t()).to(out_dtype)
    recipe = F.ScalingType
    if right_blocked:
        b_scale, b_recipe = _padded_block_scales(bs).t(), recipe.BlockWise128x128
    else:
        b_scale, b_recipe = _column_major(bs), recipe.BlockWise1x128
    return F.scaled_mm(
        aq,
        bq.t(),
        _column_major(as_),
        recipe.BlockWise1x128,
        b_scale,
        b_recipe,
        output_dtype=out_dtype,
    )


def _column_major(scales: torch.Tensor) -> torch.Tensor:
    if scales.stride(0) == 1 and (scales.stride(1) == scales.shape[0] or scales.shape[1] == 1):
        return scales
    return scales.t().contiguous().t()


def _padded_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """[blocks, k_blocks] -> [blocks, round_up(k_blocks, 4)] (zeros added), contiguous."""
    missing = -scales.shape[1] % 4
    return F.pad(scales, (0, missing)) if missing else scales.contiguous()
