"""Variants of the expert-parallel run of bench/parallel_throughput.py, timed in the same processes
after the run's own steps (--ep-variants), with a breakdown of each step's all-to-all time.

A variant is "reference" or features joined by "+":
    packed     the routing rides in the rows' all-to-all: one exchange each way per layer instead
               of two (DispatchOptions.packed)
    unsharded  FSDP's sharded units gathered through the micro-batches, reduced once per step
               (ParallelConfig.accumulate_unsharded)
    dedup      each token sent only to the ranks holding one of its experts, the split sizes read
               back before the rows' exchange (DispatchOptions.dense_grid False; without it: the
               dispatcher's choice, the dense grid at ep=2)
    synced     the dense grid without padded copies: the number of copies comes to the host once
               per layer (DispatchOptions.padded_copies False)
    plainswiglu  the experts' SwiGLU as eager PyTorch's kernels, not models.moe's fused pass
    bincount   adds back what the dispatcher did before 2026-11-30: torch.bincount of the expert ids
               at the start of every layer's dispatch, which on CUDA reads the largest id back to
               the host (a second host sync per layer)
e.g. `--ep-variants unsharded packed+unsharded` (round 1's best, then the packed dispatch).
The row moves are the fused Triton ones in every variant, and split sizes read back come through
pinned memory (round 1 measured both ahead); without dedup or synced nothing is read back in a
layer (the dense grid with padded copies, 2026-11-30).

Breakdown per step, on rank 0: `a2a ms`, the time the compute stream spends from before to after
each all_to_all_single (counts, tokens and their routing, partial sums, and their backwards:
transfer plus waiting for the other ranks), summed; `a2a calls`; `wait ms`, the host's time
blocked on the split sizes; `retries`, the CUDA caching allocator's retries (a retry frees cached
blocks with cudaFree, which waits for the whole device: a stall of this rank that the other waits
out in its next all-to-all).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

FEATURES = ("packed", "unsharded", "dedup", "synced", "plainswiglu", "bincount")


def parse_variant(name: str) -> frozenset[str]:
    if name == "reference":
        return frozenset()
    features = frozenset(name.split("+"))
    unknown = features - set(FEATURES)
    if unknown or not features:
        raise ValueError(f"--ep-variants: {name!r} is not 'reference' or features of {FEATURES} joined by '+'")
    return features


def apply_variant(trainer, features: frozenset[str]) -> None:
    from primerl_trainer.distributed.expert_parallel import DispatchOptions
    from primerl_trainer.models.moe import MoE

    for module in trainer.model.modules():
        if isinstance(module, MoE) and module.dispatcher is not None:
            module.dispatcher.options = DispatchOptions(
                packed="packed" in features,
                dense_grid=False if "dedup" in features else None,
                padded_copies="synced" not in features,
            )
    trainer.accumulate_unsharded = "unsharded" in features
    from primerl_trainer.kernels import swiglu

    swiglu.FUSED_SWIGLU = "plainswiglu" not in features
    _bincount_sync("bincount" in features)


_ORIGINAL_CALL = None


def _bincount_sync(enabled: bool) -> None:
    import torch

    from primerl_trainer.distributed.expert_parallel import AllToAllDispatcher

    global _ORIGINAL_CALL
    if _ORIGINAL_CALL is None:
        _ORIGINAL_CALL = AllToAllDispatcher.__call__
    original = _ORIGINAL_CALL
    if not enabled:
        AllToAllDispatcher.__call__ = original
        return

    @torch.compiler.disable
    def with_bincount(self, x_TD, scores_TK, expert_ids_TK, experts):
        torch.bincount(expert_ids_TK.reshape(-1), minlength=self.ep * self.num_local_experts)
        return original(self, x_TD, scores_TK, expert_ids_TK, experts)

    AllToAllDispatcher.__call__ = with_bincount


@dataclasses.dataclass
class StepBreakdown:
    """What one step spent on rank 0 (see the module docstring)."""

    a2a_ms: float = 0.0
    a2a_calls: int = 0
    wait_ms: float = 0.0
    alloc_retries: int = 0


class AllToAllTimers:
    """Times every all_to_all_single on the calling stream (CUDA events; wall time on the CPU)
    and the host's waits for the split sizes, by wrapping both for this process; counts the
    caching allocator's retries."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Any]] = []
        self._cpu_s = 0.0
        self._wait_s = 0.0
        self._calls = 0
        self._retries = _alloc_retries()

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        from primerl_trainer.distributed import expert_parallel

        all_to_all_single = dist.all_to_all_single
        wait = expert_parallel._HostSizes.wait

        def timed_all_to_all(*args, **kwargs):
            self._calls += 1
            output = args[0] if args else kwargs["output"]
            if not output.is_cuda:
                start = time.perf_counter()
                result = all_to_all_single(*args, **kwargs)
                self._cpu_s += time.perf_counter() - start
                return result
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = all_to_all_single(*args, **kwargs)
            end.record()
            self._pairs.append((start, end))
            return result

        def timed_wait(sizes):
            start = time.perf_counter()
            try:
                return wait(sizes)
            finally:
                self._wait_s += time.perf_counter() - start

        dist.all_to_all_single = timed_all_to_all
        expert_parallel._HostSizes.wait = timed_wait

    def take(self) -> StepBreakdown:
        """What was spent since the last take."""
        import torch

        if self._pairs:
            torch.cuda.synchronize()
        retries = _alloc_retries()
        breakdown = StepBreakdown(
            a2a_ms=sum(start.elapsed_time(end) for start, end in self._pairs) + self._cpu_s * 1e3,
            a2a_calls=self._calls,
            wait_ms=self._wait_s * 1e3,
            alloc_retries=retries - self._retries,
        )
        self._pairs, self._cpu_s, self._wait_s, self._calls, self._retries = [], 0.0, 0.0, 0, retries
        return breakdown


def _alloc_retries() -> int:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def median_breakdown(breakdowns: list[StepBreakdown]) -> StepBreakdown:
    """Field by field; retries summed over the steps."""
    return StepBreakdown(
        a2a_ms=statistics.median(b.a2a_ms for b in breakdowns),
        a2a_calls=int(statistics.median(b.a2a_calls for b in breakdowns)),
        wait_ms=statistics.median(b.wait_ms for b in breakdowns),
        alloc_retries=sum(b.alloc_retries for b in breakdowns),
    )


def run_variants(trainer, batch, names: list[str], *, warmup: int, steps: int, timers: AllToAllTimers) -> list[dict]:
    """Each variant: `warmup` untimed steps, then the median of `steps` timed ones. Collective:
    every rank runs it; the peak is the largest over ranks."""
    import torch
    import torch.distributed as dist

    results = []
    for name in names:
        apply_variant(trainer, parse_variant(name))
        times, peaks, breakdowns = [], [], []
        for step in range(warmup + steps):
            timers.take()
            metrics = trainer.train_step(batch)
            breakdown = timers.take()
            if step >= warmup:
                times.append(metrics["step_time_s"])
                peaks.append(metrics["peak_memory_bytes"])
                breakdowns.append(breakdown)
        peak = torch.tensor([max(peaks)], dtype=torch.float64, device=next(trainer.model.parameters()).device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results.append(
            {"name": name, "step_s": statistics.median(times), "peak_bytes": float(peak)}
            | dataclasses.asdict(median_breakdown(breakdowns))
        )
    return results


def report_variants(variants: list[dict], *, tokens_per_step: int, nproc: int, baseline_tokens_per_s: float) -> None:
    """A table of the variants against the one-GPU run's per-GPU tokens/s."""
    if not variants:
        return
    print("\nep=2 variants (same processes, after the run's own steps; ep_scaling against 'moe 1 GPU'):")
    columns = ("step ms", "tok/s/GPU", "ep_scaling", "peak GiB", "a2a ms", "a2a calls", "wait ms", "retries")
    print(f"{'variant':<26} " + " ".join(f"{column:>10}" for column in columns))
    for variant in variants:
        per_gpu = tokens_per_step / variant["step_s"] / nproc
        print(
            f"{variant['name']:<26} {variant['step_s'] * 1e3:>10.0f} {per_gpu:>10.0f} "
            f"{per_gpu / baseline_tokens_per_s:>10.3f} {variant['peak_bytes'] / 2**30:>10.1f} "
            f"{variant['a2a_ms']:>10.0f} {variant['a2a_calls']:>10} {variant['wait_ms']:>10.0f} "
            f"{variant['alloc_retries']:>10}"
        )
