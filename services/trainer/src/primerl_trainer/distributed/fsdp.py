"""FSDP2 (torch.distributed.fsdp.fully_shard) for decoder models laid out the torchtitan way:
`tok_embeddings`, `layers` (a ModuleDict of blocks), `norm` and `lm_head` (None when the head
is tied to the embedding)."""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
) -> None:
    """Shards each block as one unit, then the embedding and the head, then the root.

    param_dtype is the dtype blocks compute in (None: the parameters' own); gradients are
    reduced in reduce_dtype. `shard_placement_fn` picks a parameter's sharded dim (None:
    dim 0), e.g. for expert weights when there are more ranks than experts."""
    config = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "shard_placement_fn": shard_placement_fn,
    }
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **config)
    if model.lm_head is not None:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **config)
        # Backward needs the head first: keeping it gathered after forward saves an all-gather.
        fully_shard([model.norm, model.lm_head], reshard_after_forward=False, **config)
    # A tied head reads the embedding's weight outside the embedding's forward, so both stay
    # with the root, whose parameters are gathered for the whole forward.
    fully_shard(model, **config)
