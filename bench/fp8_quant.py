"""Fused Triton block-FP8 quantization vs the plain PyTorch version vs the
GPU's device-to-device copy bandwidth, in one run (needs a CUDA GPU).

Bytes counted per weight: its bf16 read, the fp8 write and the scales.
Last line: RESULT fp8_quant_hbm_fraction=<x> speedup_vs_naive=<y>
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from primerl_common.weights.fp8 import quantize_blockwise, quantize_blockwise_reference, scale_shape

SHAPES = [(8192, 8192), (16384, 16384), (7168, 18432), (18432, 7168), (4096, 14336)]


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def rotating(fn, inputs):
    """Calls fn on the next input each time, so timings are not of the L2 cache."""
    position = [0]

    def step():
        position[0] = (position[0] + 1) % len(inputs)
        fn(inputs[position[0]])

    return step


def copy_gbps(num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6  # read + write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--copies", type=int, default=3, help="weights rotated per timing, to defeat the L2")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    hbm = copy_gbps(2 << 30)
    print(f"device: {device}   torch {torch.__version__}   triton {triton.__version__}")
    print(f"device-to-device copy: {hbm:.0f} GB/s (read + write, 2 GiB)")
    print(f"{'shape':>14} {'naive GB/s':>11} {'fused GB/s':>11} {'fused/copy':>11} {'speedup':>8} {'bit-exact':>10}")
    fractions, speedups = [], []
    for rows, cols in SHAPES:
        weights = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(args.copies)]
        blocks_m, blocks_n = scale_shape(rows, cols)
        num_bytes = rows * cols * 3 + blocks_m * blocks_n * 4
        naive_ms = median_ms(rotating(quantize_blockwise_reference, weights))
        fused_ms = median_ms(rotating(quantize_blockwise, weights))
        fused_q, fused_s = quantize_blockwise(weights[0])
        ref_q, ref_s = quantize_blockwise_reference(weights[0])
        exact = torch.equal(fused_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(fused_s, ref_s)
        naive_gbps, fused_gbps = num_bytes / naive_ms / 1e6, num_bytes / fused_ms / 1e6
        fractions.append(fused_gbps / hbm)
        speedups.append(naive_ms / fused_ms)
        print(
            f"{rows:>6}x{cols:<7} {naive_gbps:>11.0f} {fused_gbps:>11.0f} {fused_gbps / hbm:>11.2f} "
            f"{naive_ms / fused_ms:>8.1f} {exact!s:>10}"
        )
    fraction = sorted(fractions)[len(fractions) // 2]
    speedup = sorted(speedups)[len(speedups) // 2]
    print(f"median over shapes: fused/copy {fraction:.2f}, speedup {speedup:.1f}x")
    print(f"RESULT fp8_quant_hbm_fraction={fraction:.3f} speedup_vs_naive={speedup:.2f}")


if __name__ == "__main__":
    main()
