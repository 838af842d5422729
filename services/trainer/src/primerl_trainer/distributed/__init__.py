"""Model-agnostic parallelism helpers (FSDP2, activation checkpointing, compile) that each
model's parallelize.py composes."""

from primerl_trainer.distributed.activation_checkpoint import apply_activation_checkpointing
from primerl_trainer.distributed.compile import apply_compile
from primerl_trainer.distributed.fsdp import apply_fsdp

__all__ = ["apply_activation_checkpointing", "apply_compile", "apply_fsdp"]
