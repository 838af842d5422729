"""Applies FP8 (model.fp8), activation checkpointing, compile and FSDP2 to a Qwen3 model, in
that order (torchtitan's): the blocks' layers convert to FP8 in place, checkpointing wraps the
plain block, compile sees the wrapped block, FSDP shards what compile traced."""

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from primerl_trainer.distributed import apply_activation_checkpointing, apply_compile, apply_fsdp
from primerl_trainer.kernels.fp8_linear import Fp8Backend, Fp8WeightGrad
from primerl_trainer.models.fp8 import convert_to_fp8

Model = TypeVar("Model", bound=nn.Module)


def parallelize_qwen3(
    model: Model,
    *,
    dp_mesh: DeviceMesh | None = None,
    ep_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    gradient_divide_factor: float | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    experts_mesh: DeviceMesh | None = None,
    compile_fullgraph: bool = True,
    fp8_backend: Fp8Backend | None = None,
    fp8_weight_grad: Fp8WeightGrad = "fp8",
) -> Model:
    """In place; returns the model (a Qwen3 composition: `model.layers` are its blocks).

    dp_mesh: the FSDP2 mesh (all ranks: ParallelDims' "dp_shard_cp"); None: no FSDP.
    ep_mesh: a dense model has no experts to split, so only None or a mesh of one rank.
    gradient_divide_factor: FSDP divides summed gradients by it (None: dp_mesh's size).
    shard_placement_fn, experts_mesh, compile_fullgraph: for the models built on this one
    (Qwen3-MoE; see distributed.apply_fsdp).
    fp8_backend: run the blocks' products in FP8 with this backend (models/fp8.py; model.fp8);
    None: in the compute dtype. fp8_weight_grad: model.fp8_weight_grad."""
    if ep_mesh is not None and ep_mesh.size() > 1:
        raise ValueError(f"parallel.ep {ep_mesh.size()} needs a mixture-of-experts model; this one is dense")
    if fp8_backend is not None:
        # FSDP moves the model to the mesh's device; without it the model is where it runs.
        device = dp_mesh.device_type if dp_mesh is not None else next(model.parameters()).device
        convert_to_fp8(model.layers, backend=fp8_backend, device=device, weight_grad=fp8_weight_grad)
    if activation_checkpointing:
        apply_activation_checkpointing(model.layers)
    if compile:
        apply_compile(model.layers, fullgraph=compile_fullgraph)
    if dp_mesh is not None:
        apply_fsdp(
            model,
            mesh=dp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            shard_placement_fn=shard_placement_fn,
            experts_mesh=experts_mesh,
            gradient_divide_factor=gradient_divide_factor,
        )
    return model
