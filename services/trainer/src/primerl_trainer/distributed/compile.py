"""torch.compile per transformer block: blocks repeat, so one compiled graph serves them
all, and the model's top level (mask building, input checks) stays eager."""

from torch import nn


def apply_compile(blocks: nn.ModuleDict, *, fullgraph: bool = True) -> None:
    """Compiles every block in place (Module.compile keeps the parameter names, unlike a
    torch.compile wrapper). Apply after activation checkpointing and before FSDP."""
    for block in blocks.values():
        block.compile(fullgraph=fullgraph)
