"""Training throughput of the trainer's own models against transformers' implementations of the
same checkpoints, on one GPU (bf16, packed rows of --seq-len tokens).

Two ways to pick the models:
- --kinds moe,dense (the default): a Qwen3-1.7B-like dense model and a Qwen3-30B-A3B-like MoE
  of 8 layers each (CONFIGS). Last line: RESULT moe_speedup_vs_hf=<own MoE tokens/s over
  transformers', per step of N micro-batches> dense_mfu=<own dense>.
- --fp8 (with --kinds, default moe_wide,moe,dense): the own model in bf16 against the own model
  with model.fp8 (block-scaled FP8 products of the blocks' linear layers and experts, models/fp8.py;
  --fp8-backend: scaled_mm or deep_gemm on Hopper; --fp8-weight-cache: model.fp8_weight_cache;
  --fp8-weight-grad: model.fp8_weight_grad), no
  transformers rows; moe_wide is the MoE at hidden 4096 with
  experts of 1536 (4 layers: ~11B parameters, ~90 GB of bf16 weights, gradients and AdamW moments).
  On a GPU it then prints each model's FP8 ceiling (bench/fp8_ceiling.py: the bf16 step's time in the
  products FP8 runs, and the speedup were those twice as fast and quantizing free).
  Last lines: fp8_speedup_dense=<FP8 tokens/s over bf16>, then RESULT fp8_speedup_moe_wide=<x>
  fp8_speedup_moe=<y>, per step of N micro-batches.
- --family glm4_moe,gpt_oss (or qwen3_5_moe,nemotron_h, the hybrids): a family of FAMILIES
  (bench/trainer_families.py: the family table, the fit, the parameter and FLOP counts) at its
  hub widths (hidden size, heads, expert count and width, vocabulary; the hybrids' linear
  layers too) with as many layers as fit one GPU with the optimizer (--layers auto, see
  fit_layers), the same for both implementations. Last line: RESULT <family>_speedup=<own
  tokens/s over transformers', per step of N micro-batches> per family (inf where only
  transformers ran out of memory, nan where a run failed otherwise; the line before says
  which). A family is one FAMILIES entry: its hub config, its tiny --smoke widths, its
  activation estimate for the fit, and which attention each implementation takes; a hybrid
  family adds its sequence length (16,384: the long rows where its linear layers matter), its
  least layer count (the pattern's first layers holding every kind) and its layer pattern. At
  that length transformers' float32 logits alone take ~16 B per logit (65 GB at Qwen3.5's
  vocabulary): where transformers' model cannot fit even the least layers, the fit is the own
  model's and transformers' run is expected to fail (out of memory); a failing run is shown in
  the table and the other implementation's still runs. --hf-step-limit-s cuts a transformers
  run whose first step is too slow to that step.

Both implementations load the same random checkpoint, written once in Hugging Face format (no
hub download), and take the same training steps on the same tokens. A step is what the
trainer's step is (train.Trainer.train_step): --micro-batches micro-batches (default N = 8, i.e.
32,768 tokens per optimizer step at 4,096 tokens per micro-batch), each a forward, next-token
cross-entropy and backward whose gradients add up, then one AdamW step (lr 1e-5, weight decay
0.01, torch's default betas and eps, for both). The own models run as the trainer runs them:
blocks compiled by their parallelize function, the loss through the fused linear cross-entropy
(kernels.linear_cross_entropy) on the hidden states, and the trainer's optimizer
(optim.build_optimizer: TritonAdamW on CUDA). Transformers' models run as a user would run them:
their own forward, uncompiled, with the attention and experts implementations transformers
picks by default on the device (a family may name a faster attention transformers offers there:
GPT-OSS's default, eager, materialises every score; flex_attention is its fused one), bf16
logits and a float32 cross-entropy, and torch's fastest AdamW (fused=True). The table names
each row's attention and experts implementation. A second own row takes transformers' logits
loss path, to show what the model and the loss each contribute. Gradient clipping, which both
would pay alike, is left out. Warm-up steps (compiling included) are left out; figures are
medians over --steps steps timed with CUDA events: the whole step, a step's first micro-batch
(fresh gradients), its later ones (gradients added to the held ones), the optimizer step, and
"1-mb step" = first micro-batch + optimizer step (a step of one micro-batch). Peak memory is
torch's max_memory_allocated over the timed steps.

MFU = (6 * active parameters + causal attention) FLOPs per token * tokens/s / peak, where the
active parameters are the matrices a token passes through (attention, the dense, shared and
top-k experts' feed-forward, the router, the vocabulary projection; not the embedding lookup),
counted on transformers' model built on the meta device, and the attention term is 6 * heads *
head_dim * (mean keys a query sees) per token and attention layer: seq_len / 2 for causal
layers, about the window for sliding-window ones (the linear layers' scans, Gated DeltaNet's
and Mamba-2's, are not counted: their projections are). The peak is an 8192^3 bf16 matrix product
measured in the same run; its ratio to the 989 TFLOP/s datasheet figure is printed.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from primerl_trainer.kernels import linear_cross_entropy
from primerl_trainer.kernels.fp8_linear import FP8_BACKENDS
from primerl_trainer.kernels.fp8_weight_cache import WEIGHT_CACHE
from primerl_trainer.models import load_model, model_spec_of
from primerl_trainer.models.moe import GroupedExperts, grouped_mm_supported
from primerl_trainer.optim import OptimizerConfig, build_optimizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from trainer_families import (
    FAMILIES,
    family_config,
    fit_layers,
    flops_per_token,
    layer_kinds,
    parameter_counts,
    predicted_peak_bytes,
)

DATASHEET_BF16_TFLOPS = 989.0
# AdamW settings of both implementations (torch.optim.AdamW's default betas, eps and weight decay;
# the trainer's optimizer leaves norms undecayed, which costs nothing).
LR, WEIGHT_DECAY = 1e-5, 0.01
SMOKE_SEQ_LEN = 256

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
# --fp8's wider MoE (issue 19): 4 layers fit one H200 with the optimizer (8 B per parameter).
CONFIGS["moe_wide"] = CONFIGS["moe"] | {"hidden_size": 4096, "moe_intermediate_size": 1536, "num_hidden_layers": 4}
SMOKE = {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "num_experts": 8,
         "moe_intermediate_size": 64}  # fmt: skip


@dataclass
class Run:
    kind: str  # the --kinds kind or the --family family
    impl: str
    loss_path: str
    micro_batches: int = 0
    layers: int = 0
    attention: str = ""  # the attention implementation this row ran
    experts: str = ""  # the experts implementation this row ran ("-" for a dense model)
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
    seq_len: int = 0
    note: str = ""  # e.g. a run cut to its first step by --hf-step-limit-s
    error: str = ""


@dataclass(frozen=True)
class Case:
    """One model the benchmark runs: its name, its config, and each implementation's attention."""

    name: str
    config: dict[str, Any]
    seq_len: int
    hf_attention: str | None = None
    own_attention: str = "sdpa"


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
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


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


def loss_function(model, impl: str, loss_path: str, input_ids: torch.Tensor, targets: torch.Tensor):
    """The micro-batch's loss: the own model's fused linear cross-entropy on its hidden states,
    or a float32 cross-entropy on bf16 logits (transformers' model is called as a user calls it:
    no cache, no router logits)."""

    def loss() -> torch.Tensor:
        if loss_path == "fused":
            out = model(input_ids, compute_logits=False)
            return linear_cross_entropy(out.hidden_states[0], model.output_weight, targets).loss
        logits = model(input_ids=input_ids, use_cache=False).logits if impl == "hf" else model(input_ids).logits
        return F.cross_entropy(logits[0].float(), targets)

    return loss


def train(
    loss_fn, optimizer, *, micro_batches: int, warmup: int, steps: int, device: str, time_limit_s: float | None = None
):
    """One step = `micro_batches` forwards and backwards (gradients accumulating), then the
    optimizer step. Returns (per step: [forward+backward ms of each micro-batch], optimizer ms),
    the first step's wall seconds, the first loss, and whether the run stopped after its first
    step because that took longer than `time_limit_s` (its parts are then the first step's)."""

    def forward_backward() -> torch.Tensor:
        loss = loss_fn()
        loss.backward()
        return loss.detach()

    def optimizer_step() -> None:
        WEIGHT_CACHE.clear()  # as the trainer's step does (model.fp8_weight_cache)
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

    def split(m: list) -> tuple[list[float], float]:
        return [elapsed_ms(a, b) for a, b in itertools.pairwise(m[:-1])], elapsed_ms(m[-2], m[-1])

    synchronize()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    first_marks = [clock()]
    first_loss = forward_backward()
    first_marks.append(clock())
    for _ in range(micro_batches - 1):
        forward_backward()
        first_marks.append(clock())
    optimizer_step()
    first_marks.append(clock())
    synchronize()
    first_step_s = time.perf_counter() - start
    if time_limit_s is not None and first_step_s > time_limit_s:
        return [split(first_marks)], first_step_s, first_loss.item(), True
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
    return [split(m) for m in marks], first_step_s, first_loss.item(), False


def load_hf_model(path: pathlib.Path, *, device: str, attention: str | None, experts: str | None):
    """transformers' model of the checkpoint, with its default attention and experts
    implementations unless named; returns it and the names it resolved to."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, str] = {}
    if attention:
        kwargs["attn_implementation"] = attention
    if experts:
        kwargs["experts_implementation"] = experts
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs).to(device).train()
    resolved_experts = getattr(model.config, "_experts_implementation", None) or "eager"
    has_experts = any(".experts." in name for name, _ in model.named_parameters())
    return model, model.config._attn_implementation, resolved_experts if has_experts else "-"


def load_own_model(
    path: pathlib.Path,
    *,
    device: str,
    attention: str,
    compile: bool,
    fp8_backend: str | None = None,
    fp8_weight_grad: str = "fp8",
):
    """The own model in bf16, as its parallelize function prepares it (no FSDP): compiled blocks,
    and with `fp8_backend` the blocks' products in FP8 (model.fp8, model.fp8_weight_grad)."""
    model = load_model(path, impl="custom", dtype=torch.bfloat16, device=device, attn_backend=attention)
    experts = {m.experts_impl for m in model.modules() if isinstance(m, GroupedExperts)}
    if not experts:
        experts_name = "-"
    elif fp8_backend is not None:
        experts_name = f"fp8 {fp8_backend}" + (" cached" if WEIGHT_CACHE.enabled else "")
        experts_name += " dW:dtype" if fp8_weight_grad == "model_dtype" else ""
    elif experts == {"auto"}:
        experts_name = "grouped_mm" if grouped_mm_supported(torch.device(device), torch.bfloat16) else "loop"
    else:
        experts_name = ",".join(sorted(experts))
    if compile or fp8_backend is not None:
        model = model_spec_of(model).parallelize_fn(
            model, compile=compile, fp8_backend=fp8_backend, fp8_weight_grad=fp8_weight_grad
        )
    return model.train(), attention + (" compiled" if compile else ""), experts_name


def bench_case(case: Case, path: pathlib.Path, args, peak_tflops: float, profile_dir) -> list[Run]:
    config, device, seq_len = case.config, args.device, case.seq_len
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config["vocab_size"], (1, seq_len), generator=generator).to(device)
    targets = torch.roll(input_ids[0], -1)
    targets[-1] = -100  # the last token predicts nothing
    flops = flops_per_token(config, seq_len)
    runs = []
    # "custom": the own model in bf16; "fp8": the same with model.fp8.
    for impl in ("custom", "fp8") if args.fp8 else ("hf", "custom"):
        model = optimizer = None
        loss_paths = ["logits"] if impl == "hf" else args.own_loss_paths.split(",")
        try:
            start = time.perf_counter()
            if impl == "hf":
                model, attention, experts = load_hf_model(
                    path, device=device, attention=case.hf_attention, experts=args.hf_experts
                )
                # what a user of transformers' model takes: torch's fastest AdamW
                optimizer = torch.optim.AdamW(
                    model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device == "cuda"
                )
            else:
                WEIGHT_CACHE.enabled = impl == "fp8" and args.fp8_weight_cache
                model, attention, experts = load_own_model(
                    path, device=device, attention=case.own_attention, compile=not args.no_compile,
                    fp8_backend=args.fp8_backend if impl == "fp8" else None, fp8_weight_grad=args.fp8_weight_grad,
                )  # fmt: skip
                # the trainer's own optimizer (TritonAdamW on CUDA)
                optimizer = build_optimizer(model, OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY))
            print(f"{case.name} {impl}: loaded in {time.perf_counter() - start:.0f} s "
                  f"(attention {attention}, experts {experts})", flush=True)  # fmt: skip
            for loss_path in loss_paths:
                run = Run(case.name, impl, loss_path, micro_batches=args.micro_batches, seq_len=seq_len,
                          layers=config["num_hidden_layers"], attention=attention, experts=experts)  # fmt: skip
                runs.append(run)
                try:
                    parts, run.first_step_s, run.first_loss, cut = train(
                        loss_function(model, impl, loss_path, input_ids, targets), optimizer,
                        micro_batches=args.micro_batches, warmup=args.warmup, steps=args.steps, device=device,
                        time_limit_s=args.hf_step_limit_s if impl == "hf" else None,
                    )  # fmt: skip
                    if cut:
                        run.note = f"first step only ({run.first_step_s:.0f} s > --hf-step-limit-s)"
                    run.step_ms = statistics.median(sum(fbs) + opt for fbs, opt in parts)
                    run.forward_backward_ms = statistics.median(fbs[0] for fbs, _ in parts)
                    if args.micro_batches > 1:
                        run.accumulating_ms = statistics.median(fb for fbs, _ in parts for fb in fbs[1:])
                    run.optimizer_ms = statistics.median(opt for _, opt in parts)
                    run.one_micro_batch_step_ms = statistics.median(fbs[0] + opt for fbs, opt in parts)
                    run.tokens_per_s = args.micro_batches * seq_len / run.step_ms * 1e3
                    run.mfu = flops * run.tokens_per_s / (peak_tflops * 1e12)
                    if device == "cuda":
                        run.peak_gib = torch.cuda.max_memory_allocated() / 2**30
                    if profile_dir is not None and impl != "hf" and loss_path == "fused":
                        suffix = "-fp8" if impl == "fp8" else ""
                        profile(model, optimizer, input_ids, targets, profile_dir / f"profile-{case.name}{suffix}.txt")
                except Exception as exc:  # one failing variant must not cost the others' numbers
                    run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                print(json.dumps(asdict(run)), flush=True)
                optimizer.zero_grad(set_to_none=True)
        except Exception as exc:
            runs.append(Run(case.name, impl, "-", layers=config["num_hidden_layers"], seq_len=seq_len,
                            error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))  # fmt: skip
            print(json.dumps(asdict(runs[-1])), flush=True)
        del model, optimizer
        if impl != "hf" and not args.no_compile:
            torch._dynamo.reset()  # compiled code must not keep this model's tensors alive
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return runs


def profile(model, optimizer, input_ids, targets, out_path: pathlib.Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            out = model(input_ids, compute_logits=False)
            linear_cross_entropy(out.hidden_states[0], model.output_weight, targets).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    averages = prof.key_averages()
    # The kernels' own rows (the CPU ops' rows repeat the time of the kernels they launched).
    kernels = [event for event in averages if event.device_type == torch.autograd.DeviceType.CUDA]
    kernels_ms = sum(event.self_device_time_total for event in kernels) / 1e3
    out_path.write_text(
        f"2 steps of one micro-batch and AdamW, profiled: wall {wall_ms:.1f} ms, GPU kernels {kernels_ms:.1f} ms "
        f"({kernels_ms / wall_ms:.0%} busy)\n"
        + averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        + "\nThe host's side (a GPU left idle waits on it), by self CPU time:\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90)
    )


def device_memory_bytes(args) -> float:
    if args.gpu_memory_gib is not None:
        return args.gpu_memory_gib * 2**30
    if args.device == "cuda":
        return float(torch.cuda.mem_get_info()[1])
    return 80e9  # a CPU run has no GPU to fit: an 80 GB card's figure, for --fit-only


def build_cases(args) -> list[Case]:
    if args.family is None:
        kinds = (args.kinds or ("moe_wide,moe,dense" if args.fp8 else "moe,dense")).split(",")
        for kind in kinds:
            if kind not in CONFIGS:
                raise ValueError(f"--kinds takes {sorted(CONFIGS)}, got {kind!r}")
        smoke = SMOKE if args.smoke else {}
        seq_len = args.seq_len or (SMOKE_SEQ_LEN if args.smoke else 4096)
        return [
            Case(kind, CONFIGS[kind] | {k: v for k, v in smoke.items() if k in CONFIGS[kind]}, seq_len)
            for kind in kinds
        ]

    budget = args.memory_fraction * device_memory_bytes(args)
    cases = []
    for name in args.family.split(","):
        if name not in FAMILIES:
            raise ValueError(f"--family takes {sorted(FAMILIES)}, got {name!r}")
        family = FAMILIES[name]
        seq_len = args.seq_len or (SMOKE_SEQ_LEN if args.smoke else family.seq_len)
        if args.layers is not None:
            layers = args.layers
        elif args.smoke:
            layers = family.min_layers
        else:
            layers, peak, fitted = fit_layers(family, seq_len, budget)
            fitted_config = family_config(family, layers, smoke=False)
            hf_peak, own_peak = (predicted_peak_bytes(family, fitted_config, seq_len, impl=i) for i in ("hf", "own"))
            notes = []
            if fitted == "own":
                notes.append("transformers' exceeds the budget at the least layers: the own model's fit, "
                             "transformers' run expected to fail")  # fmt: skip
            if peak > budget:
                notes.append("over the budget: the family's least layers")
            print(f"{name}: {layers} layers ({','.join(layer_kinds(fitted_config))}) at {seq_len} tokens for "
                  f"{budget / 2**30:.1f} GiB ({args.memory_fraction:.2f} of {device_memory_bytes(args) / 2**30:.1f}): "
                  f"predicted peak transformers' {hf_peak / 2**30:.1f} GiB, own {own_peak / 2**30:.1f} GiB"
                  + "".join(f"; {note}" for note in notes), flush=True)  # fmt: skip
        if layers < family.min_layers:
            raise ValueError(f"--layers {layers}: {name} needs at least {family.min_layers}")
        # The family's attentions are GPU paths (flex has no backward on the CPU); a CPU (smoke)
        # run takes each implementation's default.
        on_gpu = args.device == "cuda"
        config = family_config(family, layers, smoke=args.smoke)
        cases.append(Case(name, config, seq_len, hf_attention=family.hf_attention if on_gpu else None,
                          own_attention=family.own_attention if on_gpu else "sdpa"))  # fmt: skip
    return cases


def print_table(runs: list[Run], args, peak: float) -> None:
    n = args.micro_batches
    print(f"one step = {n} micro-batch(es) of 'seq' tokens, then AdamW; 'fwd+bwd' is a step's first "
          "micro-batch, 'accum' a later one (its gradients added to the held ones), "
          "'1-mb step' fwd+bwd + adamw")  # fmt: skip
    print(f"{'model':<11} {'L':>2} {'seq':>5} {'impl':<7} {'loss':<7} {'attention':<23} {'experts':<13} "
          f"{'step ms':>8} {'fwd+bwd':>8} {'accum':>6} {'adamw':>6} {'1-mb step':>9} {'tokens/s':>9} {'MFU':>6} "
          f"{'MFU@989':>8} {'peak GiB':>9} {'loss@0':>7} {'1st step s':>10}")  # fmt: skip
    for r in runs:
        head = (f"{r.kind:<11} {r.layers:>2} {r.seq_len:>5} {r.impl:<7} {r.loss_path:<7} {r.attention:<23} "
                f"{r.experts:<13}")  # fmt: skip
        if r.error:
            print(f"{head} ERROR {r.error}")
            continue
        print(f"{head} {r.step_ms:>8.1f} {r.forward_backward_ms:>8.1f} {r.accumulating_ms:>6.1f} "
              f"{r.optimizer_ms:>6.1f} {r.one_micro_batch_step_ms:>9.1f} {r.tokens_per_s:>9.0f} {r.mfu:>6.1%} "
              f"{r.mfu * peak / DATASHEET_BF16_TFLOPS:>8.1%} {r.peak_gib:>9.1f} {r.first_loss:>7.3f} "
              f"{r.first_step_s:>10.1f}" + (f"  {r.note}" if r.note else ""))  # fmt: skip


def find_run(runs: list[Run], name: str, impl: str, loss_path: str) -> Run | None:
    """The run of a model, implementation and loss path that did not fail."""
    return next((r for r in runs if (r.kind, r.impl, r.loss_path) == (name, impl, loss_path) and not r.error), None)


def speedups(runs: list[Run], names: list[str], n: int) -> dict[str, float]:
    """Own (fused loss) tokens/s over transformers' per model, printing the partial ratios."""

    def find(name: str, impl: str, loss_path: str) -> Run | None:
        return find_run(runs, name, impl, loss_path)

    result = {}
    for name in names:
        hf, own, own_logits = find(name, "hf", "logits"), find(name, "custom", "fused"), find(name, "custom", "logits")
        hf_errors = [r.error for r in runs if (r.kind, r.impl) == (name, "hf") and r.error]
        if own and not hf and hf_errors and all(e.startswith("OutOfMemoryError") for e in hf_errors):
            # the "transformers failing at that length": no finite ratio exists
            result[name] = float("inf")
            print(f"{name}: transformers runs out of memory at {own.seq_len} tokens, the own model trains at "
                  f"{own.tokens_per_s:.0f} tokens/s in {own.peak_gib:.1f} GiB: speedup inf")  # fmt: skip
            continue
        if not (hf and own):
            result[name] = float("nan")
            failed = [f"{r.impl} {r.loss_path}: {r.error}" for r in runs if r.kind == name and r.error]
            print(f"{name}: no ratio, a run failed: " + " | ".join(failed))
            continue
        result[name] = own.tokens_per_s / hf.tokens_per_s
        ratios = {
            f"per step of {n} micro-batches": result[name],
            "forward+backward of a micro-batch": hf.forward_backward_ms / own.forward_backward_ms,
            "per step of 1 micro-batch": hf.one_micro_batch_step_ms / own.one_micro_batch_step_ms,
        }
        if n > 1:
            ratios["accumulating micro-batch"] = hf.accumulating_ms / own.accumulating_ms
        if own_logits:
            ratios[f"own with transformers' logits loss path, per step of {n}"] = (
                own_logits.tokens_per_s / hf.tokens_per_s
            )
        cut = f" (transformers' {hf.note})" if hf.note else ""
        print(f"{name} own / transformers{cut}: " + "; ".join(f"{v:.2f}x {k}" for k, v in ratios.items()))
    return result


def fp8_speedups(runs: list[Run], names: list[str], n: int, loss_path: str) -> dict[str, float]:
    """--fp8: the own model's FP8 tokens/s over its bf16 ones per model (`loss_path` rows),
    printing the partial ratios, memory and first losses; nan where a run failed."""
    result = {}
    for name in names:
        bf16, fp8 = find_run(runs, name, "custom", loss_path), find_run(runs, name, "fp8", loss_path)
        if not (bf16 and fp8):
            result[name] = float("nan")
            failed = [f"{r.impl} {r.loss_path}: {r.error}" for r in runs if r.kind == name and r.error]
            print(f"{name}: no FP8 ratio, a run failed: " + " | ".join(failed))
            continue
        result[name] = fp8.tokens_per_s / bf16.tokens_per_s
        ratios = {
            f"per step of {n} micro-batches": result[name],
            "forward+backward of a micro-batch": bf16.forward_backward_ms / fp8.forward_backward_ms,
        }
        if n > 1:
            ratios["accumulating micro-batch"] = bf16.accumulating_ms / fp8.accumulating_ms
        print(f"{name} fp8 / bf16: " + "; ".join(f"{v:.2f}x {k}" for k, v in ratios.items())
              + f"; peak {bf16.peak_gib:.1f} -> {fp8.peak_gib:.1f} GiB; first loss {bf16.first_loss:.4f} -> "
              f"{fp8.first_loss:.4f}")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=None,
                        help="comma-separated: moe, dense, moe_wide (the default: moe,dense; with --fp8 "
                             "moe_wide,moe,dense)")  # fmt: skip
    parser.add_argument("--family", default=None, help=f"comma-separated, of {sorted(FAMILIES)}; instead of --kinds")
    parser.add_argument("--layers", type=int, default=None,
                        help="--family's layer count (default: as many as fit; --smoke: the least)")  # fmt: skip
    parser.add_argument("--memory-fraction", type=float, default=0.85,
                        help="the share of the GPU's memory the fitted layers' predicted peak may take")  # fmt: skip
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="fit for this much (default: the GPU's)")
    parser.add_argument("--fit-only", action="store_true", help="print the fitted layer counts and stop")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"default: each family's (4096; 16384 for the hybrids), --kinds 4096; --smoke "
                             f"{SMOKE_SEQ_LEN}")  # fmt: skip
    parser.add_argument(
        "--micro-batches", type=int, default=8, help="micro-batches of --seq-len tokens per optimizer step"
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (compiling included)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps; medians are reported")
    parser.add_argument("--own-loss-paths", default=None,
                        help="the own rows: fused and/or logits (default: fused,logits; with --fp8 fused)")  # fmt: skip
    parser.add_argument(
        "--fp8", action="store_true", help="the own model in bf16 against it with model.fp8 (no transformers rows)"
    )
    parser.add_argument("--fp8-backend", default="scaled_mm", choices=list(FP8_BACKENDS),
                        help="--fp8's products (model.fp8_backend): scaled_mm or deep_gemm (Hopper), emulated (any "
                        "device: CPU smoke)")  # fmt: skip
    parser.add_argument("--fp8-weight-cache", action="store_true",
                        help="--fp8 with model.fp8_weight_cache: expert weights quantized once a step")  # fmt: skip
    parser.add_argument("--fp8-weight-grad", default="fp8", choices=["fp8", "model_dtype"],
                        help="--fp8's model.fp8_weight_grad: weight gradients in FP8 or in bf16")  # fmt: skip
    parser.add_argument("--hf-experts", default=None, help="transformers' experts_implementation (default: its own)")
    parser.add_argument("--hf-step-limit-s", type=float, default=None,
                        help="a transformers run whose first step takes longer stops there and reports that "
                             "step (default: no limit)")  # fmt: skip
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None, help="default: a temporary folder")
    parser.add_argument(
        "--profile-dir", type=pathlib.Path, default=None, help="write a kernel profile of the own models"
    )
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write every run as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (not a benchmark)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="own models uncompiled (smoke runs on the CPU)")
    args = parser.parse_args()
    if args.family is not None and args.kinds is not None:
        raise ValueError("give --kinds or --family, not both")
    if args.fp8 and args.family is not None:
        raise ValueError("--fp8 runs the --kinds models, not --family")
    args.own_loss_paths = args.own_loss_paths or ("fused" if args.fp8 else "fused,logits")
    wall = time.perf_counter()
    cases = build_cases(args)
    if args.fit_only:
        return

    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        peak = matmul_peak_tflops()
    else:
        name, peak = args.device, 1.0  # smoke runs on the CPU: MFU meaningless
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the loading and writing bars, per checkpoint
    print(f"device: {name}   torch {torch.__version__}   transformers {transformers.__version__}", flush=True)
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s measured = {peak / DATASHEET_BF16_TFLOPS:.3f} of the "
          f"{DATASHEET_BF16_TFLOPS:.0f} datasheet", flush=True)  # fmt: skip
    check = check_linear_cross_entropy(cases[0].config["vocab_size"], cases[0].config["hidden_size"], args.device)
    print("fused linear cross-entropy vs F.cross_entropy (bf16, relative error): "
          + ", ".join(f"{k} {v:.1e}" for k, v in check.items()), flush=True)  # fmt: skip

    runs: list[Run] = []
    # Checkpoints of ~12 GB: in memory where /dev/shm has room, else on disk; each is removed
    # once its runs are done unless --checkpoint-dir keeps them.
    shm = pathlib.Path("/dev/shm")
    tmp_root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30 else None
    with tempfile.TemporaryDirectory(prefix="trainer-throughput-", dir=tmp_root) as tmp:
        root = args.checkpoint_dir or pathlib.Path(tmp)
        for case in cases:
            path = root / case.name
            start = time.perf_counter()
            total, active = parameter_counts(case.config)
            write_checkpoint(case.config, path, args.device)
            print(f"{case.name}: {case.config['num_hidden_layers']} layers, {total / 1e9:.2f}B parameters "
                  f"({active / 1e9:.2f}B active); checkpoint written in {time.perf_counter() - start:.0f} s",
                  flush=True)  # fmt: skip
            runs += bench_case(case, path, args, peak, args.profile_dir)
            if args.checkpoint_dir is None:
                shutil.rmtree(path)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))

    print()
    print_table(runs, args, peak)
    print()
    names = [case.name for case in cases]
    if args.fp8:
        loss_path = args.own_loss_paths.split(",")[0]
        result = fp8_speedups(runs, names, args.micro_batches, loss_path)
        if args.device == "cuda":
            # What FP8 could gain at most on these bf16 steps (fp8_ceiling.py), next to what it did.
            from fp8_ceiling import report_all

            bf16 = {c.name: find_run(runs, c.name, "custom", loss_path) for c in cases}
            bf16_steps = {c.name: (c.config, bf16[c.name].step_ms) for c in cases if bf16[c.name]}
            report_all(bf16_steps, args.micro_batches, cases[0].seq_len)
        print(f"wall: {time.perf_counter() - wall:.0f} s")
        print(f"fp8_speedup_dense={result.get('dense', float('nan')):.3f}")
        print(f"RESULT fp8_speedup_moe_wide={result.get('moe_wide', float('nan')):.3f} "
              f"fp8_speedup_moe={result.get('moe', float('nan')):.3f}")  # fmt: skip
        return
    result = speedups(runs, names, args.micro_batches)
    print(f"wall: {time.perf_counter() - wall:.0f} s")
    if args.family is not None:
        print("RESULT " + " ".join(f"{name}_speedup={value:.3f}" for name, value in result.items()))
        return
    own_dense = next((r for r in runs if (r.kind, r.impl, r.loss_path) == ("dense", "custom", "fused")), None)
    dense_mfu = own_dense.mfu if own_dense and not own_dense.error else float("nan")
    print(f"RESULT moe_speedup_vs_hf={result.get('moe', float('nan')):.3f} dense_mfu={dense_mfu:.3f}")


if __name__ == "__main__":
    main()
