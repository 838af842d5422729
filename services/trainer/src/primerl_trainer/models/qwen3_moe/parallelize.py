"""Qwen3-MoE: Qwen3's composition with expert parallel first (experts split over the ep mesh,
then sharded by FSDP2 over efsdp). Without expert parallel the experts are sharded with their
block, on their hidden dim when the data-parallel group is larger than the number of experts
(dim 0 would leave ranks empty and pad)."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from primerl_trainer.distributed.expert_parallel import EPCommBackend, apply_expert_parallel
from primerl_trainer.kernels.fp8_linear import Fp8Backend, Fp8WeightGrad
from primerl_trainer.models.moe import GroupedExperts, MoE
from primerl_trainer.models.qwen3.parallelize import parallelize_qwen3
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel


def parallelize_qwen3_moe(
    model: Qwen3MoeModel,
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
    compile_fullgraph: bool = True,
    fp8_backend: Fp8Backend | None = None,
    fp8_weight_grad: Fp8WeightGrad = "fp8",
) -> Qwen3MoeModel:
    """In place; returns the model.

    dp_mesh: the FSDP2 mesh of every parameter but the experts' (ParallelDims' "dp_shard_cp");
    None: no FSDP. ep_mesh ("ep", of more than one rank): split each layer's experts over it;
    efsdp_mesh ("efsdp"): the FSDP2 mesh of the experts then (required with ep_mesh and dp_mesh).
    gradient_divide_factor: FSDP divides summed gradients by it, the experts' included (None:
    dp_mesh's size). compile_fullgraph: False for families whose blocks hold code compile leaves
    out (expert parallel always breaks the graph). fp8_backend, fp8_weight_grad: parallelize_qwen3's
    (the experts too)."""
    experts_mesh = shard_placement_fn = None
    expert_parallel = ep_mesh is not None and ep_mesh.size() > 1
    if expert_parallel:
        if dp_mesh is not None and efsdp_mesh is None:
            raise ValueError("expert parallel with FSDP needs efsdp_mesh, the experts' FSDP mesh")
        apply_expert_parallel(
            [m for m in model.modules() if isinstance(m, MoE)], ep_mesh=ep_mesh, comm_backend=ep_comm_backend
        )
        experts_mesh = efsdp_mesh
    elif dp_mesh is not None and dp_mesh.size() > model.args.num_experts:
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
        gradient_divide_factor=gradient_divide_factor,
        shard_placement_fn=shard_placement_fn,
        experts_mesh=experts_mesh,
        # The all-to-all's split sizes come to the host: a graph break in every MoE block.
        compile_fullgraph=compile_fullgraph and not expert_parallel,
        fp8_backend=fp8_backend,
        fp8_weight_grad=fp8_weight_grad,
    )
