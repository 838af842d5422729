"""Training throughput of the trainer's own Qwen3-MoE and Qwen3 models against transformers'
implementations of the same checkpoints, on one GPU (bf16, packed rows of --seq-len tokens).

Both implementations are loaded through the model registry (impl="custom" / impl="hf") from the
same random checkpoint, written once in Hugging Face format, and take the same training steps on
the same tokens. A step is what the trainer's step is (train.Trainer.train_step): --micro-batches
micro-batches (default N = 8, i.e. 32,768 tokens per optimizer step at the default 4,096 tokens
per micro-batch), each a forward, next-token cross-entropy and backward whose gradients add up,
then one AdamW step (lr 1e-5, weight decay 0.01, torch's default betas and eps, for both). The
own models run as the trainer runs them: blocks compiled by their parallelize function, the
loss through the fused linear cross-entropy (kernels.linear_cross_entropy) on the hidden states,
and the trainer's optimizer (optim.build_optimizer: TritonAdamW on CUDA). Transformers' models
run as a user would run them: their own forward (the MoE's own expert code), bf16 logits and a
float32 cross-entropy, and torch's fastest AdamW (fused=True). A second own row takes
transformers' logits loss path, to show what the model and the loss each contribute. Gradient
clipping, which both would pay alike, is left out. Warm-up steps (compiling included) are left
out; figures are medians over --steps steps timed with CUDA events: the whole step, a step's
first micro-batch (fresh gradients), its later ones (gradients added to the held ones), the
optimizer step, and "1-mb step" = first micro-batch + optimizer step (a step of one micro-batch).

MFU = (6 * active parameters + causal attention) FLOPs per token * tokens/s / peak, where the
active parameters are the matrices a token passes through (attention, the dense or the top-k
experts' feed-forward, the router, the vocabulary projection; not the embedding lookup) and the
attention term is 6 * layers * heads * head_dim * seq_len / 2 per token (QK^T and PV, forward
and backward, half the square for causal masking). The peak is an 8192^3 bf16 matrix product
measured in the same run; its ratio to the 989 TFLOP/s datasheet figure is printed.

Last line: RESULT moe_speedup_vs_hf=<own MoE tokens/s over transformers', per step of N
micro-batches> dense_mfu=<own dense>
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pathlib
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from primerl_trainer.kernels import linear_cross_entropy
from primerl_trainer.models import load_model, model_spec_of
from primerl_trainer.models.hf import HFCausalLM
from primerl_trainer.optim import OptimizerConfig, build_optimizer

DATASHEET_BF16_TFLOPS = 989.0
# AdamW settings of both implementations (torch.optim.AdamW's default betas, eps and weight decay;
# the trainer's optimizer leaves norms undecayed, which costs nothing).
LR, WEIGHT_DECAY = 1e-5, 0.01

# Qwen3-1.7B-like attention and vocabulary; the MoE feed-forward of the Qwen3-30B-A3B family.
COMMON = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "use_cache": False,
}
CONFIGS = {
    "dense": COMMON
    | {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 6144,
        "tie_word_embeddings": True,
    },
    "moe": COMMON
    | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 6144,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
}
SMOKE = {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "num_experts": 8,
         "moe_intermediate_size": 64}  # fmt: skip


@dataclass
class Run:
    kind: str
    impl: str
    loss_path: str
    micro_batches: int = 0
    step_ms: float = float("nan")  # micro_batches forwards+backwards and the optimizer step
    forward_backward_ms: float = float("nan")  # a step's first micro-batch (fresh gradients)
    accumulating_ms: float = float("nan")  # a later micro-batch (its gradients added to the held ones)
    optimizer_ms: float = float("nan")
    one_micro_batch_step_ms: float = float("nan")  # forward_backward_ms + optimizer_ms
    tokens_per_s: float = float("nan")
    mfu: float = float("nan")
    first_step_s: float = float("nan")
    first_loss: float = float("nan")
    peak_gib: float = float("nan")
    error: str = ""


def flops_per_token(config: dict, seq_len: int) -> float:
    dim, num_layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = dim * head_dim * (2 * heads + 2 * kv_heads)
    if config["model_type"] == "qwen3_moe":
        feed_forward = 3 * dim * config["moe_intermediate_size"] * config["num_experts_per_tok"]
        feed_forward += dim * config["num_experts"]  # router
    else:
        feed_forward = 3 * dim * config["intermediate_size"]
    active = num_layers * (attention + feed_forward) + config["vocab_size"] * dim
    causal_attention = 6 * num_layers * heads * head_dim * seq_len / 2
    return 6 * active + causal_attention


def matmul_peak_tflops(size: int = 8192, repeats: int = 30) -> float:
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in times)
    return 2 * size**3 / ms / 1e9


def write_checkpoint(config: dict, path: pathlib.Path, device: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100GB")
    (path / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    del model


def check_linear_cross_entropy(vocab_size: int, dim: int, device: str) -> dict[str, float]:
    """Relative errors of the fused loss and its gradients against F.cross_entropy on float32
    logits, on bf16 inputs of the benchmark's vocabulary."""
    generator = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(1024, dim, device=device, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(vocab_size, dim, device=device, generator=generator) / dim**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab_size, (1024,), device=device, generator=generator)
    loss = linear_cross_entropy(hidden, weight, targets).loss
    loss.backward()
    fused = loss.detach(), hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    reference = F.cross_entropy((hidden @ weight.T).float(), targets)
    reference.backward()

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    return {
        "loss": relative(fused[0], reference),
        "grad_hidden": relative(fused[1], hidden.grad),
        "grad_weight": relative(fused[2], weight.grad),
    }


def train(model, optimizer, input_ids, targets, *, loss_path: str, micro_batches: int, warmup: int, steps: int,
          device: str):  # fmt: skip
    """One step = `micro_batches` forwards and backwards (gradients accumulating), then the
    optimizer step. Returns (per step: [forward+backward ms of each micro-batch], optimizer ms),
    the first step's wall seconds and the first loss."""

    def forward_backward() -> torch.Tensor:
        if loss_path == "fused":
            out = model(input_ids, compute_logits=False)
            loss = linear_cross_entropy(out.hidden_states[0], model.output_weight, targets).loss
        else:
            out = model(input_ids)
            loss = F.cross_entropy(out.logits[0].float(), targets)
        loss.backward()
        return loss.detach()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def clock():
        if device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(a, b) -> float:
        return a.elapsed_time(b) if device == "cuda" else (b - a) * 1e3

    synchronize()
    start = time.perf_counter()
    first_loss = forward_backward()
    for _ in range(micro_batches - 1):
        forward_backward()
    optimizer_step()
    synchronize()
    first_step_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        for _ in range(micro_batches):
            forward_backward()
        optimizer_step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks = []
    for _ in range(steps):
        step_marks = [clock()]
        for _ in range(micro_batches):
            forward_backward()
            step_marks.append(clock())
        optimizer_step()
        step_marks.append(clock())
        marks.append(step_marks)
    synchronize()
    parts = [([elapsed_ms(a, b) for a, b in itertools.pairwise(m[:-1])], elapsed_ms(m[-2], m[-1])) for m in marks]
    return parts, first_step_s, first_loss.item()


def bench_kind(kind: str, config: dict, path: pathlib.Path, args, peak_tflops: float, profile_dir) -> list[Run]:
    device = args.device
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config["vocab_size"], (1, args.seq_len), generator=generator).to(device)
    targets = torch.roll(input_ids[0], -1)
    targets[-1] = -100  # the last token predicts nothing
    flops = flops_per_token(config, args.seq_len)
    runs = []
    for impl in ("hf", "custom"):
        model = optimizer = None
        loss_paths = ["logits"] if impl == "hf" else ["fused", "logits"]
        try:
            model = load_model(path, impl=impl, dtype=torch.bfloat16, device=device)
            if impl == "custom" and not args.no_compile:
                model = model_spec_of(model).parallelize_fn(model, compile=True)
            assert isinstance(model, HFCausalLM) == (impl == "hf")
            if impl == "custom":  # the trainer's own optimizer (TritonAdamW on CUDA)
                optimizer = build_optimizer(model, OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY))
            else:  # what a user of transformers' model takes: torch's fastest AdamW
                optimizer = torch.optim.AdamW(
                    model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device == "cuda"
                )
            for loss_path in loss_paths:
                run = Run(kind, impl, loss_path, micro_batches=args.micro_batches)
                runs.append(run)
                try:
                    parts, run.first_step_s, run.first_loss = train(
                        model, optimizer, input_ids, targets, loss_path=loss_path,
                        micro_batches=args.micro_batches, warmup=args.warmup, steps=args.steps, device=device,
                    )  # fmt: skip
                    run.step_ms = statistics.median(sum(fbs) + opt for fbs, opt in parts)
                    run.forward_backward_ms = statistics.median(fbs[0] for fbs, _ in parts)
                    if args.micro_batches > 1:
                        run.accumulating_ms = statistics.median(fb for fbs, _ in parts for fb in fbs[1:])
                    run.optimizer_ms = statistics.median(opt for _, opt in parts)
                    run.one_micro_batch_step_ms = statistics.median(fbs[0] + opt for fbs, opt in parts)
                    run.tokens_per_s = args.micro_batches * args.seq_len / run.step_ms * 1e3
                    run.mfu = flops * run.tokens_per_s / (peak_tflops * 1e12)
                    if device == "cuda":
                        run.peak_gib = torch.cuda.max_memory_allocated() / 2**30
                    if profile_dir is not None and impl == "custom" and loss_path == "fused":
                        profile(model, optimizer, input_ids, targets, profile_dir / f"profile-{kind}.txt")
                except Exception as exc:  # one failing variant must not cost the others' numbers
                    run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                print(json.dumps(asdict(run)), flush=True)
        except Exception as exc:
            runs.append(Run(kind, impl, "-", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
            print(json.dumps(asdict(runs[-1])), flush=True)
        del model, optimizer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return runs


def profile(model, optimizer, input_ids, targets, out_path: pathlib.Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            out = model(input_ids, compute_logits=False)
            linear_cross_entropy(out.hidden_states[0], model.output_weight, targets).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    out_path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="moe,dense", help="comma-separated: moe, dense")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--micro-batches", type=int, default=8, help="micro-batches of --seq-len tokens per optimizer step"
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (compiling included)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps; medians are reported")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None, help="default: a temporary folder")
    parser.add_argument(
        "--profile-dir", type=pathlib.Path, default=None, help="write a kernel profile of the own models"
    )
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write every run as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (not a benchmark)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="own models uncompiled (smoke runs on the CPU)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in CONFIGS:
            raise ValueError(f"--kinds takes {sorted(CONFIGS)}, got {kind!r}")

    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        peak = matmul_peak_tflops()
    else:
        name, peak = args.device, 1.0  # smoke runs on the CPU: MFU meaningless
    print(f"device: {name}   torch {torch.__version__}", flush=True)
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s measured = {peak / DATASHEET_BF16_TFLOPS:.3f} of the "
          f"{DATASHEET_BF16_TFLOPS:.0f} datasheet", flush=True)  # fmt: skip
    configs = {
        kind: CONFIGS[kind] | ({k: v for k, v in SMOKE.items() if k in CONFIGS[kind]} if args.smoke else {})
        for kind in kinds
    }
    check = check_linear_cross_entropy(configs[kinds[0]]["vocab_size"], configs[kinds[0]]["hidden_size"], args.device)
    print("fused linear cross-entropy vs F.cross_entropy (bf16, relative error): "
          + ", ".join(f"{k} {v:.1e}" for k, v in check.items()), flush=True)  # fmt: skip

    runs: list[Run] = []
    # Checkpoints of ~11 GB: in memory where /dev/shm has room, else on disk.
    shm = pathlib.Path("/dev/shm")
    tmp_root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30 else None
    with tempfile.TemporaryDirectory(prefix="trainer-throughput-", dir=tmp_root) as tmp:
        root = args.checkpoint_dir or pathlib.Path(tmp)
        for kind in kinds:
            path = root / kind
            start = time.perf_counter()
            write_checkpoint(configs[kind], path, args.device)
            print(f"{kind}: checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
            runs += bench_kind(kind, configs[kind], path, args, peak, args.profile_dir)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))

    print()
    n = args.micro_batches
    print(f"one step = {n} micro-batch(es) of {args.seq_len} tokens, then AdamW; 'fwd+bwd' is a step's first "
          "micro-batch, 'accum' a later one (its gradients added to the held ones), "
          "'1-mb step' fwd+bwd + adamw")  # fmt: skip
    print(f"{'model':<6} {'impl':<7} {'loss':<7} {'step ms':>8} {'fwd+bwd':>8} {'accum':>6} {'adamw':>6} "
          f"{'1-mb step':>9} {'tokens/s':>9} {'MFU':>6} {'MFU@989':>8} {'peak GiB':>9} {'loss@0':>7} "
          f"{'1st step s':>10}")  # fmt: skip
    for r in runs:
        if r.error:
            print(f"{r.kind:<6} {r.impl:<7} {r.loss_path:<7} ERROR {r.error}")
            continue
        print(f"{r.kind:<6} {r.impl:<7} {r.loss_path:<7} {r.step_ms:>8.1f} {r.forward_backward_ms:>8.1f} "
              f"{r.accumulating_ms:>6.1f} {r.optimizer_ms:>6.1f} {r.one_micro_batch_step_ms:>9.1f} "
              f"{r.tokens_per_s:>9.0f} {r.mfu:>6.1%} {r.mfu * peak / DATASHEET_BF16_TFLOPS:>8.1%} "
              f"{r.peak_gib:>9.1f} {r.first_loss:>7.3f} {r.first_step_s:>10.1f}")  # fmt: skip

    def find(kind: str, impl: str, loss_path: str) -> Run | None:
        return next((r for r in runs if (r.kind, r.impl, r.loss_path) == (kind, impl, loss_path) and not r.error), None)

    hf_moe, own_moe, own_moe_logits = (
        find("moe", "hf", "logits"),
        find("moe", "custom", "fused"),
        find("moe", "custom", "logits"),
    )
    own_dense = find("dense", "custom", "fused")
    speedup = own_moe.tokens_per_s / hf_moe.tokens_per_s if hf_moe and own_moe else float("nan")
    if hf_moe and own_moe:
        ratios = {
            f"per step of {n} micro-batches": speedup,
            "forward+backward of a micro-batch": hf_moe.forward_backward_ms / own_moe.forward_backward_ms,
            "per step of 1 micro-batch": hf_moe.one_micro_batch_step_ms / own_moe.one_micro_batch_step_ms,
        }
        if n > 1:
            ratios["accumulating micro-batch"] = hf_moe.accumulating_ms / own_moe.accumulating_ms
        if own_moe_logits:
            ratios[f"own with transformers' logits loss path, per step of {n}"] = (
                own_moe_logits.tokens_per_s / hf_moe.tokens_per_s
            )
        print("\nMoE own / transformers: " + "; ".join(f"{v:.2f}x {k}" for k, v in ratios.items()))
    dense_mfu = own_dense.mfu if own_dense else float("nan")
    print(f"RESULT moe_speedup_vs_hf={speedup:.3f} dense_mfu={dense_mfu:.3f}")


if __name__ == "__main__":
    main()
