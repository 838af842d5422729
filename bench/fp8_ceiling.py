"""The most an FP8 step can gain over the bf16 step it replaces (issue 19): Amdahl's law over the
products that model.fp8 runs in FP8, timed on this GPU.

model.fp8 follows DeepSeek-V3's recipe (models/fp8.py): the decoder blocks' linear products run
in FP8 (the fused q/k/v and the output projection of the attention, a dense feed-forward's fused
gate/up and down, the routed experts' w13 and w2); the output head, the router, the attention
itself, norms, the loss and the optimizer stay as they are. For a model of
bench/trainer_throughput.py's CONFIGS at `tokens` tokens a micro-batch, each of those products is
timed alone in bf16 (forward, input gradient and weight gradient; the experts' through
torch._grouped_mm at top-k routing of the tokens at random; triton.testing.do_bench's median).
With these products r times as fast in FP8, and quantizing free, a step of n micro-batches takes
at least

    step - n * layers * products * (1 - 1/r)

and the ceiling of the FP8 speedup is the bf16 step over that. Two r: the datasheet's (FP8 dense
peak / bf16 dense peak = 2 on Hopper) and the measured one (a block-scaled FP8 8192^3 product,
operands quantized beforehand, against bf16's faster layout of the same size: what F.scaled_mm
reaches here). The output head is timed too and printed (the recipe leaves it in bf16: were it FP8, the
ceiling would be the one printed after it).

    python3 bench/fp8_ceiling.py --step-ms moe_wide=352.9,moe=210.6 [--micro-batches 4]

(bench/trainer_throughput.py --fp8 prints the same lines for the bf16 steps it measured.)
Last line: RESULT fp8_ceiling_<kind>=<datasheet r> ... (one per kind).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from primerl_common.weights.fp8 import quantize_blockwise, quantize_rows_1x128
from primerl_trainer.kernels import fp8_linear

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fp8_kernels import gpu_ms

DATASHEET_FP8_OVER_BF16 = 2.0  # H100/H200: 1979 / 989 dense TFLOP/s


def linear_ms(rows: int, out_f: int, in_f: int, rep_ms: int) -> float:
    """Forward, input and weight gradient of a [rows, in_f] x [out_f, in_f]^T product in bf16."""
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16)
    return sum(gpu_ms(fn, rep_ms) for fn in (lambda: F.linear(x, w), lambda: dy @ w, lambda: dy.t() @ x))


def grouped_ms(tokens: int, top_k: int, experts: int, out_f: int, in_f: int, rep_ms: int) -> float:
    """The same for the experts' product, rows routed to `top_k` of `experts` at random."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=generator, device="cuda").topk(top_k, dim=1).indices
    offsets = torch.bincount(chosen.flatten(), minlength=experts).cumsum(0).to(torch.int32)
    rows = tokens * top_k
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16)
    calls = (
        lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets),
        lambda: torch._grouped_mm(dy, w, offs=offsets),
        lambda: torch._grouped_mm(dy.t(), x, offs=offsets),
    )
    return sum(gpu_ms(fn, rep_ms) for fn in calls)


@dataclass(frozen=True)
class Products:
    """bf16 ms of a micro-batch's products, per layer (those FP8 runs) and the output head's."""

    attention: float  # q/k/v fused and o
    feed_forward: float  # the dense feed-forward or the routed experts
    head: float

    @property
    def per_layer(self) -> float:
        return self.attention + self.feed_forward


def time_products(config: dict, tokens: int, rep_ms: int = 100) -> Products:
    dim, head_dim = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attention = linear_ms(tokens, q + 2 * kv, dim, rep_ms) + linear_ms(tokens, dim, q, rep_ms)
    if "num_experts" in config:
        experts, top_k, width = config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
        feed_forward = grouped_ms(tokens, top_k, experts, 2 * width, dim, rep_ms)
        feed_forward += grouped_ms(tokens, top_k, experts, dim, width, rep_ms)
    else:
        width = config["intermediate_size"]
        feed_forward = linear_ms(tokens, 2 * width, dim, rep_ms) + linear_ms(tokens, dim, width, rep_ms)
    return Products(attention, feed_forward, linear_ms(tokens, config["vocab_size"], dim, rep_ms))


def measured_fp8_over_bf16(size: int = 8192, rep_ms: int = 200) -> tuple[float, float]:
    """(FP8 TFLOP/s, bf16 TFLOP/s) of a size^3 product: FP8 with 1x128 activation tiles and
    128x128 weight blocks through F.scaled_mm (the "scaled_mm" backend's product), operands
    quantized beforehand."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    aq, as_ = quantize_rows_1x128(a)
    bq, bs = quantize_blockwise(b)
    fp8 = gpu_ms(
        lambda: fp8_linear._product(aq, as_, bq, bs, right_blocked=True, out_dtype=torch.bfloat16, backend="scaled_mm"),
        rep_ms,
    )
    # bf16's faster layout (x @ w^T, as F.linear, or x @ w): an 8192^3 product ran 685 TFLOP/s
    # as the first and 791 as the second on an H200.
    bf16 = min(gpu_ms(lambda: a @ b.t(), rep_ms), gpu_ms(lambda: a @ b, rep_ms))
    flops = 2 * size**3 / 1e9
    return flops / fp8, flops / bf16


def ceiling(step_ms: float, saved_per_step_ms: float, ratio: float) -> float:
    """bf16 step / the shortest FP8 step: products taking `saved_per_step_ms` in bf16 run `ratio`
    times as fast, everything else as before."""
    return step_ms / (step_ms - saved_per_step_ms * (1 - 1 / ratio))


def report(kind: str, config: dict, step_ms: float, micro_batches: int, tokens: int, measured: float) -> float:
    """Prints the kind's products and ceilings; returns the datasheet ceiling."""
    products = time_products(config, tokens)
    layers = config["num_hidden_layers"]
    fp8_ms = micro_batches * layers * products.per_layer
    head_ms = micro_batches * products.head
    ratios = {"datasheet 2x": DATASHEET_FP8_OVER_BF16, f"measured {measured:.2f}x": measured}
    print(f"{kind}: a micro-batch's products in bf16 ({tokens} tokens): per layer attention {products.attention:.2f} "
          f"ms, {'experts' if 'num_experts' in config else 'feed-forward'} {products.feed_forward:.2f} ms; "
          f"output head {products.head:.2f} ms")  # fmt: skip
    print(
        f"{kind}: of the bf16 step's {step_ms:.1f} ms ({micro_batches} micro-batches), the FP8 products take "
        f"{fp8_ms:.1f} ms ({fp8_ms / step_ms:.0%}), the output head {head_ms:.1f} ms ({head_ms / step_ms:.0%})"
    )
    for name, ratio in ratios.items():
        print(f"{kind}: ceiling at FP8 products {name} bf16's, quantizing free: {ceiling(step_ms, fp8_ms, ratio):.3f}x"
              f" (with the output head in FP8 too: {ceiling(step_ms, fp8_ms + head_ms, ratio):.3f}x)")  # fmt: skip
    return ceiling(step_ms, fp8_ms, DATASHEET_FP8_OVER_BF16)


def report_all(steps: dict[str, tuple[dict, float]], micro_batches: int, tokens: int) -> dict[str, float]:
    """The ceilings of each kind's (config, bf16 step ms), printed; the datasheet ones returned."""
    fp8_tflops, bf16_tflops = measured_fp8_over_bf16()
    measured = fp8_tflops / bf16_tflops
    print(f"8192^3 product: block-scaled FP8 {fp8_tflops:.0f} TFLOP/s, bf16 {bf16_tflops:.0f}: {measured:.2f}x")
    return {kind: report(kind, config, ms, micro_batches, tokens, measured) for kind, (config, ms) in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", required=True, help="kind=ms of bf16 steps, comma-separated (kinds of CONFIGS)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches of those steps")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of a micro-batch")
    args = parser.parse_args()
    from trainer_throughput import CONFIGS  # only the standalone run needs its (heavy) imports

    steps = {}
    for item in args.step_ms.split(","):
        kind, _, ms = item.partition("=")
        if kind not in CONFIGS:
            raise SystemExit(f"--step-ms: {kind!r} is not one of {sorted(CONFIGS)}")
        steps[kind] = (CONFIGS[kind], float(ms))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ceilings = report_all(steps, args.micro_batches, args.tokens)
    print("RESULT " + " ".join(f"fp8_ceiling_{kind}={value:.3f}" for kind, value in ceilings.items()))


if __name__ == "__main__":
    main()
