"""The meshes the trainer can build over N GPUs, and the workload one step carries.

The trainer's mesh (config `parallel`): FSDP2 shards every parameter over all N ranks; the
batch's micro-batches are split over dp = N / cp ranks, each micro-batch's sequence over the cp
ranks of one context-parallel group; each MoE layer's experts over ep ranks (ep divides N and
the number of experts, and is a multiple of cp), whose expert weights FSDP then shards over the
remaining N / ep. Ranks are laid out ep innermost (cp inside it), so a group of at most
`gpus_per_node` ranks stays inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from primerl_trainer.planner.shapes import ModelShape

__all__ = ["Mesh", "Workload", "candidate_meshes"]


@dataclass(frozen=True)
class Mesh:
    world: int
    ep: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        """Ranks that take different micro-batches."""
        return self.world // self.cp

    def problem(self, shape: ModelShape, seq_len: int) -> str | None:
        """Why the trainer would refuse this mesh for `shape`, or None."""
        if self.world % self.cp:
            return f"cp {self.cp} does not divide {self.world} GPUs"
        if self.world % self.ep:
            return f"ep {self.ep} does not divide {self.world} GPUs"
        if self.ep > 1 and not shape.is_moe:
            return "ep > 1 needs a MoE model"
        if self.ep > 1 and shape.num_experts % self.ep:
            return f"ep {self.ep} does not divide {shape.num_experts} experts"
        if self.ep > 1 and self.ep % self.cp:
            return f"ep {self.ep} is not a multiple of cp {self.cp}"
        if seq_len % (2 * self.cp):
            return f"seq_len {seq_len} is not a multiple of 2 * cp (the load-balanced causal split)"
        return None

    def __str__(self) -> str:
        return f"dp{self.dp} cp{self.cp} ep{self.ep}"


@dataclass(frozen=True)
class Workload:
    """One optimizer step: `tokens_per_step` tokens in packed rows (micro-batches) of `seq_len`."""

    seq_len: int
    tokens_per_step: int
    master_bytes: int = 4  # model.dtype: float32 4, bfloat16 2 (parameters, gradients, AdamW moments)
    compute_bytes: int = 2  # model.compute_dtype
    activation_checkpointing: bool = False
    # "logits": the trainer's loss path (logits materialised, logprobs in chunks); "fused": the
    # fused linear cross-entropy (bench/trainer_throughput.py's), no logits.
    loss: Literal["logits", "fused"] = "logits"
    # parallel.accumulate_unsharded: the sharded FSDP units stay gathered through a step's
    # micro-batches, their float32 gradients accumulate unsharded and reduce once per step.
    accumulate_unsharded: bool = False
    # model.fp8: the blocks' products in FP8, counted at the compute dtype's rates (on an H200 an
    # FP8 MoE step ran at 0.7-0.99x of bf16: bench/results/trainer_throughput-fp8-weight-grad-
    # 2026-11-30.txt); FP8 experts take no padded copies, so the EP dense grid's forward makes the
    # all-to-all call of the copy counts too (timing.EP_CALLS_FORWARD, not _DENSE_GRID).
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.tokens_per_step <= 0:
            raise ValueError("seq_len and tokens_per_step must be positive")

    def micro_batches_per_rank(self, mesh: Mesh) -> int:
        """Micro-batches each data-parallel rank takes per step (the last may be partly empty)."""
        rows = -(-self.tokens_per_step // self.seq_len)
        return -(-rows // mesh.dp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(shape: ModelShape, world: int, seq_len: int) -> list[Mesh]:
    """Every mesh of `world` GPUs the trainer accepts for this shape."""
    meshes = []
    for cp in _divisors(world):
        for ep in _divisors(world) if shape.is_moe else [1]:
            mesh = Mesh(world=world, ep=ep, cp=cp)
            if mesh.problem(shape, seq_len) is None:
                meshes.append(mesh)
    return meshes
