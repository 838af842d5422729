"""MiniMax-M2: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts are split over the ep mesh and sharded over efsdp; the
attention (its whole-projection q/k norms included) and the router (its correction bias is a
buffer, replicated) are sharded with their block like any other parameter."""

import torch
from torch.distributed.device_mesh import DeviceMesh

from primerl_trainer.distributed.expert_parallel import EPCommBackend
from primerl_trainer.models.minimax_m2.model import MiniMaxM2Model
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe


def parallelize_minimax_m2(
    model: MiniMaxM2Model,
    *,
    dp_mesh: DeviceMesh | None = None,
    ep_mesh: DeviceMesh | None = None,
    efsdp_mesh: DeviceMesh | None = None,
    ep_comm_backend: EPCommBackend = "torch",
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    gradient_divide_factor: float | None = None,
) -> MiniMaxM2Model:
    """In place; returns the model. Arguments as parallelize_qwen3_moe's."""
    return parallelize_qwen3_moe(
        model,
        dp_mesh=dp_mesh,
        ep_mesh=ep_mesh,
        efsdp_mesh=efsdp_mesh,
        ep_comm_backend=ep_comm_backend,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        gradient_divide_factor=gradient_divide_factor,
    )
