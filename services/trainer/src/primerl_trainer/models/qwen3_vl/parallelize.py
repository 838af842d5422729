"""Qwen3-VL and Qwen3-VL-MoE: their language model's composition (Qwen3's; Qwen3-MoE's with
expert parallel first). FP8, activation checkpointing and compile apply to the decoder blocks;
FSDP2 shards each block as a unit, and the vision tower as one of its own (eager: it runs once
per forward, before the first block).

The vision tower's unit is gathered for its forward alone. Frozen (model.train_vision_encoder
false, the default), nothing in backward reaches it, so it is not gathered again; within the
root unit it would stay gathered through the whole step."""

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from primerl_trainer.models.qwen3.parallelize import parallelize_qwen3
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from primerl_trainer.models.qwen3_vl.model import Qwen3VLModel, Qwen3VLMoeModel

Model = TypeVar("Model", Qwen3VLModel, Qwen3VLMoeModel)


def parallelize_qwen3_vl(model: Qwen3VLModel, **kwargs: Any) -> Qwen3VLModel:
    """In place; returns the model. The arguments are parallelize_qwen3's."""
    return _parallelize_with_vision_unit(model, parallelize_qwen3, **kwargs)


def parallelize_qwen3_vl_moe(model: Qwen3VLMoeModel, **kwargs: Any) -> Qwen3VLMoeModel:
    """In place; returns the model. The arguments are parallelize_qwen3_moe's."""
    return _parallelize_with_vision_unit(model, parallelize_qwen3_moe, **kwargs)


def _parallelize_with_vision_unit(
    model: Model,
    parallelize_language_model: Callable[..., Model],
    *,
    dp_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    gradient_divide_factor: float | None = None,
    **kwargs: Any,
) -> Model:
    """Shards the vision tower over dp_mesh as the language model's units are (same mixed
    precision, offload and gradient scaling), then the language model and the root. The defaults
    are parallelize_qwen3's."""
    vision_unit = None
    if dp_mesh is not None:
        # On one rank a shard is the whole tensor: resharding frees nothing (as apply_fsdp's units).
        vision_reshard = reshard_after_forward and dp_mesh.size() > 1
        vision_unit = fully_shard(
            model.visual,
            mesh=dp_mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
            reshard_after_forward=vision_reshard,
        )
        if gradient_divide_factor is not None and gradient_divide_factor != dp_mesh.size():
            vision_unit.set_gradient_divide_factor(gradient_divide_factor)
            vision_unit.set_force_sum_reduction_for_comms(dp_mesh.device_type == "cpu" and dp_mesh.size() > 1)
    parallelize_language_model(
        model,
        dp_mesh=dp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        gradient_divide_factor=gradient_divide_factor,
        **kwargs,
    )
    if vision_unit is not None:
        # A trained vision tower defers its gradient reduction with the other units (see
        # distributed.fsdp.defer_local_gradient_reduction).
        if dp_mesh.size() == 1:
            model.primerl_local_fsdp_units.append(vision_unit)
        else:
            model.primerl_sharded_fsdp_units.append((vision_unit, vision_reshard))
    return model
