"""Expert parallel: each MoE layer's experts split over the ranks of the `ep` mesh, tokens sent to
the ranks that hold their experts and their outputs sent back.

Rank r of an ep group of size P holds experts [r * E_l, (r + 1) * E_l), E_l = E / P: the expert
weights become DTensors sharded on dim 0 over the ep mesh (FSDP2 then shards each rank's block
over efsdp). A layer's forward on every rank, once the router has chosen (`AllToAllDispatcher`):

    1. counts exchanged with one all_to_all_single: per destination rank, the tokens sent there
       and the copies for each of its experts; one device-to-host copy of the split sizes (the
       only sync of the layer, forward and backward);
    2. each token sent once to every rank that holds one or more of its experts (not once per
       expert: with top-8 over 2 ranks that moves a quarter of the bytes), with its local expert
       ids and scores there: one all_to_all_single of tokens (uneven splits) and a small one;
    3. the receiver expands the tokens into copies grouped by local expert, runs the local experts
       as grouped matrix products and sums each token's copies weighted by their scores;
    4. one all_to_all_single brings each token's partial sums back; the sender adds them.

Backward runs the same exchanges the other way round (split sizes kept from the forward), and
every permutation's backward is a gather (kernels.gather), so results do not depend on the order
atomics land in. Router replay needs nothing here: the replayed expert ids decide the destinations.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from primerl_trainer.kernels.token_rows import gather_rows, gather_sum_rows, scaled_rows_and_dots

__all__ = [
    "AllToAllDispatcher",
    "DispatchOptions",
    "EPCommBackend",
    "apply_expert_parallel",
    "check_ep_comm_backend",
]

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


@dataclass
class DispatchOptions:
    """How a dispatcher runs on the GPU (the results are the same within float32 rounding; on the
    CPU both switches are ignored and the reference paths run).

    fused_rows: the row gathers and weighted sums as single Triton passes (kernels.token_rows)
    rather than eager gathers, casts, products and sums.
    early_sizes: the split sizes go to pinned host memory right after the counts are exchanged and
    the host waits for that copy alone (an event), so the work launched before the wait (the send
    rows' gathers) is still queued on the GPU while the host launches what follows; otherwise
    `.tolist()` waits for everything launched so far."""

    fused_rows: bool = True
    early_sizes: bool = True


class AllToAllDispatcher:
    """Runs one MoE layer's experts over an ep group with all-to-all-v exchanges (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup, *, num_experts: int, options: DispatchOptions | None = None) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local_experts = num_experts // self.ep
        self.options = options or DispatchOptions()

    # Split sizes come to the host and collectives run in between: compiled blocks run this eagerly.
    @torch.compiler.disable
    def __call__(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TD this rank's tokens, scores_TK and expert_ids_TK (global ids) their routing;
        `experts(x, offsets)` runs the local experts on rows grouped by local expert (offsets [E_l]
        the end of each one's rows). Returns (the tokens' mixed expert outputs [T, D], this rank's
        tokens per expert [E])."""
        num_ranks, num_local = self.ep, self.num_local_experts
        num_tokens, top_k = expert_ids_TK.shape
        device = x_TD.device
        fused = self.options.fused_rows
        tokens_per_expert_E = torch.bincount(expert_ids_TK.reshape(-1), minlength=num_ranks * num_local)
        rank_TK = expert_ids_TK // num_local
        to_rank_TP = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=device).scatter_(1, rank_TK, True)

        # 1. Per destination: tokens, then copies per local expert; the split sizes start for the host.
        send_counts = torch.cat([to_rank_TP.sum(0)[:, None], tokens_per_expert_E.view(num_ranks, num_local)], dim=1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sizes = _HostSizes(
            torch.cat([send_counts[:, 0], recv_counts[:, 0], recv_counts[:, 1:].sum()[None]]),
            early=self.options.early_sizes,
        )

        # 2. Send rows in (rank, token) order: slot_TP[t, p] is token t's row for rank p. What needs
        # no sizes is launched before the sync, over the whole [P * T] grid (the grid's tail past
        # the sent rows, which repeats token 0, is cut off after the sync).
        send_PT = to_rank_TP.t().reshape(-1)
        position_PT = send_PT.cumsum(0) - 1
        grid = send_PT.numel()
        flat_G = torch.zeros(grid + 1, dtype=torch.long, device=device)
        flat_G.scatter_(0, torch.where(send_PT, position_PT, grid), torch.arange(grid, device=device))
        flat_G = flat_G[:grid]
        token_G, rank_G = flat_G % num_tokens, flat_G // num_tokens
        slot_TP = torch.where(send_PT, position_PT, 0).view(num_ranks, num_tokens).t()
        on_rank_GK = rank_TK[token_G] == rank_G[:, None]
        # The experts elsewhere get score 0 and id num_local (sorted after the real ones).
        ids_GK = torch.where(on_rank_GK, expert_ids_TK[token_G] % num_local, num_local).to(torch.float32)
        sent_x_GD = _GatherRows.apply(x_TD, token_G, slot_TP, to_rank_TP, fused)
        sent_scores_GK = _GatherRows.apply(scores_TK, token_G, slot_TP, to_rank_TP, False) * on_rank_GK
        # Scores and ids travel together (float32 holds ids below 2^24 exactly).
        routing_GJ = torch.cat([sent_scores_GK.to(torch.float32), ids_GK], dim=1)

        # The layer's one host sync: all_to_all_single takes its split sizes as Python ints.
        split_sizes = sizes.wait()
        send_splits, recv_splits = split_sizes[:num_ranks], split_sizes[num_ranks : 2 * num_ranks]
        num_copies, num_sent = split_sizes[-1], sum(send_splits)
        recv_x_MD = _AllToAll.apply(sent_x_GD[:num_sent], recv_splits, send_splits, self.group)
        recv_routing_MJ = _AllToAll.apply(routing_GJ[:num_sent], recv_splits, send_splits, self.group)
        recv_scores_MK = recv_routing_MJ[:, :top_k].to(scores_TK.dtype)
        recv_ids_MK = recv_routing_MJ[:, top_k:].detach().to(torch.long)

        # 3. Copies grouped by local expert (a stable sort: deterministic, no atomics).
        sorted_ids, order = torch.sort(recv_ids_MK.reshape(-1), stable=True)
        order_C = order[:num_copies]
        boundaries = torch.arange(1, num_local + 1, device=device, dtype=sorted_ids.dtype)
        offsets_L = torch.searchsorted(sorted_ids, boundaries, out_int32=True)
        valid_MK = recv_ids_MK < num_local
        inverse_MK = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
        inverse_MK = torch.where(valid_MK.reshape(-1), inverse_MK, 0).view_as(recv_ids_MK)
        copies_CD = _GatherRows.apply(recv_x_MD, order_C // top_k, inverse_MK, valid_MK, fused)
        partial_MD = _CombineRows.apply(
            experts(copies_CD, offsets_L), recv_scores_MK, inverse_MK, valid_MK, order_C, fused
        )

        # 4. Partial sums back to their tokens' ranks, added up there.
        partial_SD = _AllToAll.apply(partial_MD, send_splits, recv_splits, self.group)
        copy_S = flat_G[:num_sent] % num_tokens * num_ranks + flat_G[:num_sent] // num_tokens
        out_TD = _CombineRows.apply(partial_SD, None, slot_TP, to_rank_TP, copy_S, fused)
        return out_TD, tokens_per_expert_E


class _HostSizes:
    """A small integer tensor on its way to the host (see DispatchOptions.early_sizes)."""

    def __init__(self, sizes: torch.Tensor, *, early: bool) -> None:
        self._sizes, self._event = sizes, None
        if early and sizes.is_cuda:
            self._sizes = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            self._sizes.copy_(sizes, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._sizes.tolist()


class _GatherRows(torch.autograd.Function):
    """rows_RD = x_TD[index_R], where row r is one of the copies that slots_TJ[t] lists for
    token t (valid_TJ says which). The backward sums each token's copies: a gather."""

    @staticmethod
    def forward(
        ctx,
        x_TD: torch.Tensor,
        index_R: torch.Tensor,
        slots_TJ: torch.Tensor,
        valid_TJ: torch.Tensor,
        fused: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(slots_TJ, valid_TJ)
        ctx.fused = fused
        return gather_rows(x_TD, index_R, fused=fused)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        slots_TJ, valid_TJ = ctx.saved_tensors
        return gather_sum_rows(grad_RD, slots_TJ, valid_TK=valid_TJ, fused=ctx.fused), None, None, None, None


class _CombineRows(torch.autograd.Function):
    """out_TD[t] = sum over valid j of weights[t, j] * rows_RD[slots_TJ[t, j]] (weights None: 1),
    in float32, in the order j = 0, 1, ...; row r is copy copy_R[r] = t * J + j. The transpose of
    _GatherRows; the weights' gradient is taken row by row (rows read contiguously)."""

    @staticmethod
    def forward(
        ctx,
        rows_RD: torch.Tensor,
        weights_TJ: torch.Tensor | None,
        slots_TJ: torch.Tensor,
        valid_TJ: torch.Tensor,
        copy_R: torch.Tensor,
        fused: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(rows_RD, weights_TJ, slots_TJ, valid_TJ, copy_R)
        ctx.has_weights, ctx.fused = weights_TJ is not None, fused
        return gather_sum_rows(rows_RD, slots_TJ, weights_TJ, valid_TJ, fused=fused)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows_RD, weights_TJ, slots_TJ, valid_TJ, copy_R = ctx.saved_tensors
        token_R = copy_R // slots_TJ.shape[1]
        if not ctx.has_weights:
            return gather_rows(grad_TD, token_R, fused=ctx.fused), None, None, None, None, None
        grad_rows_RD, grad_weights_R = scaled_rows_and_dots(
            grad_TD, rows_RD, token_R, weights_TJ.reshape(-1)[copy_R], fused=ctx.fused
        )
        grad_weights_TJ = torch.where(valid_TJ, grad_weights_R[slots_TJ], 0.0).to(weights_TJ.dtype)
        return grad_rows_RD, grad_weights_TJ, None, None, None, None


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
