"""FSDP2 (torch.distributed.fsdp.fully_shard) for decoder models laid out the torchtitan way:
`tok_embeddings`, `layers` (a ModuleDict of blocks, mixture-of-experts ones with their routed
experts at `moe.experts`), `norm` and `lm_head` (None when the head is tied to the embedding)."""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    experts_mesh: DeviceMesh | None = None,
    gradient_divide_factor: float | None = None,
) -> None:
    """Shards each block as one unit, then the embedding and the head, then the root.

    param_dtype is the dtype blocks compute in (None: the parameters' own); gradients are
    reduced in reduce_dtype. `shard_placement_fn` picks a parameter's sharded dim (None:
    dim 0), e.g. for expert weights when there are more ranks than experts.

    `experts_mesh` (expert parallel): each block's routed experts (`moe.experts`, their weights
    DTensors on the ep mesh) become a unit of their own sharded over this mesh
    (efsdp), on dim 0, or dim 1 where the mesh is larger than a rank's experts.

    Gradients: FSDP sums each gradient over its mesh and divides the sum by
    `gradient_divide_factor` (None: the mesh's size, a mean). Expert gradients are summed over
    experts_mesh only, but already hold the tokens of every ep rank: they are divided by the same
    factor as the others (the size of `mesh` when None), so that every gradient is the same sum
    over all ranks' tokens, scaled alike."""
    _copy_single_rank_gradients_plainly()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    config = {
        "mesh": mesh,
        "mp_policy": policy,
        "offload_policy": offload_policy,
        "shard_placement_fn": shard_placement_fn,
    }
    # On a mesh of one rank a shard is the whole tensor: resharding after forward frees nothing
    # and costs a second copy in backward, and a per-micro-batch reduction is a copy and an
    # addition of every gradient. Such units keep their parameters gathered, and their gradients
    # are reduced once per step (see `defer_local_gradient_reduction`).
    reshard_after_forward = reshard_after_forward and mesh.size() > 1
    # (module, its mesh, its reshard_after_forward; None: FSDP's choice, the root's) of every FSDP unit.
    units = []
    for block in model.layers.values():
        if experts_mesh is not None:
            # Checkpoint wrappers pass attribute lookups through to the block they wrap.
            experts = getattr(getattr(block, "moe", None), "experts", None)
            if experts is not None:
                experts_reshard = reshard_after_forward and experts_mesh.size() > 1
                fully_shard(
                    experts,
                    mesh=experts_mesh,
                    mp_policy=policy,
                    offload_policy=offload_policy,
                    reshard_after_forward=experts_reshard,
                    shard_placement_fn=_experts_placement(experts_mesh.size()),
                )
                units.append((experts, experts_mesh, experts_reshard))
        block = fully_shard(block, reshard_after_forward=reshard_after_forward, **config)
        units.append((block, mesh, reshard_after_forward))
    if model.lm_head is not None:
        embeddings = fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **config)
        units.append((embeddings, mesh, reshard_after_forward))
        # Backward needs the head first: keeping it gathered after forward saves an all-gather.
        fully_shard([model.norm, model.lm_head], reshard_after_forward=False, **config)
        units.append((model.norm, mesh, False))  # the pair's one FSDP state
    # A tied head reads the embedding's weight outside the embedding's forward, so both stay
    # with the root, whose parameters are gathered for the whole forward.
    units.append((fully_shard(model, **config), mesh, None))
    model.primerl_local_fsdp_units = [unit for unit, unit_mesh, _ in units if unit_mesh.size() == 1]
    model.primerl_sharded_fsdp_units = [(unit, after) for unit, unit_mesh, after in units if unit_mesh.size() > 1]
    factor = gradient_divide_factor or float(mesh.size())
    for unit, unit_mesh, _ in units:
        if factor == unit_mesh.size():
            continue
        unit.set_gradient_divide_factor(factor)
        # NCCL reduces with PREMUL_SUM(1 / factor), which gloo lacks: on the CPU the sum is
        # divided afterwards. (A mesh of one rank divides by the factor without reducing.)
        unit.set_force_sum_reduction_for_comms(unit_mesh.device_type == "cpu" and unit_mesh.size() > 1)


def _copy_single_rank_gradients_plainly() -> None:
    """FSDP2 copies a unit's gradients into its reduce-scatter buffer with torch._chunk_cat, whose
    CUDA launch builds per-block metadata on the host: about 10 ms of host time for one layer's
    experts (600M gradient elements), during which the host launches nothing else (under expert
    parallel the experts are a unit of their own, reduced in the middle of their block's
    backward: the GPU ran dry ~7 ms per layer in the last micro-batch). On a mesh of one rank
    the buffer is the gradients flattened one after the other (no chunking, no padding), which
    plain copies write, casting to the reduce dtype as chunk_cat does. Other sizes keep
    chunk_cat. Installed once, into FSDP2's module (a no-op where that function is absent)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    except ImportError:
        return
    original = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
    if original is None or getattr(original, "_primerl_single_rank", False):
        return

    def copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
        if world_size != 1:
            return original(unsharded_grads, reduce_scatter_input, world_size)
        offset = 0
        for grad in unsharded_grads:
            reduce_scatter_input[offset : offset + grad.numel()].view(grad.shape).copy_(grad)
            offset += grad.numel()

    copy_in._primerl_single_rank = True
    collectives.foreach_reduce_scatter_copy_in = copy_in


def _experts_placement(mesh_size: int) -> Callable[[nn.Parameter], Shard | None]:
    def placement(param: nn.Parameter) -> Shard:
        num_rows = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        # Dim 0 would leave ranks empty and padded when there are more ranks than experts.
        return Shard(1) if mesh_size > num_rows else Shard(0)

    return placement


def defer_local_gradient_reduction(model: nn.Module, defer: bool, *, sharded_units: bool = False) -> None:
    """Whether the next backward leaves the gradients of `model`'s single-rank FSDP units
    unreduced (accumulated unsharded in the reduce dtype, as FSDP does without gradient sync):
    True for every micro-batch of a step but the last. A model not sharded by `apply_fsdp` is
    left alone.

    `sharded_units` (ParallelConfig.accumulate_unsharded): the units sharded over several ranks
    too, which then also stay gathered from one micro-batch to the next (no reshard after forward
    or backward while deferring): one all-gather and one reduce-scatter per step instead of per
    micro-batch, for their unsharded parameters and float32 gradients in memory."""
    for unit in getattr(model, "primerl_local_fsdp_units", ()):
        unit.set_requires_gradient_sync(not defer, recurse=False)
    if not sharded_units:
        return
    for unit, reshard_after_forward in getattr(model, "primerl_sharded_fsdp_units", ()):
        unit.set_requires_gradient_sync(not defer, recurse=False)
        unit.set_reshard_after_backward(not defer, recurse=False)
        if reshard_after_forward is not None:
            unit.set_reshard_after_forward(reshard_after_forward and not defer, recurse=False)
