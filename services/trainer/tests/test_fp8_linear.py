"""Block-scaled FP8 on the CPU: the 1x128 activation quantizer (primerl_common.weights.fp8) and
kernels.fp8_linear's "emulated" backend, the exact value of what the GPU's FP8 products compute
(gpu_fp8_linear.py checks the "scaled_mm" backend against it on a Hopper GPU)."""

import math
import sys

import pytest
import torch

from primerl_common.weights.fp8 import (
    BLOCK,
    FP8_MAX,
    dequantize_blockwise,
    dequantize_rows_1x128,
    quantize_blockwise,
    quantize_rows_1x128,
)
from primerl_trainer.kernels import deep_gemm_grouped
from primerl_trainer.kernels import fp8_linear as fp8_linear_module
from primerl_trainer.kernels.fp8_linear import check_fp8_device, fp8_grouped_linear, fp8_linear


def tile_scales(scales: torch.Tensor, cols: int) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK, 1)[:, :cols]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 129), (77, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_round_trip_within_e4m3_bound_with_one_scale_per_row_and_128_columns(shape, dtype):
    torch.manual_seed(sum(shape))
    x = (torch.randn(shape) * torch.rand(shape[0], 1) * 5).to(dtype)
    quantized, scales = quantize_rows_1x128(x)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == x.shape
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (shape[0], math.ceil(shape[1] / BLOCK))

    restored = dequantize_rows_1x128(quantized, scales)
    original = x.float()
    # e4m3 keeps 3 mantissa bits: a value rounds within 2^-4 of itself relative, and values
    # far below the tile's amax hit the subnormal floor (2^-9 * scale, half of it rounding).
    bound = original.abs() * 2**-4 + tile_scales(scales, shape[1]) * 2**-10
    assert torch.all((restored - original).abs() <= bound + 1e-12)

    # Each tile's amax maps to 448 and its scale is that amax / 448.
    tiles = torch.zeros(shape[0], scales.shape[1] * BLOCK)
    tiles[:, : shape[1]] = original
    amax = tiles.view(shape[0], -1, BLOCK).abs().amax(dim=2)
    assert torch.equal(scales, amax / FP8_MAX)
    padded_q = torch.zeros_like(tiles)
    padded_q[:, : shape[1]] = quantized.float()
    assert torch.all(padded_q.view(shape[0], -1, BLOCK).abs().amax(dim=2)[amax > 0] == FP8_MAX)


def test_zero_tiles_have_zero_scales_and_values_and_partial_tiles_count_as_zero_padded():
    x = torch.zeros(3, 260)
    x[0, 5] = -4.48
    x[2, 259] = 0.896  # alone in a partial last tile
    quantized, scales = quantize_rows_1x128(x)
    expected = torch.zeros(3, 3)
    expected[0, 0] = 4.48 / FP8_MAX
    expected[2, 2] = 0.896 / FP8_MAX
    assert torch.allclose(scales, expected, rtol=0, atol=1e-9)
    assert torch.count_nonzero(quantized.float()) == 2
    assert quantized[0, 5].float() == -FP8_MAX and quantized[2, 259].float() == FP8_MAX
    assert torch.equal(dequantize_rows_1x128(quantized, scales)[1], torch.zeros(260))


def test_transposed_input_quantizes_along_the_other_dimension():
    torch.manual_seed(0)
    x = torch.randn(200, 96)
    quantized, scales = quantize_rows_1x128(x.t())
    expected_q, expected_s = quantize_rows_1x128(x.t().contiguous())
    assert torch.equal(quantized.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scales, expected_s) and tuple(scales.shape) == (96, 2)


def test_bad_rows_inputs_are_refused():
    with pytest.raises(ValueError, match="2-D activations"):
        quantize_rows_1x128(torch.zeros(4))
    with pytest.raises(ValueError, match="cannot quantize"):
        quantize_rows_1x128(torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_rows_1x128(torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.zeros(4, 1))


def dequantized_rows(t: torch.Tensor) -> torch.Tensor:
    return dequantize_rows_1x128(*quantize_rows_1x128(t))


def reference_products(x, weight, grad_y):
    """The three products on dequantized operands, quantized as the module docstring says."""
    w = dequantize_blockwise(*quantize_blockwise(weight))
    y = dequantized_rows(x) @ w.t()
    grad_x = dequantized_rows(grad_y) @ w
    grad_w = dequantized_rows(grad_y.t()) @ dequantized_rows(x.t()).t()
    return y, grad_x, grad_w


def run_fp8_linear(x, weight, bias, grad_y):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    bias = None if bias is None else bias.clone().requires_grad_()
    y = fp8_linear(x, weight, bias, backend="emulated")
    y.backward(grad_y)
    return y, x.grad, weight.grad, None if bias is None else bias.grad


# (tokens, in, out): whole blocks, partial blocks everywhere.
SHAPES = [(256, 384, 256), (77, 200, 130)]


@pytest.mark.parametrize("tokens,in_features,out_features", SHAPES)
def test_emulated_forward_and_backward_are_the_products_of_the_dequantized_operands(tokens, in_features, out_features):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    bias = torch.randn(out_features)
    grad_y = torch.randn(tokens, out_features)
    y, grad_x, grad_w, grad_b = run_fp8_linear(x, weight, bias, grad_y)
    ref_y, ref_grad_x, ref_grad_w = reference_products(x, weight, grad_y)
    for actual, expected in [(y, ref_y + bias), (grad_x, ref_grad_x), (grad_w, ref_grad_w)]:
        assert relative_error(actual, expected) < 1e-5
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_b, grad_y.sum(0))


@pytest.mark.parametrize("tokens,in_features,out_features", SHAPES)
def test_emulated_products_are_near_the_unquantized_ones(tokens, in_features, out_features):
    torch.manual_seed(tokens + 1)
    x = torch.randn(tokens, in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    grad_y = torch.randn(tokens, out_features)
    y, grad_x, grad_w, _ = run_fp8_linear(x, weight, None, grad_y)
    assert relative_error(y, x @ weight.t()) < 5e-2
    assert relative_error(grad_x, grad_y @ weight) < 5e-2
    assert relative_error(grad_w, grad_y.t() @ x) < 5e-2
    # Not trivially so: the quantization changed something.
    assert relative_error(y, x @ weight.t()) > 1e-4


def test_leading_dimensions_and_bfloat16_keep_their_shapes_and_dtypes():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(128, 256, requires_grad=True)  # a float32 master weight
    y = fp8_linear(x, weight, backend="emulated")
    assert y.shape == (2, 3, 128) and y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_grouped_equals_fp8_linear_per_expert_with_an_empty_expert():
    torch.manual_seed(0)
    sizes = [40, 0, 130, 7]
    x = torch.randn(sum(sizes), 256, requires_grad=True)
    weights = (torch.randn(len(sizes), 384, 256) * 0.05).requires_grad_()
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    grad_y = torch.randn(sum(sizes), 384)
    fp8_grouped_linear(x, weights, offsets, backend="emulated").backward(grad_y)

    outs, grad_xs, grad_ws = [], [], []
    for expert, (x_e, grad_y_e) in enumerate(zip(x.detach().split(sizes), grad_y.split(sizes), strict=True)):
        y_e, grad_x_e, grad_w_e, _ = run_fp8_linear(x_e, weights[expert].detach(), None, grad_y_e)
        outs.append(y_e)
        grad_xs.append(grad_x_e)
        grad_ws.append(grad_w_e if grad_w_e is not None else torch.zeros(384, 256))
    grouped_y = fp8_grouped_linear(x.detach(), weights.detach(), offsets, backend="emulated")
    torch.testing.assert_close(grouped_y, torch.cat(outs), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, torch.cat(grad_xs), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights.grad, torch.stack(grad_ws), rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(weights.grad[1]) == 0


def test_model_dtype_weight_grad_is_the_unquantized_product_and_leaves_the_rest_in_fp8():
    # model.fp8_weight_grad "model_dtype": dW = dy^T x from the unquantized operands; y and dx
    # are the FP8 ones, unchanged.
    torch.manual_seed(0)
    sizes = [40, 0, 130]
    x = torch.randn(sum(sizes), 256)
    weights = torch.randn(len(sizes), 384, 256) * 0.05
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    grad_y = torch.randn(sum(sizes), 384)
    grads = {}
    for weight_grad in ("fp8", "model_dtype"):
        x_g, w_dense, w_grouped = x.clone().requires_grad_(), weights[0].clone().requires_grad_(), weights.clone()
        w_grouped.requires_grad_()
        fp8_linear(x_g, w_dense, backend="emulated", weight_grad=weight_grad).backward(grad_y)
        fp8_grouped_linear(x, w_grouped, offsets, backend="emulated", weight_grad=weight_grad).backward(grad_y)
        grads[weight_grad] = (x_g.grad, w_dense.grad, w_grouped.grad)
    torch.testing.assert_close(grads["model_dtype"][0], grads["fp8"][0], rtol=0, atol=0)
    torch.testing.assert_close(grads["model_dtype"][1], grad_y.t() @ x)
    exact = [g.t() @ x_e for g, x_e in zip(grad_y.split(sizes), x.split(sizes), strict=True)]
    torch.testing.assert_close(grads["model_dtype"][2], torch.stack(exact))
    # The FP8 weight gradients differ from the exact ones by the quantization error, no more.
    error = (grads["fp8"][1] - grad_y.t() @ x).norm() / (grad_y.t() @ x).norm()
    assert 0 < error < 0.1
    with pytest.raises(ValueError, match=r"weight gradient must be one of"):
        fp8_linear(x, weights[0], backend="emulated", weight_grad="bf16")


def test_scaled_mm_on_the_cpu_is_refused_naming_model_fp8():
    x, weight = torch.randn(16, 128), torch.randn(128, 128)
    with pytest.raises(ValueError, match=r"model\.fp8.*CUDA"):
        fp8_linear(x, weight)
    with pytest.raises(ValueError, match=r"model\.fp8.*CUDA"):
        fp8_grouped_linear(x, weight[None], torch.tensor([16], dtype=torch.int32), backend="scaled_mm")


def test_deep_gemm_on_the_cpu_is_refused_naming_model_fp8():
    x, weight = torch.randn(16, 128), torch.randn(2, 128, 128)
    with pytest.raises(ValueError, match=r"model\.fp8.*CUDA"):
        fp8_grouped_linear(x, weight, torch.tensor([9, 16], dtype=torch.int32), backend="deep_gemm")


def test_deep_gemm_missing_is_refused_naming_the_backend(monkeypatch: pytest.MonkeyPatch):
    # On a Hopper GPU without DeepGEMM installed, what the trainer says when the model is built.
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` raises ImportError
    monkeypatch.setattr(fp8_linear_module, "_fp8_device_problem", lambda device: None)
    with pytest.raises(ValueError, match=r"model\.fp8_backend 'deep_gemm' needs DeepGEMM.*README"):
        check_fp8_device("cuda", "deep_gemm")
    check_fp8_device("cuda", "scaled_mm")  # the other backends do not need it
    check_fp8_device("cpu", "emulated")


@pytest.mark.parametrize(
    "sizes",
    [[100, 0, 300, 17], [0, 0, 129, 1], [128, 256], [5]],
)
@pytest.mark.parametrize("extra_rows", [0, 3])
def test_deep_gemm_padded_rows_put_each_expert_at_an_aligned_start(sizes, extra_rows):
    """DeepGEMM's contiguous layout, built on the device: each expert's rows in order from a
    multiple of 128, every other row's index -1; rows past the last expert's end land in
    -1 rows too, and every destination is distinct."""
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rows = deep_gemm_grouped.padded_rows(offsets, sum(sizes) + extra_rows)
    dest, expert = rows.dest_N.tolist(), rows.expert_M.tolist()
    assert len(set(dest)) == len(dest) and len(expert) % 128 == 0
    assert len(expert) >= sum(sizes) + extra_rows + len(sizes) * 127
    start, row, expected = 0, 0, [-1] * len(expert)
    for e, size in enumerate(sizes):
        for i in range(size):
            assert dest[row] == start + i
            expected[start + i] = e
            row += 1
        start += -(-size // 128) * 128
    assert expert == expected
    assert rows.source_N.tolist() == dest[: sum(sizes)] + [len(expert)] * extra_rows
    assert all(expert[d] == -1 for d in dest[sum(sizes) :])


def test_deep_gemm_layout_is_reused_for_the_same_offsets_until_they_change():
    # A layer's products share one offsets tensor: one layout; an in-place change, another.
    offsets = torch.tensor([100, 100, 400, 417], dtype=torch.int32)
    first = deep_gemm_grouped.padded_rows(offsets, 417)
    assert deep_gemm_grouped.padded_rows(offsets, 417) is first
    assert deep_gemm_grouped.padded_rows(offsets.clone(), 417) is not first
    assert deep_gemm_grouped.padded_rows(offsets, 420) is not first
    offsets[1] = 150
    changed = deep_gemm_grouped.padded_rows(offsets, 417)
    assert changed is not first and changed.expert_M[128:150].tolist() == [1] * 22
    with torch.inference_mode():
        frozen = torch.tensor([100, 100, 400, 417], dtype=torch.int32)
        assert torch.equal(deep_gemm_grouped.padded_rows(frozen, 417).dest_N, first.dest_N)


def test_bad_arguments_are_refused():
    x = torch.randn(16, 128)
    with pytest.raises(ValueError, match="backend"):
        fp8_linear(x, torch.randn(128, 128), backend="fast")
    with pytest.raises(ValueError, match="does not fit"):
        fp8_linear(x, torch.randn(128, 64), backend="emulated")
    with pytest.raises(ValueError, match=r"model\.fp8.*100x128"):
        fp8_linear(x, torch.randn(100, 128), backend="scaled_mm")
    with pytest.raises(ValueError, match="offsets"):
        fp8_grouped_linear(x, torch.randn(2, 128, 128), torch.tensor([16]), backend="emulated")
