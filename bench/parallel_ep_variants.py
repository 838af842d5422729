"""Variants of the expert-parallel run of bench/parallel_throughput.py, timed in the same processes
after the run's own steps (--ep-variants), with a breakdown of each step's all-to-all time.

A variant is "reference" or features joined by "+":
    fused      the dispatch's row moves as Triton passes (DispatchOptions.fused_rows)
    early      split sizes through pinned memory and an event (DispatchOptions.early_sizes)
    unsharded  FSDP's sharded units gathered through the micro-batches, reduced once per step
               (ParallelConfig.accumulate_unsharded)
e.g. `--ep-variants reference fused fused+early fused+early+unsharded`.

Breakdown per step, on rank 0: `a2a ms`, the time the compute stream spends from before to after
each all_to_all_single (counts, tokens, routing, partial sums, and their backwards: transfer plus
waiting for the other ranks), summed; `wait ms`, the host's time blocked on the split sizes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

FEATURES = ("fused", "early", "unsharded")


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
            module.dispatcher.options = DispatchOptions(fused_rows="fused" in features, early_sizes="early" in features)
    trainer.accumulate_unsharded = "unsharded" in features


class AllToAllTimers:
    """Times every all_to_all_single on the calling stream (CUDA events; wall time on the CPU)
    and the host's waits for the split sizes, by wrapping both for this process."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Any]] = []
        self._cpu_s = 0.0
        self._wait_s = 0.0

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        from primerl_trainer.distributed import expert_parallel

        all_to_all_single = dist.all_to_all_single
        wait = expert_parallel._HostSizes.wait

        def timed_all_to_all(*args, **kwargs):
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

    def take(self) -> tuple[float, float]:
        """(all-to-all ms, wait ms) since the last take."""
        import torch

        if self._pairs:
            torch.cuda.synchronize()
        a2a_ms = sum(start.elapsed_time(end) for start, end in self._pairs) + self._cpu_s * 1e3
        wait_ms = self._wait_s * 1e3
        self._pairs, self._cpu_s, self._wait_s = [], 0.0, 0.0
        return a2a_ms, wait_ms


@dataclasses.dataclass
class VariantResult:
    name: str
    step_s: float
    peak_bytes: float
    a2a_ms: float
    wait_ms: float


def run_variants(trainer, batch, names: list[str], *, warmup: int, steps: int, timers: AllToAllTimers) -> list[dict]:
    """Each variant: `warmup` untimed steps, then the median of `steps` timed ones. Collective:
    every rank runs it; the peak is the largest over ranks."""
    import torch
    import torch.distributed as dist

    results = []
    for name in names:
        apply_variant(trainer, parse_variant(name))
        times, peaks, a2a, waits = [], [], [], []
        for step in range(warmup + steps):
            timers.take()
            metrics = trainer.train_step(batch)
            a2a_ms, wait_ms = timers.take()
            if step >= warmup:
                times.append(metrics["step_time_s"])
                peaks.append(metrics["peak_memory_bytes"])
                a2a.append(a2a_ms)
                waits.append(wait_ms)
        peak = torch.tensor([max(peaks)], dtype=torch.float64, device=next(trainer.model.parameters()).device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result = VariantResult(
            name, statistics.median(times), float(peak), statistics.median(a2a), statistics.median(waits)
        )
        results.append(dataclasses.asdict(result))
    return results


def report_variants(variants: list[dict], *, tokens_per_step: int, nproc: int, baseline_tokens_per_s: float) -> None:
    """A table of the variants against the one-GPU run's per-GPU tokens/s."""
    if not variants:
        return
    print("\nep=2 variants (same processes, after the run's own steps; ep_scaling against 'moe 1 GPU'):")
    columns = ("step ms", "tok/s/GPU", "ep_scaling", "peak GiB", "a2a ms", "wait ms")
    print(f"{'variant':<26} " + " ".join(f"{column:>10}" for column in columns))
    for variant in variants:
        per_gpu = tokens_per_step / variant["step_s"] / nproc
        print(
            f"{variant['name']:<26} {variant['step_s'] * 1e3:>10.0f} {per_gpu:>10.0f} "
            f"{per_gpu / baseline_tokens_per_s:>10.3f} {variant['peak_bytes'] / 2**30:>10.1f} "
            f"{variant['a2a_ms']:>10.0f} {variant['wait_ms']:>10.0f}"
        )
