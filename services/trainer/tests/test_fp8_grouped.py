"""kernels.fp8_grouped on the CPU: the tile map, and the fused Triton kernels run by Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess so that interpreter mode stays out of this
process) against the "emulated" backend of fp8_grouped_linear: the quantizers bit for bit, the
products up to the summation order. gpu_fp8_linear.py runs the same comparison compiled on a GPU.

The interpreter's own float conversions (float32 -> float8/bfloat16) are approximate (they
truncate, and drop the carry of a rounded-up mantissa); the subprocess replaces them with
torch's correctly rounded casts, which is what the GPU's conversion instructions compute.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primerl_common.weights.fp8 import quantize_blockwise_reference, quantize_rows_1x128_reference
from primerl_trainer.kernels.fp8_grouped import TILE, expert_tiles
from primerl_trainer.kernels.fp8_weight_cache import QuantizedWeightCache

REPO_ROOT = Path(__file__).resolve().parents[3]
SIZES = [130, 0, 7, 163]  # an empty expert, counts off the 128-row tile


def offsets_of(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def test_tiles_restart_at_each_expert_and_never_straddle_two():
    tiles = expert_tiles(offsets_of(SIZES), sum(SIZES))
    assert tiles.num_tiles == 3 + len(SIZES)  # ceil(300 / 128) + one partial tile per expert at most
    real = [
        (e, s, t)
        for e, s, t in zip(tiles.expert_T.tolist(), tiles.row_start_T.tolist(), tiles.row_end_T.tolist(), strict=True)
        if t > s
    ]
    # Expert 0: rows 0-129 in two tiles; expert 2: 130-136; expert 3: 137-299 in two tiles.
    assert [(e, s, min(s + TILE, t)) for e, s, t in real] == [
        (0, 0, 128),
        (0, 128, 130),
        (2, 130, 137),
        (3, 137, 265),
        (3, 265, 300),
    ]
    assert tiles.tile_begin_E.tolist() == [0, 2, 2, 3]
    assert tiles.tile_count_E.tolist() == [2, 0, 1, 2]


def test_fused_kernels_equal_emulated_in_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from services.trainer.tests.test_fp8_grouped import interpreter_checks; interpreter_checks()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    for name, error in errors.items():
        # Float32 outputs differ by the summation order only; bf16 ones round it once more.
        assert error < (1e-5 if name.startswith("float32") else 1e-3), (name, errors)


# ---- Run in the subprocess (TRITON_INTERPRET=1 set before Triton defines the kernels).


def _use_exact_conversions() -> None:
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    approximate = interpreter._convert_float
    dtypes = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
    }
    bits = {8: torch.uint8, 16: torch.int16, 32: torch.int32}

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype not in dtypes or output_dtype not in dtypes:
            return approximate(values, input_dtype, output_dtype, rounding_mode)
        raw = torch.from_numpy(np.ascontiguousarray(values).view(np.uint8).copy())
        converted = raw.view(bits[input_dtype.primitive_bitwidth]).view(dtypes[input_dtype]).to(dtypes[output_dtype])
        out_bits = converted.view(bits[output_dtype.primitive_bitwidth]).numpy()
        return out_bits.view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(np.shape(values))

    interpreter._convert_float = convert


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def interpreter_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _use_exact_conversions()
    from primerl_trainer.kernels.fp8_grouped import (
        grouped_backward,
        grouped_forward,
        quantize_expert_weights,
        quantize_token_tiles,
    )
    from primerl_trainer.kernels.fp8_linear import fp8_grouped_linear

    torch.manual_seed(0)
    num_experts, in_features, out_features, rows = len(SIZES), 256, 384, sum(SIZES)
    offsets = offsets_of(SIZES)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, in_features).to(dtype)
        weights = (torch.randn(num_experts, out_features, in_features) * 0.05).to(dtype)
        grad_y = torch.randn(rows, out_features).to(dtype)

        wq, ws = quantize_expert_weights(weights)
        wtq, wts = quantize_expert_weights(weights, transpose=True)
        assert torch.equal(wts, ws) and _same_fp8(wtq, wq.transpose(1, 2))
        tiles = expert_tiles(offsets, rows)
        dytq, dyts = quantize_token_tiles(grad_y, tiles)
        for expert, (start, end) in enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist(), strict=True)):
            ref_q, ref_s = quantize_blockwise_reference(weights[expert])
            assert torch.equal(ws[expert], ref_s) and _same_fp8(wq[expert], ref_q), expert
            # The emulated backend's weight-gradient operand: 1x128 tiles from the expert's first token.
            ref_q, ref_s = quantize_rows_1x128_reference(grad_y[start:end].t())
            first, count = tiles.tile_begin_E[expert].item(), tiles.tile_count_E[expert].item()
            assert torch.equal(dyts[first : first + count].t(), ref_s), expert
            values = dytq[:, first * TILE : (first + count) * TILE]
            assert _same_fp8(values[:, : end - start], ref_q), expert
            assert not values[:, end - start :].float().any(), expert

        y = grouped_forward(x, weights, offsets)
        grad_x, grad_w = grouped_backward(grad_y, x, weights, offsets, True, True)
        x_e, w_e = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y_e = fp8_grouped_linear(x_e, w_e, offsets, backend="emulated")
        y_e.backward(grad_y)
        for name, actual, expected in (("y", y, y_e), ("grad_x", grad_x, x_e.grad), ("grad_w", grad_w, w_e.grad)):
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
            errors[f"{str(dtype).removeprefix('torch.')} {name}"] = _relative_error(actual, expected)
        assert not grad_w[1].any()
        _check_into_grad(errors, dtype, grad_y, x, weights, offsets)
    print(json.dumps(errors))


def _check_into_grad(errors, dtype, grad_y, x, weights, offsets) -> None:
    """grouped_backward's weight gradient with into_grad (set as w.grad, or added into a held
    one inside the product) and with weight_grad "model_dtype" (the unquantized dy^T x), against
    the exact values rounded once to the dtype. The interpreter's tl.dot of two bfloat16 operands
    is wrong (it multiplies their bits as integers), so model_dtype's bf16 kernel is checked in
    float32 only here; gpu_fp8_linear.py checks it in bfloat16."""
    from primerl_trainer.kernels.fp8_grouped import grouped_backward
    from primerl_trainer.kernels.fp8_linear import fp8_grouped_linear

    # The FP8 weight gradient unrounded: the same quantized operands (float32 holds bf16 exactly).
    w_32 = weights.detach().float().requires_grad_()
    fp8_linear_out = fp8_grouped_linear(x.float(), w_32, offsets, backend="emulated")
    fp8_linear_out.backward(grad_y.float())
    starts, ends = [0, *offsets[:-1].tolist()], offsets.tolist()
    exact = torch.stack([grad_y[s:t].double().t() @ x[s:t].double() for s, t in zip(starts, ends, strict=True)])
    held = torch.randn_like(weights)
    name = str(dtype).removeprefix("torch.")
    for weight_grad, expected in (("fp8", w_32.grad.double()), ("model_dtype", exact)):
        dx, dw = grouped_backward(grad_y, x, weights, offsets, False, True, weight_grad=weight_grad)
        assert dx is None and dw.dtype == dtype
        errors[f"{name} {weight_grad} dW"] = _relative_error(dw, expected.to(dtype))
        w = weights.detach().clone().requires_grad_()
        for into in ("new", "held"):
            if into == "held" and weight_grad == "model_dtype" and dtype == torch.bfloat16:
                continue
            w.grad = None if into == "new" else held.clone()
            dx, dw = grouped_backward(grad_y, x, w, offsets, False, True, weight_grad=weight_grad, into_grad=True)
            assert dx is None and dw is None and w.grad.dtype == dtype
            sum_ = expected + (0 if into == "new" else held.double())
            errors[f"{name} {weight_grad} dW into {into} grad"] = _relative_error(w.grad, sum_.to(dtype))


def reference_expert_blocks(w: torch.Tensor, *, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_expert_weights' values by the PyTorch reference (the Triton kernel needs a GPU or
    the interpreter), counted: what the cache is asked to keep."""
    reference_expert_blocks.calls += 1
    blocks = [quantize_blockwise_reference(w[e]) for e in range(w.shape[0])]
    values = torch.stack([q.t() if transpose else q for q, _ in blocks]).contiguous()
    return values, torch.stack([s for _, s in blocks])


def test_weight_cache_quantizes_a_weight_once_until_it_changes():
    """model.fp8_weight_cache: a step's micro-batches reuse the weight's blocks; an in-place
    update (the optimizer's), `clear` (the trainer's, before each optimizer step) or another
    tensor quantizes again, with the new values; a freed weight leaves the cache; off, every
    call quantizes."""
    reference_expert_blocks.calls = 0
    cache = QuantizedWeightCache()
    w = torch.randn(2, 256, 128)
    cache.quantized(w, reference_expert_blocks, transpose=False)
    cache.quantized(w, reference_expert_blocks, transpose=True)
    assert reference_expert_blocks.calls == 2  # off: no entry kept
    assert len(cache) == 0

    cache.enabled = True
    first = cache.quantized(w, reference_expert_blocks, transpose=False)
    for _ in range(3):  # the step's other micro-batches
        assert cache.quantized(w, reference_expert_blocks, transpose=False)[0] is first[0]
    transposed = cache.quantized(w, reference_expert_blocks, transpose=True)
    assert transposed[0].shape == (2, 128, 256) and reference_expert_blocks.calls == 4

    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step's in-place write
    updated = cache.quantized(w, reference_expert_blocks, transpose=False)
    assert reference_expert_blocks.calls == 5
    expected = reference_expert_blocks(w, transpose=False)
    assert torch.equal(updated[0].float(), expected[0].float()) and torch.equal(updated[1], expected[1])

    cache.clear()
    cache.quantized(w, reference_expert_blocks, transpose=False)
    assert reference_expert_blocks.calls == 7 and len(cache) == 1
    other = w.clone()  # equal values, another tensor: its own entry
    cache.quantized(other, reference_expert_blocks, transpose=False)
    assert reference_expert_blocks.calls == 8 and len(cache) == 2
    del other
    assert len(cache) == 1
