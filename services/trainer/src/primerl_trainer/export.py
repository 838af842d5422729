"""The weights a publish sends: the sharded model's tensors gathered one at a time, LoRA merged
in or kept alone, under Hugging Face's (or PEFT's) names, in the published dtype.

Memory: no rank ever holds a full copy of the model. Each state-dict entry is gathered on its
own, to the destination rank only (the others send their shard and hold nothing more), turned
into its exported tensors and handed on before the next one is gathered; an adapted weight waits
for its two LoRA tensors, which follow it in the state dict.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from primerl_common.weights.fp8_blocks import to_block_pairs
from primerl_trainer.lora import is_lora_key, lora_adapter_tensors, merge_lora
from primerl_trainer.models import HFCausalLM, model_spec_of

__all__ = [
    "PublishKind",
    "count_tensors",
    "exported_adapter_tensors",
    "exported_tensors",
    "gather_state_dict",
    "gather_to_rank0",
    "hf_converter",
    "meta_state_dict",
    "plan_export",
    "published_tensors",
]

PublishKind = Literal["full", "adapter"]
NamedTensors = Iterable[tuple[str, torch.Tensor]]
# publish.fp8_blocks' weights, by their HF names: the projections vLLM's block-FP8 method holds in
# FP8 (the attention's, the MLP's, the shared and the routed experts'; not the routers').
_FP8_PUBLISHED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def hf_converter(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Own state-dict entries -> the same tensors under the checkpoint's (hub) names; works on
    any subset of the entries, one at a time included."""
    if isinstance(model, HFCausalLM):
        return model.hf_state_dict
    return model_spec_of(model).state_dict_adapter_cls(model.args).to_hf


def _wanted(kind: PublishKind) -> Callable[[str], bool]:
    return is_lora_key if kind == "adapter" else (lambda key: True)


def gather_state_dict(
    model: nn.Module, *, kind: PublishKind, is_destination: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state-dict entries a publish of `kind` needs, each gathered whole in turn.

    Collective: every rank iterates to the end; only the destination gets the tensors (the
    generator yields nothing elsewhere)."""
    wanted = _wanted(kind)
    for key, value in model.state_dict().items():
        if not wanted(key):
            continue
        full = gather_to_rank0(value.detach(), is_destination=is_destination)
        if is_destination:
            assert full is not None
            yield key, full
        del full


def gather_to_rank0(tensor: torch.Tensor, *, is_destination: bool) -> torch.Tensor | None:
    """The whole of a (possibly sharded) tensor on rank 0, None elsewhere. Collective for a DTensor.

    FSDP2 shards a parameter on one dim in torch.chunk's pieces (the last ones may be short or
    empty); each rank pads its piece to the full chunk size and rank 0 gathers them.

    Expert weights under expert parallel live on a 2-D mesh (efsdp, ep): FSDP's sharding is
    undone over efsdp first (each rank then holds its ep shard, 1/ep of the tensor), and only
    rank 0's ep group gathers the ep shards, so no rank but rank 0 ever holds the whole tensor."""
    if not isinstance(tensor, DTensor):
        return tensor if is_destination else None
    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim == 2 and type(placements[1]) is Shard:
        ep_shard = tensor.redistribute(mesh, [Replicate(), placements[1]]).to_local()
        group = mesh.get_group(1)
        if 0 not in dist.get_process_group_ranks(group):
            return None
        return _gather_shards(ep_shard, placements[1].dim, tensor.shape, group, is_destination=is_destination)
    (placement,) = placements if mesh.ndim == 1 else (None,)
    if type(placement) is not Shard:  # another layout (replicated, strided, other meshes): gather it everywhere
        full = tensor.full_tensor()
        return full if is_destination else None
    return _gather_shards(
        tensor.to_local(), placement.dim, tensor.shape, mesh.get_group(), is_destination=is_destination
    )


def _gather_shards(
    local: torch.Tensor, dim: int, shape: torch.Size, group: dist.ProcessGroup, *, is_destination: bool
) -> torch.Tensor | None:
    """The tensor of `shape` whose torch.chunk pieces on `dim` the ranks of `group` hold, on the
    group's first rank (the destination); None elsewhere."""
    size, world_size = shape[dim], dist.get_world_size(group)
    chunk = -(-size // world_size)
    if size == 0:
        return local if is_destination else None
    padded_shape = (*local.shape[:dim], chunk, *local.shape[dim + 1 :])
    if local.shape[dim] == chunk:
        padded = local.contiguous()
    else:
        padded = local.new_zeros(padded_shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    if not is_destination:
        dist.gather(padded, None, group=group, group_dst=0)
        return None
    if dim == 0:
        # Gathered straight into the result: the pieces are contiguous rows of it.
        out = local.new_empty((world_size * chunk, *local.shape[1:]))
        dist.gather(padded, list(out.split(chunk)), group=group, group_dst=0)
        return out[:size]
    pieces = [torch.empty_like(padded) for _ in range(world_size)]
    dist.gather(padded, pieces, group=group, group_dst=0)
    return torch.cat(pieces, dim=dim).narrow(dim, 0, size)


def meta_state_dict(model: nn.Module, *, kind: PublishKind) -> Iterator[tuple[str, torch.Tensor]]:
    """`gather_state_dict`'s entries as meta tensors (shapes and dtypes, no data, no collective)."""
    wanted = _wanted(kind)
    for key, value in model.state_dict().items():
        if wanted(key):
            yield key, torch.empty(value.shape, dtype=value.dtype, device="meta")


def exported_tensors(
    model: nn.Module,
    source: NamedTensors,
    *,
    kind: PublishKind,
    dtype: torch.dtype,
    lora_scale: float | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) to publish, from `source`'s own state-dict entries (gathered or meta), in
    `dtype` but for the model's float32 buffers: tensors it does not train and holds in float32
    whatever its dtype because its checkpoint stores them so (the routers' correction biases,
    which decide between experts whose scores differ by less than bfloat16 resolves)."""
    if kind == "adapter":
        yield from exported_adapter_tensors(model, source, dtype=dtype)
        return
    to_hf = hf_converter(model)
    weights = merge_lora(source, scale=lora_scale) if lora_scale is not None else source
    float32_buffers = {name for name, buffer in model.named_buffers() if buffer.dtype == torch.float32}
    for own_name, tensor in weights:
        for name, exported in to_hf({own_name: tensor}).items():
            yield name, exported if own_name in float32_buffers else exported.to(dtype)


def exported_adapter_tensors(
    model: nn.Module, source: NamedTensors, *, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter under PEFT's names, in `dtype`, from `source`'s LoRA entries (own state-dict
    names, gathered or meta) of any rank up to the one the model's LoRA modules are built at: the
    model's own, or one run's (runs.py) cut to the run's rank. The names come from the model's
    adapted weights, never from the LoRA tensors' shapes."""
    base_shapes = {
        key.removesuffix(".original").replace(".parametrizations.", "."): (value.shape, value.dtype)
        for key, value in model.state_dict().items()
        if key.endswith(".original")
    }
    for name, tensor in lora_adapter_tensors(source, base_shapes=base_shapes, to_hf=hf_converter(model)):
        yield name, tensor.to(dtype)


def count_tensors(named_tensors: NamedTensors) -> tuple[int, int]:
    """(number of tensors, bytes) of `named_tensors`; meta tensors count the bytes they describe."""
    num_tensors = num_bytes = 0
    for _, tensor in named_tensors:
        num_tensors += 1
        num_bytes += tensor.numel() * tensor.element_size()
    return num_tensors, num_bytes


def published_tensors(named_tensors: NamedTensors, *, fp8_blocks: bool) -> NamedTensors:
    """`named_tensors` (exported_tensors') as a publish sends them: with `fp8_blocks`
    (publish.fp8_blocks), the projections of whole 128x128 blocks as block-FP8 pairs
    (primerl_common.weights.fp8_blocks), quantized where they lie."""
    if not fp8_blocks:
        return named_tensors
    return to_block_pairs(named_tensors, lambda name: _FP8_PUBLISHED.search(name) is not None)


def plan_export(
    model: nn.Module, *, kind: PublishKind, dtype: torch.dtype, lora_scale: float | None, fp8_blocks: bool = False
) -> tuple[int, int]:
    """(number of tensors, bytes) a publish sends: what PublishBegin announces."""
    source = meta_state_dict(model, kind=kind)
    exported = exported_tensors(model, source, kind=kind, dtype=dtype, lora_scale=lora_scale)
    return count_tensors(published_tensors(exported, fp8_blocks=fp8_blocks))
