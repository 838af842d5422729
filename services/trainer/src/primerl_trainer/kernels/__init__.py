"""Fused GPU kernels the trainer shares between its models and its losses (each with a plain
PyTorch path that runs wherever Triton does not)."""

from primerl_trainer.kernels.cross_entropy import LinearCrossEntropyOutput, linear_cross_entropy

__all__ = ["LinearCrossEntropyOutput", "linear_cross_entropy"]
