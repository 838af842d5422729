"""kernels.fp8_linear on a Hopper GPU: the "scaled_mm" backend (cuBLAS's block-scaled FP8
products) against the "emulated" one (the same quantized operands multiplied in float32),
forward and backward with bf16 inputs, dense and grouped (the grouped one: kernels.fp8_grouped's
fused Triton kernels; the "deep_gemm" backend against it where DeepGEMM is installed); the
Triton quantizers against their PyTorch references, bit for bit; and the time of fp8_linear
against bf16 F.linear for an 8192x4096x4096 product, and of fp8_grouped_linear against bf16
torch._grouped_mm for a MoE layer's experts (printed). From the repository root, where the
project is installed:

    python3 -m pytest -q services/trainer/tests/gpu_fp8_linear.py

Where it is not (the repository's conftests import the trainer's and launcher's packages and
their wheels), the file needs torch, Triton and pytest only: put libs/common/src and
services/trainer/src on PYTHONPATH with a dist-info folder for primerl-common and
primerl-trainer (as gpu_context_parallel.use_checkout makes) and add `--noconftest`.
Skipped without CUDA; the FP8 cases need compute capability 9.x.
"""

import statistics

import pytest
import torch
import torch.nn.functional as F

from primerl_common.weights.fp8 import (
    quantize_blockwise,
    quantize_blockwise_reference,
    quantize_rows_1x128,
    quantize_rows_1x128_reference,
)
from primerl_trainer.kernels.fp8_grouped import TILE, expert_tiles, quantize_expert_weights, quantize_token_tiles
from primerl_trainer.kernels.fp8_linear import check_fp8_device, fp8_grouped_linear, fp8_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


BF16 = {"device": "cuda", "dtype": torch.bfloat16}


def hopper() -> None:
    try:
        check_fp8_device("cuda")
    except ValueError as error:
        pytest.skip(str(error))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 3000), (129, 7), (77, 256)])
@pytest.mark.parametrize("transposed", [False, True])
def test_triton_rows_quantizer_equals_reference_bit_for_bit(shape, transposed):
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    x = x.t() if transposed else x
    quantized, scales = quantize_rows_1x128(x)
    ref_q, ref_s = quantize_rows_1x128_reference(x)
    assert torch.equal(scales, ref_s)
    assert torch.equal(quantized.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("shape", [(4096, 1536), (1000, 3000)])
def test_triton_block_quantizer_reads_a_transposed_weight_bit_for_bit(shape):
    torch.manual_seed(0)
    weight_t = torch.randn(shape, device="cuda", dtype=torch.bfloat16).t()
    quantized, scale_inv = quantize_blockwise(weight_t)
    ref_q, ref_s = quantize_blockwise_reference(weight_t.contiguous())
    assert quantized.is_contiguous() and torch.equal(scale_inv, ref_s)
    assert torch.equal(quantized.view(torch.uint8), ref_q.view(torch.uint8))


def run(x, weight, grad_y, backend):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = fp8_linear(x, weight, backend=backend)
    y.backward(grad_y)
    return y, x.grad, weight.grad


# (tokens, in, out): whole blocks; k-block counts that are not multiples of 4 (the padded
# 128x128 scales); token counts that are not multiples of 16 (padded rows); features that are
# not multiples of 128 (partial blocks, GPT-OSS's 2880).
SHAPES = [(256, 512, 768), (200, 1280, 384), (77, 384, 640), (300, 2880, 320)]


@pytest.mark.parametrize("tokens,in_features,out_features", SHAPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_emulated_forward_and_backward(tokens, in_features, out_features, weight_dtype):
    hopper()
    torch.manual_seed(tokens)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(out_features, in_features, device="cuda") * 0.05).to(weight_dtype)
    grad_y = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    fast = run(x, weight, grad_y, "scaled_mm")
    emulated = run(x, weight, grad_y, "emulated")
    for name, actual, expected in zip(("y", "grad_x", "grad_w"), fast, emulated, strict=True):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        # Both round the same float32 products to the output dtype; the accumulation order differs.
        assert relative_error(actual, expected) < 5e-3, name
    exact = x.float() @ weight.float().t()
    assert relative_error(fast[0], exact) < 5e-2


# (expert sizes, in, out): an empty expert and sizes off the 128-row tile; a partial 128-block
# of the contraction (2880); many experts, several of them empty.
GROUPED_SHAPES = [
    ([100, 0, 300, 17], 512, 256),
    ([130, 0, 7, 163, 1000], 2880, 384),
    ([0, 0, 513, 1, 255, 0, 64, 129, 0, 700, 3, 0, 128, 256, 0, 40], 1024, 768),
]


def grouped_results(sizes, in_features, out_features, weight_dtype, backends, extra_rows=0):
    """{backend: (y, grad_x, grad_w)} of fp8_grouped_linear forward and backward on the same
    inputs; `extra_rows` rows past the last expert's."""
    torch.manual_seed(len(sizes))
    rows = sum(sizes) + extra_rows
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    weights = (torch.randn(len(sizes), out_features, in_features, device="cuda") * 0.05).to(weight_dtype)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    grad_y = torch.randn(rows, out_features, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in backends:
        x_b, w_b = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = fp8_grouped_linear(x_b, w_b, offsets, backend=backend)
        y.backward(grad_y)
        results[backend] = (y, x_b.grad, w_b.grad)
    return results


def assert_close_grouped(actual_results, expected_results, bound) -> None:
    for name, actual, expected in zip(("y", "grad_x", "grad_w"), actual_results, expected_results, strict=True):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        assert relative_error(actual, expected) < bound, name


@pytest.mark.parametrize("sizes,in_features,out_features", GROUPED_SHAPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_grouped_scaled_mm_equals_emulated(sizes, in_features, out_features, weight_dtype):
    """The fused Triton kernels (kernels.fp8_grouped) against the per-expert emulated loop."""
    hopper()
    results = grouped_results(sizes, in_features, out_features, weight_dtype, ("scaled_mm", "emulated"))
    assert_close_grouped(results["scaled_mm"], results["emulated"], 5e-3)
    for expert, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(results["scaled_mm"][2][expert]) == 0


@pytest.mark.parametrize("sizes,in_features,out_features", GROUPED_SHAPES)
def test_grouped_deep_gemm_equals_scaled_mm(sizes, in_features, out_features):
    """The "deep_gemm" backend (DeepGEMM's M-grouped products, kernels.deep_gemm_grouped) against
    "scaled_mm" (the Triton kernels): the same quantized operands, so the same products up to the
    order of the float32 sums; 2880 input features are not whole 128-blocks, so that layer's
    products stay on Triton; 5 rows of no expert come back zero. Skipped where DeepGEMM is not
    installed."""
    hopper()
    try:
        check_fp8_device("cuda", "deep_gemm")
    except ValueError as error:
        pytest.skip(str(error))
    results = grouped_results(
        sizes, in_features, out_features, torch.bfloat16, ("deep_gemm", "scaled_mm"), extra_rows=5
    )
    assert_close_grouped(results["deep_gemm"], results["scaled_mm"], 1e-3)
    y, grad_x, _ = results["deep_gemm"]
    assert torch.count_nonzero(y[sum(sizes) :]) == 0 and torch.count_nonzero(grad_x[sum(sizes) :]) == 0


@pytest.mark.parametrize("weight_grad", ["fp8", "model_dtype"])
def test_grouped_weight_grad_accumulates_into_grad_inside_the_product(weight_grad):
    """Two micro-batches' backward into one leaf bf16 weight: the first sets w.grad, the second
    adds its weight gradient into it inside the product (kernels.fp8_grouped's K-grouped kernel,
    or kernels.grouped_weight_grad's for model.fp8_weight_grad "model_dtype"); the sum equals the
    two gradients computed apart by the emulated backend, added in float32."""
    hopper()
    sizes, in_features, out_features = GROUPED_SHAPES[2]
    torch.manual_seed(1)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    weights = (torch.randn(len(sizes), out_features, in_features, device="cuda") * 0.05).to(torch.bfloat16)
    batches = [
        (torch.randn(sum(sizes), in_features, **BF16), torch.randn(sum(sizes), out_features, **BF16)) for _ in range(2)
    ]
    w = weights.clone().requires_grad_()
    expected = torch.zeros_like(weights, dtype=torch.float32)
    for x, grad_y in batches:
        fp8_grouped_linear(x, w, offsets, weight_grad=weight_grad).backward(grad_y)
        w_e = weights.clone().requires_grad_()
        fp8_grouped_linear(x, w_e, offsets, backend="emulated", weight_grad=weight_grad).backward(grad_y)
        expected += w_e.grad.float()
    assert w.grad.dtype == torch.bfloat16
    assert relative_error(w.grad, expected) < 5e-3


def test_grouped_quantizers_equal_the_per_expert_ones_bit_for_bit():
    hopper()
    torch.manual_seed(0)
    sizes = [130, 0, 7, 163, 1000]
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    weights = torch.randn(len(sizes), 384, 2880, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn(sum(sizes), 384, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_expert_weights(weights)
    wtq, wts = quantize_expert_weights(weights, transpose=True)
    assert torch.equal(wts, ws) and torch.equal(wtq.view(torch.uint8), wq.transpose(1, 2).view(torch.uint8))
    tiles = expert_tiles(offsets, sum(sizes))
    tq, ts = quantize_token_tiles(grad_y, tiles)
    starts = [0, *offsets[:-1].tolist()]
    for expert, (start, end) in enumerate(zip(starts, offsets.tolist(), strict=True)):
        ref_q, ref_s = quantize_blockwise_reference(weights[expert])
        assert torch.equal(ws[expert], ref_s) and torch.equal(wq[expert].view(torch.uint8), ref_q.view(torch.uint8))
        ref_q, ref_s = quantize_rows_1x128_reference(grad_y[start:end].t())
        first, count = tiles.tile_begin_E[expert].item(), tiles.tile_count_E[expert].item()
        assert torch.equal(ts[first : first + count].t(), ref_s), expert
        values = tq[:, first * TILE : (first + count) * TILE].view(torch.uint8)
        assert torch.equal(values[:, : end - start], ref_q.view(torch.uint8)), expert
        assert torch.count_nonzero(values[:, end - start :]) == 0, expert


def median_ms(fn, iters: int = 10, repeats: int = 5) -> float:
    """Median over repeats of the mean time of `iters` calls queued back to back (as a training
    step queues them: the host's launch time hides behind the GPU's work)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def test_time_against_bf16_linear(capsys):
    hopper()
    tokens, in_features, out_features = 8192, 4096, 4096
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    grad_y = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)

    def step(linear):
        linear().backward(grad_y)

    with torch.no_grad():
        forward = {
            "bf16": median_ms(lambda: F.linear(x, weight)),
            "fp8": median_ms(lambda: fp8_linear(x, weight)),
        }
    both = {
        "bf16": median_ms(lambda: step(lambda: F.linear(x, weight))),
        "fp8": median_ms(lambda: step(lambda: fp8_linear(x, weight))),
    }
    with capsys.disabled():
        print(
            f"\n{tokens}x{in_features}x{out_features}: forward bf16 {forward['bf16']:.3f} ms, "
            f"fp8 {forward['fp8']:.3f} ms ({forward['bf16'] / forward['fp8']:.2f}x); forward+backward "
            f"bf16 {both['bf16']:.3f} ms, fp8 {both['fp8']:.3f} ms ({both['bf16'] / both['fp8']:.2f}x)"
        )


@pytest.mark.parametrize("name,in_features,out_features", [("up", 2048, 768 * 2), ("down", 768, 2048)])
def test_time_grouped_against_bf16_grouped_mm(capsys, name, in_features, out_features):
    """A MoE layer's experts: 4096 tokens x top-8 over 128 experts (random routing)."""
    hopper()
    torch.manual_seed(0)
    num_experts, rows = 128, 4096 * 8
    sizes = torch.bincount(torch.randint(num_experts, (rows,), device="cuda"), minlength=num_experts)
    offsets = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = torch.randn(num_experts, out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
    weights.requires_grad_()
    grad_y = torch.randn(rows, out_features, device="cuda", dtype=torch.bfloat16)

    def bf16():
        return torch._grouped_mm(x, weights.transpose(-2, -1), offs=offsets)

    def fp8():
        return fp8_grouped_linear(x, weights, offsets)

    with torch.no_grad():
        forward = {"bf16": median_ms(bf16), "fp8": median_ms(fp8)}
        # Of the FP8 forward: the experts' weights quantized (read in bf16, written in FP8).
        weight_quantization = median_ms(lambda: quantize_expert_weights(weights))
    both = {"bf16": median_ms(lambda: bf16().backward(grad_y)), "fp8": median_ms(lambda: fp8().backward(grad_y))}
    with capsys.disabled():
        print(
            f"\ngrouped {name} E={num_experts} N={rows} {in_features}->{out_features}: forward bf16 "
            f"{forward['bf16']:.3f} ms, fp8 {forward['fp8']:.3f} ms ({forward['bf16'] / forward['fp8']:.2f}x); "
            f"forward+backward bf16 {both['bf16']:.3f} ms, fp8 {both['fp8']:.3f} ms "
            f"({both['bf16'] / both['fp8']:.2f}x); fp8 weight quantization {weight_quantization:.3f} ms"
        )
