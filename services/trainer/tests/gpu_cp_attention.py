"""Context parallel attention of one-sample rows on one GPU: distributed/cp_attention.py's
chunked_causal_attention (cuDNN kernels: a rectangle and a causal square per zig-zag chunk,
merged by log-sum-exp) against the path it replaces (the flash aten op per chunk, causal lower
right, as attention.py had it) and against plain causal SDPA on cuDNN over the whole row (the
cp=1 kernels; half its time is one cp=2 rank's share of the work), for the bench's dense shape
(16 query heads, 8 key/value heads, head dim 128, bfloat16) and a row of 131,072 tokens split
over cp=2: forward and backward times per rank, and the largest differences from the replaced
path. First, on a row of 4,096 tokens, each path's largest error against float32 softmax
attention. From the repository root, on a machine with torch and one CUDA GPU (under 2 minutes
on an H100):

    python3 services/trainer/tests/gpu_cp_attention.py

Imports only torch and the module itself (by file). Exit status 1 when a path fails or the
new path is further from the reference than the replaced one allows.
"""

import importlib.util
import math
import pathlib
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODULE = ROOT / "services/trainer/src/primerl_trainer/distributed/cp_attention.py"
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
SEQ, CP = 131_072, 2
WARMUP, ITERS = 1, 3


def load_cp_attention():
    spec = importlib.util.spec_from_file_location("primerl_cp_attention", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def starts_of(rank: int, seq: int) -> tuple[int, int]:
    chunk_len = seq // (2 * CP)
    return rank * chunk_len, (2 * CP - 1 - rank) * chunk_len


def flash_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts) -> torch.Tensor:
    """The replaced path (attention.py before cp_attention.py): per chunk, plain causal SDPA when it
    starts the row, else the flash aten op (causal lower right over the keys up to its end)."""
    chunk_len = q.shape[2] // len(starts)
    outs = []
    for query_chunk, start in zip(q.split(chunk_len, dim=2), starts, strict=True):
        end = start + chunk_len
        if start == 0:
            outs.append(
                F.scaled_dot_product_attention(
                    query_chunk, k[:, :, :end], v[:, :, :end], is_causal=True, enable_gqa=True
                )
            )
        else:
            outs.append(
                torch.ops.aten._scaled_dot_product_flash_attention(
                    query_chunk, k[:, :, :end], v[:, :, :end], 0.0, True
                )[0]
            )
    return torch.cat(outs, dim=2)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts) -> torch.Tensor:
    """float32 softmax attention with an explicit mask."""
    q, k, v = (
        q.float(),
        k.float().repeat_interleave(HEADS // KV_HEADS, 1),
        v.float().repeat_interleave(HEADS // KV_HEADS, 1),
    )
    chunk_len = q.shape[2] // len(starts)
    positions = torch.cat([torch.arange(start, start + chunk_len, device=q.device) for start in starts])
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(positions[:, None] < torch.arange(k.shape[2], device=q.device), float("-inf"))
    return torch.softmax(scores, -1) @ v


def inputs(num_queries: int, num_keys: int, seed: int):
    """Leaves laid out as the model has them: q [1, t, H, D], keys and values halves of one
    gathered [1, N, Hkv, 2D] tensor, the output's gradient [1, t, H, D]."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, num_queries, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    kv = torch.randn(1, num_keys, KV_HEADS, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad = torch.randn(1, num_queries, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    return q.requires_grad_(), kv.requires_grad_(), grad


def run(fn, q_leaf, kv_leaf, grad, *, iters: int):
    """(median forward ms, median backward ms, out, dq, dkv) of fn over the model's layout."""
    forward, backward = [], []
    for i in range(WARMUP + iters):
        q_leaf.grad = kv_leaf.grad = None
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        k, v = (half.transpose(1, 2) for half in kv_leaf.chunk(2, dim=-1))
        out = fn(q_leaf.transpose(1, 2), k, v).transpose(1, 2)
        events[1].record()
        out.backward(grad)
        events[2].record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            forward.append(events[0].elapsed_time(events[1]))
            backward.append(events[1].elapsed_time(events[2]))
    return statistics.median(forward), statistics.median(backward), out.detach(), q_leaf.grad, kv_leaf.grad


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main() -> int:
    cp_attention = load_cp_attention()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    failed = False

    # Accuracy on a short row: each path against float32 softmax attention.
    small = 4096
    print(f"\nerrors against float32 softmax attention, row of {small} tokens split over cp={CP} (bf16)")
    print(f"{'path':<10}{'rank':>5}{'out':>11}{'dq':>11}{'dkv':>11}")
    for rank in range(CP):
        starts = starts_of(rank, small)
        q_leaf, kv_leaf, grad = inputs(small // CP, small, seed=rank)
        *_, want_out, want_dq, want_dkv = run(
            lambda q, k, v, s=starts: reference(q, k, v, s).to(torch.bfloat16), q_leaf, kv_leaf, grad, iters=1
        )
        errors = {}
        for name, fn in (("flash", flash_chunks), ("cudnn", cp_attention.chunked_causal_attention)):
            try:
                *_, out, dq, dkv = run(lambda q, k, v, f=fn, s=starts: f(q, k, v, s), q_leaf, kv_leaf, grad, iters=1)
            except Exception:
                traceback.print_exc()
                print(f"FAIL: {name}, rank {rank}")
                failed = True
                continue
            errors[name] = (max_diff(out, want_out), max_diff(dq, want_dq), max_diff(dkv, want_dkv))
            print(f"{name:<10}{rank:>5}" + "".join(f"{e:>11.2e}" for e in errors[name]))
        # bf16 rounding: the new path may differ from the reference by a few of the old path's errors.
        if len(errors) == 2 and any(
            new > 4 * old + 1e-2 for new, old in zip(errors["cudnn"], errors["flash"], strict=True)
        ):
            print(f"FAIL: cudnn path's errors {errors['cudnn']} against flash's {errors['flash']}")
            failed = True

    # Speed on the long row.
    print(
        f"\nrow of {SEQ} tokens, cp={CP}: per rank {SEQ // CP} queries over {SEQ} keys;"
        f" H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}"
    )
    print(f"{'path':<38}{'fwd ms':>9}{'bwd ms':>9}{'total':>9}{'x cp=1':>8}   max |diff| vs flash: out, dq, dkv")
    q_full, kv_full, grad_full = inputs(SEQ, SEQ, seed=7)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        fwd, bwd, *_ = run(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            q_full,
            kv_full,
            grad_full,
            iters=ITERS,
        )
    ideal = (fwd + bwd) / CP
    print(f"{'cudnn causal, whole row, / cp':<38}{fwd / CP:>9.1f}{bwd / CP:>9.1f}{ideal:>9.1f}{1.0:>8.2f}")
    del q_full, kv_full, grad_full
    for rank in range(CP):
        starts = starts_of(rank, SEQ)
        q_leaf, kv_leaf, grad = inputs(SEQ // CP, SEQ, seed=rank)
        results = {}
        for name, fn in (
            ("flash chunks (replaced)", flash_chunks),
            ("cudnn chunks (cp_attention)", cp_attention.chunked_causal_attention),
        ):
            try:
                results[name] = run(lambda q, k, v, f=fn, s=starts: f(q, k, v, s), q_leaf, kv_leaf, grad, iters=ITERS)
            except Exception:
                traceback.print_exc()
                print(f"FAIL: {name}, rank {rank}")
                failed = True
                continue
            fwd, bwd, out, dq, dkv = results[name]
            diffs = ""
            if name != "flash chunks (replaced)" and "flash chunks (replaced)" in results:
                _, _, base_out, base_dq, base_dkv = results["flash chunks (replaced)"]
                diffs = f"   {max_diff(out, base_out):.2e}, {max_diff(dq, base_dq):.2e}, {max_diff(dkv, base_dkv):.2e}"
            label = f"{name}, rank {rank}"
            print(f"{label:<38}{fwd:>9.1f}{bwd:>9.1f}{fwd + bwd:>9.1f}{(fwd + bwd) / ideal:>8.2f}{diffs}")
        del results, q_leaf, kv_leaf, grad
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
