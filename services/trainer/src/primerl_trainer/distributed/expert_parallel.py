"""Expert parallel: each MoE layer's experts split over the ranks of the `ep` mesh, tokens sent to
the rank that holds their experts and back.

Rank r of an ep group of size P holds experts [r * E_l, (r + 1) * E_l), E_l = E / P: the expert
weights become DTensors sharded on dim 0 over the ep mesh (FSDP2 then shards each rank's block
over efsdp). A layer's forward on every rank (`AllToAllDispatcher`):

    1. its token copies, sorted by global expert (so by destination rank), and their counts per
       expert [E];
    2. counts exchanged with one all_to_all_single: recv[src, e] = copies rank src sends to
       local expert e; one device-to-host copy of the split sizes (the only sync);
    3. the copies sent with one all_to_all_single (uneven splits), arriving grouped by source
       rank, then by local expert; a gather puts them in local-expert order;
    4. the local experts run as grouped matrix products;
    5. the reverse gather and all-to-all bring the outputs back in the order of step 1; the
       caller mixes them by their scores.

Backward runs the same exchanges the other way round (split sizes kept from the forward).
Router replay needs nothing here: the replayed expert ids decide the destinations.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

__all__ = ["AllToAllDispatcher", "EPCommBackend", "apply_expert_parallel", "check_ep_comm_backend"]

EPCommBackend = Literal["torch", "deepep"]


def check_ep_comm_backend(backend: EPCommBackend) -> None:
    """ValueError when `backend` cannot run in this environment."""
    if backend == "torch":
        return
    if backend != "deepep":
        raise ValueError(f"model.ep_comm_backend must be 'torch' or 'deepep', got {backend!r}")
    if importlib.util.find_spec("deep_ep") is None:
        raise ValueError(
            "model.ep_comm_backend 'deepep' needs DeepEP (the deep_ep module, built from "
            "github.com/deepseek-ai/DeepEP; the PyPI package deep-ep is a placeholder); it is not importable here: "
            "use model.ep_comm_backend 'torch'"
        )
    raise ValueError(
        "model.ep_comm_backend 'deepep': DeepEP is importable, but this trainer has no DeepEP dispatcher yet; "
        "use model.ep_comm_backend 'torch'"
    )


def apply_expert_parallel(
    moe_layers: Iterable[nn.Module], *, ep_mesh: DeviceMesh, comm_backend: EPCommBackend = "torch"
) -> None:
    """Splits the experts of MoE layers (models.moe.MoE: `experts` and a `dispatcher` slot) over
    `ep_mesh`, in place; before FSDP.

    Every parameter under the experts (the stacked weights, and LoRA's per-expert A and B where
    LoRA adapts the experts) becomes a DTensor sharded on dim 0, the expert dim."""
    check_ep_comm_backend(comm_backend)
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be 1-D, got {ep_mesh}")
    ep = ep_mesh.size()
    for moe in moe_layers:
        num_experts = moe.experts.num_experts
        if num_experts % ep:
            raise ValueError(f"parallel.ep {ep} must divide the model's number of experts {num_experts}")
        for module in moe.experts.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                assert param.shape[0] == num_experts, (name, param.shape)
                # src_data_rank None: every rank loaded the same weights and keeps its own rows.
                local = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), num_experts=num_experts)


class AllToAllDispatcher:
    """Runs one MoE layer's experts over an ep group with all-to-all-v exchanges (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup, *, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local_experts = num_experts // self.ep

    def __call__(
        self,
        x_ND: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """x_ND: this rank's token copies sorted by global expert; tokens_per_expert_E their counts.
        `experts(x, offsets)` runs the local experts (rows sorted by local expert, offsets [E_l] the
        ends of each one's rows). Returns the experts' outputs for x_ND's rows, in x_ND's order."""
        ep, num_local = self.ep, self.num_local_experts
        counts = tokens_per_expert_E.to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts_PL = recv_counts.view(ep, num_local)
        # One device-to-host copy for both directions' split sizes: all_to_all_single needs them on the host.
        send_splits, recv_splits = torch.stack([counts.view(ep, num_local).sum(1), recv_counts_PL.sum(1)]).tolist()
        num_received = sum(recv_splits)

        received_MD = _AllToAll.apply(x_ND, recv_splits, send_splits, self.group)
        if num_local == 1:
            out_MD = experts(received_MD, recv_counts_PL.sum(0).cumsum(0).to(torch.int32))
        else:
            to_expert_order, to_source_order = _expert_order(recv_counts_PL, num_received)
            by_expert_MD = _Permute.apply(received_MD, to_expert_order, to_source_order)
            offsets = recv_counts_PL.sum(0).cumsum(0).to(torch.int32)
            out_MD = _Permute.apply(experts(by_expert_MD, offsets), to_source_order, to_expert_order)
        return _AllToAll.apply(out_MD, send_splits, recv_splits, self.group)


def _expert_order(counts_PL: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arrive grouped by (source rank p, local expert l), counts_PL[p, l] each; the experts
    want them grouped by (l, p). Returns (gather index to (l, p) order, its inverse), on the device
    without a host sync (num_rows is known from the split sizes)."""
    num_sources, num_local = counts_PL.shape
    source_starts = (counts_PL.reshape(-1).cumsum(0) - counts_PL.reshape(-1)).view(num_sources, num_local)
    counts_LP = counts_PL.t().reshape(-1)
    expert_starts_LP = counts_LP.cumsum(0) - counts_LP
    # For each row of (l, p) order: its group, and its offset inside the group.
    group_M = torch.repeat_interleave(
        torch.arange(counts_LP.numel(), device=counts_PL.device), counts_LP, output_size=num_rows
    )
    offset_M = torch.arange(num_rows, device=counts_PL.device) - expert_starts_LP[group_M]
    to_expert_order = source_starts.t().reshape(-1)[group_M] + offset_M
    to_source_order = torch.empty_like(to_expert_order).scatter_(
        0, to_expert_order, torch.arange(num_rows, device=counts_PL.device)
    )
    return to_expert_order, to_source_order


class _Permute(torch.autograd.Function):
    """x[index] whose backward is the gather grad[inverse] (index is a permutation), not autograd's
    scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits, group=group
    )
    return out
