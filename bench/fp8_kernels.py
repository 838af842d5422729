"""The FP8 expert products piece by piece against bf16 torch._grouped_mm, on one Hopper GPU, at
the expert shapes of bench/trainer_throughput.py (issue 19): where an FP8 MoE step's time goes.

For each shape (moe: hidden 2048, experts of 768; moe_wide: 4096 / 1536; 128 experts, top 8,
--tokens tokens routed at random, so ~tokens * 8 / 128 rows an expert) and each of the layer's
two products (w13: [E, 2F, D], w2: [E, D, F]), GPU time (triton.testing.do_bench's median) of:
the bf16 forward, input gradient and weight gradient (torch._grouped_mm), and kernels.fp8_grouped's
pieces: the activation quantizer (1x128 tiles), the weight quantizer (W, and W^T for the input
gradient), the token-tile quantizers of the weight gradient, and the M-grouped and K-grouped
products under each launch setting of --sweep (the module's default first). The last table
sums, per shape, the forward and backward of both products in bf16 and in FP8 (default and
best launch settings), and with DeepGEMM's M-grouped products where DeepGEMM is installed
(model.fp8_backend "deep_gemm": kernels.deep_gemm_grouped).

    python3 bench/fp8_kernels.py [--sweep] [--tokens 4096]

Last line: RESULT fp8_grouped_vs_bf16_moe=<bf16 time / FP8 time, fwd+bwd of both products,
best settings> fp8_grouped_vs_bf16_moe_wide=<...> (and fp8_grouped_vs_bf16_<shape>_deep_gemm=<...>)
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton.testing

from primerl_common.weights.fp8 import quantize_rows_1x128
from primerl_trainer.kernels import deep_gemm_grouped as dg
from primerl_trainer.kernels import fp8_grouped as fg
from primerl_trainer.kernels.deep_gemm_grouped import deep_gemm_problem

SHAPES = {"moe": (2048, 768), "moe_wide": (4096, 1536)}
EXPERTS, TOP_K = 128, 8


def gpu_ms(fn, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def routed_offsets(tokens: int, generator: torch.Generator) -> torch.Tensor:
    scores = torch.rand(tokens, EXPERTS, generator=generator, device="cuda")
    experts = scores.topk(TOP_K, dim=1).indices.flatten()
    return torch.bincount(experts, minlength=EXPERTS).cumsum(0).to(torch.int32)


def configs(sweep: bool, default: dict, grid: dict) -> list[dict]:
    if not sweep:
        return [dict(default)]
    keys = list(grid)
    found = [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]
    return [dict(default)] + [c for c in found if c != default]


def product_rows(name, out_f, in_f, offsets, args) -> dict:
    """Times of one product's pieces; returns the totals {bf16, fp8_default, fp8_best}."""
    rows = int(offsets[-1])
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * out_f * in_f
    bf16 = {
        "fwd": gpu_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets), args.rep_ms),
        "dx": gpu_ms(lambda: torch._grouped_mm(dy, w, offs=offsets), args.rep_ms),
        "dw": gpu_ms(lambda: torch._grouped_mm(dy.t(), x, offs=offsets), args.rep_ms),
    }
    quant = {
        "x 1x128": gpu_ms(lambda: quantize_rows_1x128(x), args.rep_ms),
        "dy 1x128": gpu_ms(lambda: quantize_rows_1x128(dy), args.rep_ms),
        "W 128x128": gpu_ms(lambda: fg.quantize_expert_weights(w), args.rep_ms),
        "W^T 128x128": gpu_ms(lambda: fg.quantize_expert_weights(w, transpose=True), args.rep_ms),
    }
    token_tiles = fg.expert_tiles(offsets, rows)
    quant["dy,x token tiles"] = gpu_ms(
        lambda: (fg.quantize_token_tiles(dy, token_tiles), fg.quantize_token_tiles(x, token_tiles)), args.rep_ms
    )
    xq, xs = quantize_rows_1x128(x)
    dyq, dys = quantize_rows_1x128(dy)
    wq, ws = fg.quantize_expert_weights(w)
    wtq, wts = fg.quantize_expert_weights(w, transpose=True)
    dytq, dyts = fg.quantize_token_tiles(dy, token_tiles)
    xtq, xts = fg.quantize_token_tiles(x, token_tiles)
    print(f"\n{name}: {rows} rows x [{out_f} out, {in_f} in], {EXPERTS} experts ({rows / EXPERTS:.0f} rows each)")
    print(f"  bf16 _grouped_mm ms: fwd {bf16['fwd']:.3f}  dx {bf16['dx']:.3f}  dw {bf16['dw']:.3f}"
          f"  ({flops / bf16['fwd'] / 1e9:.0f} TFLOP/s fwd)")  # fmt: skip
    print("  quantizers ms: " + "  ".join(f"{k} {v:.3f}" for k, v in quant.items()))

    m_default = dict(fg.M_GROUPED)
    m_grid = {"BLOCK_M": [64, 128], "BLOCK_N": [128, 256], "num_warps": [4, 8], "num_stages": [3, 4, 5]}
    best_m = {}
    for which in ("fwd", "dx"):
        results = []
        for config in configs(args.sweep, m_default, m_grid):
            fg.M_GROUPED.clear()
            fg.M_GROUPED.update(config)
            tiles = fg.expert_tiles(offsets, rows, config["BLOCK_M"])
            operands = (xq, xs, wq, ws) if which == "fwd" else (dyq, dys, wtq, wts)
            call = functools.partial(
                fg._m_grouped, *operands, tiles, transposed_weight=which == "dx", out_dtype=x.dtype
            )
            try:
                results.append((gpu_ms(call, args.rep_ms), config))
            except Exception as error:  # a setting past the GPU's shared memory
                print(f"    m_grouped {which} {config}: {type(error).__name__}")
        fg.M_GROUPED.clear()
        fg.M_GROUPED.update(m_default)
        results_sorted = sorted(results, key=lambda r: r[0])
        best_m[which] = (results[0][0], results_sorted[0][0])
        print(f"  m_grouped {which}: default {results[0][0]:.3f} ms ({flops / results[0][0] / 1e9:.0f} TFLOP/s); "
              f"best {results_sorted[0][0]:.3f} ms {results_sorted[0][1]}")  # fmt: skip
        for ms, config in results_sorted[1:4]:
            print(f"      next {ms:.3f} ms {config}")

    deep_gemm = {}
    if deep_gemm_problem() is None:
        # The same operands on DeepGEMM's M-grouped kernel (model.fp8_backend "deep_gemm").
        layout = dg.padded_rows(offsets, rows)
        for which, operands in (("fwd", (xq, xs, wq, ws)), ("dx", (dyq, dys, wtq, wts.transpose(1, 2)))):
            call = functools.partial(dg.m_grouped, *operands, layout)
            triton_out = fg._m_grouped(
                *operands[:3], wts if which == "dx" else ws, fg.expert_tiles(offsets, rows, fg.M_GROUPED["BLOCK_M"]),
                transposed_weight=which == "dx", out_dtype=x.dtype,
            )  # fmt: skip
            difference = ((call().float() - triton_out.float()).norm() / triton_out.float().norm()).item()
            deep_gemm[which] = gpu_ms(call, args.rep_ms)
            print(f"  deep_gemm {which}: {deep_gemm[which]:.3f} ms ({flops / deep_gemm[which] / 1e9:.0f} TFLOP/s, "
                  f"with the row layout's copies); relative difference to Triton's {difference:.1e}")  # fmt: skip
    else:
        print(f"  deep_gemm: not run ({deep_gemm_problem()})")

    k_default = dict(fg.K_GROUPED)
    k_grid = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128, 256], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
    results = []
    for config in configs(args.sweep, k_default, k_grid):
        fg.K_GROUPED.clear()
        fg.K_GROUPED.update(config)
        call = functools.partial(fg._k_grouped, dytq, dyts, xtq, xts, token_tiles, out_dtype=w.dtype)
        try:
            results.append((gpu_ms(call, args.rep_ms), config))
        except Exception as error:
            print(f"    k_grouped {config}: {type(error).__name__}")
    fg.K_GROUPED.clear()
    fg.K_GROUPED.update(k_default)
    results_sorted = sorted(results, key=lambda r: r[0])
    print(f"  k_grouped dw: default {results[0][0]:.3f} ms ({flops / results[0][0] / 1e9:.0f} TFLOP/s); "
          f"best {results_sorted[0][0]:.3f} ms {results_sorted[0][1]}")  # fmt: skip
    for ms, config in results_sorted[1:4]:
        print(f"      next {ms:.3f} ms {config}")
    quant_fwd = quant["x 1x128"] + quant["W 128x128"]
    quant_bwd = quant["dy 1x128"] + quant["W^T 128x128"] + quant["dy,x token tiles"]
    totals = {
        "bf16": sum(bf16.values()),
        "fp8_default": quant_fwd + quant_bwd + best_m["fwd"][0] + best_m["dx"][0] + results[0][0],
        "fp8_best": quant_fwd + quant_bwd + best_m["fwd"][1] + best_m["dx"][1] + results_sorted[0][0],
        "quant": quant_fwd + quant_bwd,
    }
    if deep_gemm:
        totals["fp8_deep_gemm"] = quant_fwd + quant_bwd + deep_gemm["fwd"] + deep_gemm["dx"] + results_sorted[0][0]
    return totals


@torch.library.custom_op("fp8_kernels_bench::plus_one", mutates_args=())
def _plus_one_op(x: torch.Tensor) -> torch.Tensor:
    return x + 1


_plus_one_op.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


class _PlusOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def host_profile(reps: int) -> None:
    """Host time of a forward and backward of fp8_linear and fp8_grouped_linear at shapes where
    the GPU is never the bound (the time to issue the kernels), and where it goes (cProfile)."""
    import cProfile
    import pstats
    import time

    from primerl_trainer.kernels.fp8_linear import fp8_grouped_linear, fp8_linear

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    we = torch.randn(16, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.arange(16, 16 * 17, 16, device="cuda", dtype=torch.int32)
    dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    cases = {
        "a custom op (x + 1, its own backward)": lambda: _plus_one_op(x).backward(dy),
        "an autograd.Function (x + 1)": lambda: _PlusOne.apply(x).backward(dy),
        "F.linear bf16": lambda: torch.nn.functional.linear(x, w).backward(dy),
        "fp8_linear": lambda: fp8_linear(x, w).backward(dy),
        "torch._grouped_mm bf16": lambda: torch._grouped_mm(x, we.transpose(-2, -1), offs=offsets).backward(dy),
        "fp8_grouped_linear": lambda: fp8_grouped_linear(x, we, offsets).backward(dy),
    }
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        host_ms = (time.perf_counter() - start) / reps * 1e3
        torch.cuda.synchronize()
        print(f"host: {name} forward+backward issued in {host_ms:.3f} ms")
        if name.startswith(("fp8", "a custom")):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(reps):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="moe,moe_wide")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of a micro-batch (rows = tokens * 8)")
    parser.add_argument("--rep-ms", type=int, default=100, help="each timing's budget (triton.testing.do_bench)")
    parser.add_argument("--sweep", action="store_true", help="time every launch setting of the grids")
    parser.add_argument("--host", action="store_true", help="also the host time of issuing the products")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.host:
        host_profile(200)
    generator = torch.Generator(device="cuda").manual_seed(0)
    ratios = {}
    for shape in args.shapes.split(","):
        hidden, inter = SHAPES[shape]
        offsets = routed_offsets(args.tokens, generator)
        totals = [
            product_rows(f"{shape} w13", 2 * inter, hidden, offsets, args),
            product_rows(f"{shape} w2", hidden, inter, offsets, args),
        ]
        summed = {key: sum(t[key] for t in totals) for key in totals[0]}
        ratios[shape] = summed["bf16"] / summed["fp8_best"]
        print(f"\n{shape}: fwd+bwd of both products: bf16 {summed['bf16']:.3f} ms; FP8 {summed['fp8_default']:.3f} ms "
              f"(default settings), {summed['fp8_best']:.3f} ms (best; quantizers {summed['quant']:.3f} ms): "
              f"{ratios[shape]:.2f}x of bf16")  # fmt: skip
        if "fp8_deep_gemm" in summed:
            ratios[f"{shape}_deep_gemm"] = summed["bf16"] / summed["fp8_deep_gemm"]
            print(f"{shape}: with DeepGEMM's M-grouped products {summed['fp8_deep_gemm']:.3f} ms: "
                  f"{ratios[shape + '_deep_gemm']:.2f}x of bf16")  # fmt: skip
    print("RESULT " + " ".join(f"fp8_grouped_vs_bf16_{shape}={ratio:.3f}" for shape, ratio in ratios.items()))


if __name__ == "__main__":
    main()
