"""Activation checkpointing per transformer block."""

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(blocks: nn.ModuleDict) -> None:
    """Wraps every block of `blocks` so that its activations are recomputed in backward
    (non-reentrant checkpointing; state dict names are unchanged).

    The RNG state is not saved: the blocks draw no random numbers (no dropout)."""
    for name, block in blocks.named_children():
        blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
