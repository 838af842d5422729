"""Every mesh of N GPUs, with and without activation checkpointing: predicted memory and step time,
sorted (meshes that fit first, fastest first)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from primerl_trainer.planner.memory import MemoryEstimate, estimate_memory
from primerl_trainer.planner.mesh import Mesh, Workload, candidate_meshes
from primerl_trainer.planner.rates import GpuRates
from primerl_trainer.planner.shapes import ModelShape
from primerl_trainer.planner.timing import StepTime, estimate_step_time, model_flops_per_token

__all__ = ["PlanRow", "format_table", "plan"]

_GIB = 2**30


@dataclass(frozen=True)
class PlanRow:
    mesh: Mesh
    activation_checkpointing: bool
    memory: MemoryEstimate
    time: StepTime
    fits: bool
    tokens_per_s_per_gpu: float
    mfu: float


def plan(shape: ModelShape, world: int, workload: Workload, rates: GpuRates) -> list[PlanRow]:
    rows = []
    for mesh in candidate_meshes(shape, world, workload.seq_len):
        for checkpointing in (False, True):
            variant = dataclasses.replace(workload, activation_checkpointing=checkpointing)
            memory = estimate_memory(shape, mesh, variant, rates)
            time = estimate_step_time(shape, mesh, variant, rates)
            tokens_per_s = workload.tokens_per_step / time.total / world
            mfu = model_flops_per_token(shape, workload.seq_len) * tokens_per_s / (rates.peak_tflops * 1e12)
            rows.append(
                PlanRow(mesh, checkpointing, memory, time, memory.total <= rates.usable_bytes, tokens_per_s, mfu)
            )
    return sorted(rows, key=lambda row: (not row.fits, row.time.total))


def format_table(
    rows: list[PlanRow],
    shape: ModelShape,
    world: int,
    workload: Workload,
    rates: GpuRates,
    *,
    limit: int | None = None,
    configured: Mesh | None = None,
) -> str:
    """The rows as a table; `configured` (the config's mesh) is marked with a *."""
    lines = [
        f"{shape.name}: {shape.total_params / 1e9:.1f}B parameters, {shape.active_params / 1e9:.1f}B active"
        + (f" ({shape.note})" if shape.note else ""),
        f"{world} x {rates.gpu} ({rates.usable_bytes / _GIB:.0f} GiB usable each); {workload.tokens_per_step:,} tokens "
        f"per step in rows of {workload.seq_len:,}; master weights {8 * workload.master_bytes}-bit, compute "
        f"{8 * workload.compute_bytes}-bit; loss path {workload.loss}",
        f"{'mesh':<17} {'AC':<3} {'GiB/GPU':>8} {'states':>7} {'fsdp':>6} {'activ':>6} {'cp':>5} {'ep':>5} "
        f"{'logits':>6} {'fits':<4} {'step s':>8} {'comp':>7} {'lgprb':>6} {'copy':>6} {'fsdp':>6} {'ep':>6} {'cp':>6} "
        f"{'opt':>5} "
        f"{'tok/s/GPU':>9} {'MFU':>6}",
    ]
    shown = rows if limit is None else rows[:limit]
    if configured is not None:
        shown += [row for row in rows if row.mesh == configured and row not in shown]
    for row in shown:
        m, t = row.memory, row.time
        label = f"{row.mesh} *" if row.mesh == configured else str(row.mesh)
        lines.append(
            f"{label:<17} {'on' if row.activation_checkpointing else 'off':<3} {m.total / _GIB:>8.1f} "
            f"{m.states / _GIB:>7.1f} {m.fsdp / _GIB:>6.1f} {m.activations / _GIB:>6.1f} {m.cp / _GIB:>5.1f} "
            f"{m.ep / _GIB:>5.1f} {m.logits / _GIB:>6.1f} {'yes' if row.fits else 'no':<4} {t.total:>8.2f} "
            f"{t.compute:>7.2f} {t.logprobs:>6.2f} {t.copies:>6.2f} {t.fsdp:>6.2f} {t.ep:>6.2f} {t.cp:>6.2f} "
            f"{t.optimizer:>5.2f} "
            f"{row.tokens_per_s_per_gpu:>9.0f} {row.mfu:>6.1%}"
        )
    lines.append(
        "GiB parts: at the step's peak, the loss's backward (logits > 0), the largest layer's or the optimizer's"
    )
    if limit is not None and len(rows) > len(shown):
        lines.append(f"... {len(rows) - len(shown)} more (--top 0 shows all)")
    if configured is not None:
        lines.append(f"* the config's mesh (parallel.cp {configured.cp}, parallel.ep {configured.ep})")
    if not any(row.fits for row in rows):
        lines.append(f"no mesh of {world} GPUs fits: more GPUs, a shorter seq_len or bfloat16 master weights")
    return "\n".join(lines)
