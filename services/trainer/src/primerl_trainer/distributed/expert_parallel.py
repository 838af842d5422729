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
       ids and scores there in extra columns of its row: one all_to_all_single (uneven splits);
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
    """How a dispatcher exchanges its rows (the results are the same either way).

    packed: each token's scores and local expert ids travel in the all-to-all of its row, as
    float32 bits in extra columns of the row buffer (and their gradients in the backward's), so
    the dispatch is one exchange each way instead of two: every exchange is also a wait for the
    slowest rank, and at this size (~16 MiB a call over NVLink) a call costs more in latency and
    waiting than in bytes."""

    packed: bool = True


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
        tokens_per_expert_E = torch.bincount(expert_ids_TK.reshape(-1), minlength=num_ranks * num_local)
        rank_TK = expert_ids_TK // num_local
        to_rank_TP = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=device).scatter_(1, rank_TK, True)

        # 1. Per destination: tokens, then copies per local expert; the split sizes and the number
        # of copies this rank computes start for the host.
        send_counts = torch.cat([to_rank_TP.sum(0)[:, None], tokens_per_expert_E.view(num_ranks, num_local)], dim=1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        num_copies = recv_counts[:, 1:].sum()[None]
        sizes = _HostSizes(torch.cat([send_counts[:, 0], recv_counts[:, 0], num_copies]))

        # 2. Send rows in (rank, token) order: slot_TP[t, p] is token t's row for rank p. What
        # needs no sizes is launched before the sync, over the whole [P * T] grid (the grid's tail
        # past the sent rows, which repeats token 0, is left out of the exchange).
        grid = num_ranks * num_tokens
        send_PT = to_rank_TP.t().reshape(-1)
        position_PT = send_PT.cumsum(0) - 1
        flat_G = torch.zeros(grid + 1, dtype=torch.long, device=device)
        flat_G.scatter_(0, torch.where(send_PT, position_PT, grid), torch.arange(grid, device=device))
        flat_G = flat_G[:grid]
        slot_TP = torch.where(send_PT, position_PT, 0).view(num_ranks, num_tokens).t()
        token_G, rank_G = flat_G % num_tokens, flat_G // num_tokens
        copy_G = token_G * num_ranks + rank_G
        on_rank_GK = rank_TK[token_G] == rank_G[:, None]
        # The experts elsewhere get score 0 and id num_local (sorted after the real ones); scores and
        # ids travel as float32 (which holds ids below 2^24 exactly).
        ids_GK = torch.where(on_rank_GK, expert_ids_TK[token_G] % num_local, num_local).to(torch.float32)
        sent_scores_GK = (_GatherRows.apply(scores_TK, token_G, slot_TP, to_rank_TP) * on_rank_GK).to(torch.float32)
        if self.options.packed:
            sent_GW = _PackRows.apply(x_TD, token_G, slot_TP, to_rank_TP, sent_scores_GK, ids_GK)
        else:
            sent_x_GD = _GatherRows.apply(x_TD, token_G, slot_TP, to_rank_TP)
            routing_GJ = torch.cat([sent_scores_GK, ids_GK], dim=1)

        # The layer's one host sync: all_to_all_single takes its split sizes as Python ints.
        split_sizes = sizes.wait()
        send_splits, recv_splits = split_sizes[:num_ranks], split_sizes[num_ranks : 2 * num_ranks]
        num_sent = sum(send_splits)
        if self.options.packed:
            recv_MW = _AllToAll.apply(sent_GW, recv_splits, send_splits, self.group)
            recv_x_MD, recv_scores_MK, recv_ids_MK = _UnpackRows.apply(recv_MW, x_TD.shape[1], top_k)
        else:
            recv_x_MD = _AllToAll.apply(sent_x_GD, recv_splits, send_splits, self.group)
            recv_routing_MJ = _AllToAll.apply(routing_GJ, recv_splits, send_splits, self.group)
            recv_scores_MK, recv_ids_MK = recv_routing_MJ[:, :top_k], recv_routing_MJ[:, top_k:].detach()
        recv_scores_MK = recv_scores_MK.to(scores_TK.dtype)
        recv_ids_MK = recv_ids_MK.to(torch.long)

        # 3. Copies grouped by local expert (a stable sort: deterministic, no atomics).
        sorted_ids, order = torch.sort(recv_ids_MK.reshape(-1), stable=True)
        boundaries = torch.arange(1, num_local + 1, device=device, dtype=sorted_ids.dtype)
        offsets_L = torch.searchsorted(sorted_ids, boundaries, out_int32=True)
        valid_MK = recv_ids_MK < num_local
        inverse_MK = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
        inverse_MK = torch.where(valid_MK.reshape(-1), inverse_MK, 0).view_as(recv_ids_MK)
        order_C = order[: sizes.wait()[-1]]
        copies_CD = _GatherRows.apply(recv_x_MD, order_C // top_k, inverse_MK, valid_MK)
        partial_MD = _CombineRows.apply(experts(copies_CD, offsets_L), recv_scores_MK, inverse_MK, valid_MK, order_C)

        # 4. Partial sums back to their tokens' ranks, added up there.
        partial_SD = _AllToAll.apply(partial_MD, send_splits, recv_splits, self.group)
        return _CombineRows.apply(partial_SD, None, slot_TP, to_rank_TP, copy_G[:num_sent]), tokens_per_expert_E


class _HostSizes:
    """A small integer tensor on its way to the host: on CUDA through pinned memory and an event,
    so the host waits for that copy alone and the work launched before the wait (the send rows'
    gathers) stays queued on the GPU while the host launches what follows (`.tolist()` would wait
    for everything launched so far)."""

    def __init__(self, sizes: torch.Tensor) -> None:
        self._sizes, self._event, self._values = sizes, None, None
        if sizes.is_cuda:
            self._sizes = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            self._sizes.copy_(sizes, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[int]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._sizes.tolist()
        return self._values


def _routing_layout(x: torch.Tensor, top_k: int) -> tuple[int, int]:
    """(columns of x's dtype before the routing, columns after) in a packed row buffer: the row,
    padded so the routing starts 4-byte aligned, then top_k scores and top_k ids as float32 bits."""
    num_cols, itemsize = x.shape[-1], x.element_size()
    row_cols = num_cols + (num_cols * itemsize) % 4 // itemsize
    return row_cols, 2 * top_k * 4 // itemsize


def _routing_view(packed_RW: torch.Tensor, row_cols: int) -> torch.Tensor:
    """The float32 [R, 2K] routing columns of a packed buffer (a view: writes land in the buffer)."""
    return packed_RW[:, row_cols:].view(torch.float32)


class _PackRows(torch.autograd.Function):
    """The send buffer of the packed dispatch: row r is x_TD[token_G[r]] followed by that row's
    float32 scores and ids (see _routing_layout); token t's rows are the ones slots_TP[t] lists
    (valid_TP says which). The backward sums each token's row gradients (a gather) and unpacks
    the scores' gradients."""

    @staticmethod
    def forward(
        ctx,
        x_TD: torch.Tensor,
        token_G: torch.Tensor,
        slots_TP: torch.Tensor,
        valid_TP: torch.Tensor,
        scores_GK: torch.Tensor,
        ids_GK: torch.Tensor,
    ) -> torch.Tensor:
        num_cols, top_k = x_TD.shape[1], scores_GK.shape[1]
        row_cols, routing_cols = _routing_layout(x_TD, top_k)
        packed_GW = x_TD.new_empty(token_G.shape[0], row_cols + routing_cols)
        gather_rows(x_TD, token_G, out=packed_GW[:, :num_cols])
        if row_cols > num_cols:
            packed_GW[:, num_cols:row_cols].zero_()
        routing_GJ = _routing_view(packed_GW, row_cols)
        routing_GJ[:, :top_k] = scores_GK
        routing_GJ[:, top_k:] = ids_GK
        ctx.save_for_backward(slots_TP, valid_TP)
        ctx.layout = (num_cols, row_cols, top_k)
        return packed_GW

    @staticmethod
    def backward(ctx, grad_GW: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        slots_TP, valid_TP = ctx.saved_tensors
        num_cols, row_cols, top_k = ctx.layout
        grad_x_TD = gather_sum_rows(grad_GW[:, :num_cols], slots_TP, valid_TK=valid_TP)
        grad_scores_GK = _routing_view(grad_GW, row_cols)[:, :top_k]
        return grad_x_TD, None, None, None, grad_scores_GK, None


class _UnpackRows(torch.autograd.Function):
    """A received packed buffer -> (its rows [M, D], a view; scores [M, K] float32; ids [M, K]
    float32, no gradient). The backward packs the rows' and scores' gradients into one buffer."""

    @staticmethod
    def forward(ctx, packed_MW: torch.Tensor, num_cols: int, top_k: int) -> tuple[torch.Tensor, ...]:
        row_cols, _ = _routing_layout(packed_MW[:, :num_cols], top_k)
        routing_MJ = _routing_view(packed_MW, row_cols)
        ids_MK = routing_MJ[:, top_k:].clone()
        ctx.mark_non_differentiable(ids_MK)
        ctx.layout = (num_cols, row_cols, top_k)
        return packed_MW[:, :num_cols], routing_MJ[:, :top_k].clone(), ids_MK

    @staticmethod
    def backward(ctx, grad_x_MD: torch.Tensor, grad_scores_MK: torch.Tensor, _) -> tuple[torch.Tensor | None, ...]:
        num_cols, row_cols, top_k = ctx.layout
        grad_MW = grad_x_MD.new_empty(grad_x_MD.shape[0], row_cols + 2 * top_k * 4 // grad_x_MD.element_size())
        grad_MW[:, :num_cols] = grad_x_MD
        grad_MW[:, num_cols:].zero_()
        _routing_view(grad_MW, row_cols)[:, :top_k] = grad_scores_MK
        return grad_MW, None, None


class _GatherRows(torch.autograd.Function):
    """rows_RD = x_TD[index_R], where row r is one of the copies that slots_TJ[t] lists for
    token t (valid_TJ says which). The backward sums each token's copies: a gather."""

    @staticmethod
    def forward(
        ctx, x_TD: torch.Tensor, index_R: torch.Tensor, slots_TJ: torch.Tensor, valid_TJ: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(slots_TJ, valid_TJ)
        return gather_rows(x_TD, index_R)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        slots_TJ, valid_TJ = ctx.saved_tensors
        return gather_sum_rows(grad_RD, slots_TJ, valid_TK=valid_TJ), None, None, None


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
    ) -> torch.Tensor:
        ctx.save_for_backward(rows_RD, weights_TJ, slots_TJ, valid_TJ, copy_R)
        ctx.has_weights = weights_TJ is not None
        return gather_sum_rows(rows_RD, slots_TJ, weights_TJ, valid_TJ)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows_RD, weights_TJ, slots_TJ, valid_TJ, copy_R = ctx.saved_tensors
        token_R = copy_R // slots_TJ.shape[1]
        if not ctx.has_weights:
            return gather_rows(grad_TD, token_R), None, None, None, None
        grad_rows_RD, grad_weights_R = scaled_rows_and_dots(grad_TD, rows_RD, token_R, weights_TJ.reshape(-1)[copy_R])
        grad_weights_TJ = torch.where(valid_TJ, grad_weights_R[slots_TJ], 0.0).to(weights_TJ.dtype)
        return grad_rows_RD, grad_weights_TJ, None, None, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits of x's first sum(input_splits) rows (a send grid's
    tail past them stays home); the backward sends the gradients back the same way (the tail's: 0)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.num_rows = (output_splits, input_splits), group, x.shape[0]
        return _all_to_all(x[: sum(input_splits)], output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        num_sent = sum(input_splits)
        grad_x = grad.new_empty((ctx.num_rows, *grad.shape[1:]))
        grad_x[num_sent:].zero_()
        _all_to_all(grad, input_splits, output_splits, ctx.group, out=grad_x[:num_sent])
        return grad_x, None, None, None


def _all_to_all(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits, group=group
    )
    return out
