"""Qwen3-MoE: Qwen3's composition, with expert weights sharded on their hidden dim when
the data-parallel group is larger than the number of experts (dim 0 would leave ranks
empty and pad)."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from primerl_trainer.models.moe import GroupedExperts
from primerl_trainer.models.qwen3.parallelize import parallelize_qwen3
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel


def parallelize_qwen3_moe(
    model: Qwen3MoeModel,
    *,
    dp_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> Qwen3MoeModel:
    """In place; returns the model. Without `dp_mesh` no FSDP is applied."""
    shard_placement_fn = None
    if dp_mesh is not None and dp_mesh.size() > model.args.num_experts:
        expert_params = {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}

        def shard_placement_fn(param: nn.Parameter) -> Shard | None:
            return Shard(1) if param in expert_params else None

    return parallelize_qwen3(
        model,
        dp_mesh=dp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        shard_placement_fn=shard_placement_fn,
    )
