"""FP8 training against bf16 training of the same model, from the same initial weights on the same
data (issue 19): --steps optimizer steps (default 300) of trainer_throughput.py's MoE shape
(Qwen3-30B-A3B-like: hidden 2048, 128 experts of 768, top-8, vocabulary 151,936) with --layers
layers, once in bf16 and once with model.fp8 (--fp8-backend), printing both losses every
--log-every steps and their final relative difference.

Both runs train as the trainer does: float32 master weights and AdamW moments, FSDP2 over this
one process (bf16 compute, float32 gradient reduction), blocks compiled by the model's
parallelize function (unless --no-compile), gradients clipped to norm 1, the trainer's optimizer
(TritonAdamW on CUDA) at --lr after --warmup-steps of linear warmup, the loss a float32
cross-entropy of the next token over the model's logits. A step is --micro-batches rows of
--seq-len tokens, gradients accumulated.

The data are learnable, so that the losses fall and a drift of FP8 from bf16 would show: rows of
a fixed random Markov chain over the first --markov-vocab token ids, each id followed by one of
--branching successors with equal odds (a loss floor of ln(branching), 1.39 nats at 4, from ~12
at the start). Every step has fresh rows, the same in both runs.

"Final loss" is the mean over the last --final-window steps (one step's loss is a noisy figure of
the model). Last line: RESULT fp8_final_loss_rel_diff=<|FP8 - bf16| / bf16 of the final losses>;
the run also checks that neither run diverged (finite losses, the final loss below the first).

Two layers by default: an FP8 MoE layer's experts run one product after another on the host (no
fused grouped FP8 kernel yet, kernels/fp8_linear.py), ~0.1-0.2 s per layer and step on an H200 by
estimate, so that both runs, compiling and loading included, stay within ~3-4 minutes.

    python bench/fp8_convergence.py                          # H200: ~3-4 minutes (estimate)
    python bench/fp8_convergence.py --smoke --device cpu     # the script itself, emulated FP8, < 1 minute
"""

from __future__ import annotations

import argparse
import gc
import math
import pathlib
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from trainer_throughput import CONFIGS, SMOKE, loss_function, write_checkpoint

from primerl_trainer.models import load_model, model_spec_of
from primerl_trainer.optim import (
    LRScheduleConfig,
    OptimizerConfig,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
)
from primerl_trainer.process_group import init_distributed


def markov_rows(num_rows: int, seq_len: int, *, vocab: int, branching: int, seed: int) -> torch.Tensor:
    """[num_rows, seq_len] int64 token ids of the fixed chain of `seed` (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branching), generator=generator)
    choices = torch.randint(0, branching, (num_rows, seq_len), generator=generator)
    rows = torch.empty(num_rows, seq_len, dtype=torch.int64)
    rows[:, 0] = torch.randint(0, vocab, (num_rows,), generator=generator)
    for t in range(1, seq_len):
        rows[:, t] = successors[rows[:, t - 1], choices[:, t]]
    return rows


def train_run(path: pathlib.Path, data: torch.Tensor, args, *, fp8_backend: str | None) -> list[float]:
    """One run from the checkpoint at `path`: the loss of every step (mean over its micro-batches)."""
    device = torch.device(args.device)
    model = load_model(path, impl="custom", dtype=torch.float32, device="cpu")
    mesh = init_device_mesh(device.type, (1,))
    model_spec_of(model).parallelize_fn(
        model,
        dp_mesh=mesh,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        compile=not args.no_compile,
        fp8_backend=fp8_backend,
    )
    model.train()
    optimizer = build_optimizer(model, OptimizerConfig(lr=args.lr, weight_decay=0.01))
    scheduler = build_lr_scheduler(optimizer, LRScheduleConfig(warmup_steps=args.warmup_steps))
    name = "bf16" if fp8_backend is None else f"fp8 ({fp8_backend})"
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        total = 0.0
        for row in data[step * args.micro_batches : (step + 1) * args.micro_batches].to(device):
            targets = torch.roll(row, -1)
            targets[-1] = -100
            loss = loss_function(model, "custom", "logits", row[None], targets)() / args.micro_batches
            loss.backward()
            total += loss.detach()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"{name:<16} step {step + 1:>4}: loss {losses[-1]:.4f}  ({time.perf_counter() - start:.0f} s)",
                  flush=True)  # fmt: skip
    del model, optimizer
    if not args.no_compile:
        torch._dynamo.reset()  # compiled code must not keep this model's tensors alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2, help="MoE layers (--smoke: the smoke shape's 2)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per row (--smoke: 64)")
    parser.add_argument("--micro-batches", type=int, default=1, help="rows per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--markov-vocab", type=int, default=4096, help="token ids the chain uses (--smoke: 64)")
    parser.add_argument("--branching", type=int, default=4, help="successors of each id in the chain")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--final-window", type=int, default=10, help="last steps averaged into the final loss")
    parser.add_argument("--fp8-backend", default="scaled_mm", choices=["scaled_mm", "emulated"],
                        help="scaled_mm (Hopper) or emulated (any device; the default with --device cpu)")  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="blocks uncompiled (the default on the CPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and 12 steps, to check the script")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.smoke:
        args.steps = min(args.steps, 12)
        args.seq_len, args.log_every, args.lr, args.warmup_steps, args.final_window = 64, 4, 3e-3, 2, 4
        args.markov_vocab = min(args.markov_vocab, 64)
    if args.device == "cpu":
        args.fp8_backend, args.no_compile = "emulated", True
    config = CONFIGS["moe"] | {"num_hidden_layers": args.layers}
    if args.smoke:
        config |= {k: v for k, v in SMOKE.items() if k in config}
    args.markov_vocab = min(args.markov_vocab, config["vocab_size"])

    wall = time.perf_counter()
    init_distributed(args.device)
    try:
        print(f"MoE: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {config['num_experts']} "
              f"experts of {config['moe_intermediate_size']} (top-{config['num_experts_per_tok']}), "
              f"vocabulary {config['vocab_size']}; {args.steps} steps of {args.micro_batches} x {args.seq_len} tokens, "
              f"lr {args.lr} after {args.warmup_steps} warmup steps; Markov chain over {args.markov_vocab} ids, "
              f"{args.branching} successors each (floor {math.log(args.branching):.3f}); FP8 backend "
              f"{args.fp8_backend}, {'eager' if args.no_compile else 'compiled'} blocks", flush=True)  # fmt: skip
        data = markov_rows(args.steps * args.micro_batches, args.seq_len, vocab=args.markov_vocab,
                           branching=args.branching, seed=args.seed)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="fp8-convergence-") as tmp:
            path = pathlib.Path(tmp) / "moe"
            write_checkpoint(config, path, args.device)
            bf16 = train_run(path, data, args, fp8_backend=None)
            fp8 = train_run(path, data, args, fp8_backend=args.fp8_backend)
    finally:
        dist.destroy_process_group()

    print()
    print(f"{'step':>5} {'bf16':>8} {'fp8':>8} {'rel diff':>9}")
    for step in sorted({0, *range(args.log_every - 1, args.steps, args.log_every), args.steps - 1}):
        print(f"{step + 1:>5} {bf16[step]:>8.4f} {fp8[step]:>8.4f} {abs(fp8[step] - bf16[step]) / bf16[step]:>9.2%}")
    window = min(args.final_window, args.steps)
    final_bf16, final_fp8 = (sum(losses[-window:]) / window for losses in (bf16, fp8))
    rel_diff = abs(final_fp8 - final_bf16) / final_bf16
    for name, losses, final in (("bf16", bf16, final_bf16), ("fp8", fp8, final_fp8)):
        if not all(math.isfinite(loss) for loss in losses):
            verdict = "  DIVERGED: a non-finite loss"
        elif final >= losses[0]:
            verdict = "  DIVERGED: the final loss is not below the first"
        else:
            verdict = ""
        print(f"{name}: first loss {losses[0]:.4f}, final (mean of the last {window}) {final:.4f}{verdict}")
    print(f"final losses differ by {rel_diff:.2%} (goal: within 1.5%); wall {time.perf_counter() - wall:.0f} s")
    print(f"RESULT fp8_final_loss_rel_diff={rel_diff:.4f}")


if __name__ == "__main__":
    main()
