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

The dense grid (DispatchOptions.dense_grid; by default where a token is expected to need nearly
every rank anyway, as top-8 of 256 experts over 2 ranks does) sends every token to every rank
instead (step 2 without step 1's counts: the splits are the ranks' token counts, which the first
MoE layer of each forward exchanges host to host, over gloo, for all layers), and with
padded copies (DispatchOptions.padded_copies, where the experts take them) step 3 hands the
experts a fixed number of rows, the most a rank can get, of which they compute the real ones: the
layer then never waits for the GPU, and the host runs ahead of it through the layers as it does
in one process (with a sync per layer it could not). Both give the same sums in the same order,
so outputs and gradients are bitwise those of the deduplicated rows. There, two autograd
functions carry a layer's exchanges and row moves (_GridDispatch, _GridCombine), their index work
done without autograd: the forward at the benchmark's shape is bound by the host's time per
layer (with one autograd function per move it took ~8 ms of launches against ~4.5 ms of GPU work;
bench/results/parallel_throughput-2026-11-30.txt).
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

from primerl_trainer.kernels.token_rows import (
    fused_rows_available,
    gather_rows,
    gather_sum_rows,
    scaled_rows_and_dots,
)
from primerl_trainer.routing_coverage import dense_grid_by_default

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
    token_counts = _TokenCounts()
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
        # The dense grid's token counts: exchanged by the first MoE layer of each forward, reused by
        # the others (a micro-batch's layers all see its T tokens).
        moe.dispatcher = AllToAllDispatcher(
            ep_mesh.get_group(), num_experts=num_experts, token_counts=token_counts, leads=token_counts.layers == 0
        )
        token_counts.layers += 1


@dataclass
class DispatchOptions:
    """How a dispatcher exchanges its rows (the results are the same either way).

    packed: each token's scores and local expert ids travel in the all-to-all of its row, as
    float32 bits in extra columns of the row buffer (and their gradients in the backward's), so
    the dispatch is one exchange each way instead of two: every exchange is also a wait for the
    slowest rank, and at this size (~16 MiB a call over NVLink) a call costs more in latency and
    waiting than in bytes."""

    packed: bool = True
    # dense_grid: every token sent to every rank of the group (rows with none of that rank's experts
    # carry only invalid ids), so the rows' split sizes are the ranks' token counts, known without
    # the device (exchanged host to host once per forward). None: when a token is expected to need
    # nearly every rank anyway (uniform routing: at least 90% of them; ep=2 with top-8 of 256
    # experts: 99.6%), so the grid's extra rows cost little.
    dense_grid: bool | None = None
    # padded_copies (dense grid only): the copies handed to the experts are a fixed number of rows,
    # P * T * min(K, E_l), the most this rank can get, of which the first C (the real copies,
    # offsets[-1]) are computed; the rest are never read. No wait for the GPU at all then: the host
    # runs ahead of the GPU through the layers as in one process. Taken where the experts accept such
    # rows (GroupedExperts.takes_padded_rows: grouped products, no per-row biases, not FP8);
    # otherwise C comes to the host once per layer, after the rows' exchange and sort are queued.
    padded_copies: bool = True


class AllToAllDispatcher:
    """Runs one MoE layer's experts over an ep group with all-to-all-v exchanges (gloo or NCCL)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        num_experts: int,
        options: DispatchOptions | None = None,
        token_counts: _TokenCounts | None = None,
        leads: bool = True,
    ) -> None:
        """token_counts, leads: the dense grid needs every rank's token count on the host (its
        splits); a dispatcher that leads exchanges them (host to host, over gloo), the others of
        the same model reuse the last exchange, which must then be of the same forward: the first
        MoE layer leads."""
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = num_experts // self.ep
        self.options = options or DispatchOptions()
        self.token_counts = token_counts or _TokenCounts()
        self.leads = leads
        # The dense grid's index tensors, which depend only on the token count and the device.
        self._grids: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        self._scalars: dict[tuple[int, torch.device], torch.Tensor] = {}

    def uses_dense_grid(self, top_k: int) -> bool:
        """Whether DispatchOptions.dense_grid holds (None: the expected share of ranks a token
        needs, under uniform routing over the experts, is at least routing_coverage.DENSE_GRID_SHARE)."""
        if self.options.dense_grid is not None:
            return self.options.dense_grid
        return dense_grid_by_default(self.ep * self.num_local_experts, self.ep, top_k)

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
        # Not bincount: on CUDA it reads the largest id back to the host (a sync per layer).
        ids_N = expert_ids_TK.reshape(-1)
        tokens_per_expert_E = torch.zeros(num_ranks * num_local, dtype=torch.long, device=device)
        tokens_per_expert_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))
        if self.uses_dense_grid(top_k):
            return self._dense_grid(x_TD, scores_TK, expert_ids_TK, experts, tokens_per_expert_E)
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

    def _dense_grid(
        self,
        x_TD: torch.Tensor,
        scores_TK: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DispatchOptions.dense_grid: row g = p * T + t of the send grid is token t for rank p,
        sent whether or not t has experts there (then with ids num_local and scores 0), so the
        exchanges split by token counts (this rank's T to every rank; each rank's T back). The
        same sums in the same order as the deduplicated dispatch: outputs and gradients are
        bitwise equal (padded copies too: their extra rows have score 0 and are never read).

        Two autograd functions carry the whole layer but the experts (_GridDispatch: rows to the
        copies grouped by local expert; _GridCombine: expert outputs back to token order), their
        index work done without autograd: the host's time per layer is what this path is short of
        (at the benchmark's shape the GPU runs a layer's forward in ~4.5 ms)."""
        num_tokens = expert_ids_TK.shape[0]
        device = x_TD.device
        takes_padded = getattr(experts, "takes_padded_rows", None)
        padded = self.options.padded_copies and takes_padded is not None and takes_padded(x_TD)
        plan = _GridPlan(
            dispatcher=self,
            expert_ids_TK=expert_ids_TK,
            tokens_per_expert_E=tokens_per_expert_E,
            grid=self._grid(num_tokens, device),
            recv_splits=self._peer_token_counts(num_tokens, device),
            send_splits=[num_tokens] * self.ep,
            padded=padded,
        )
        copies_XD, recv_scores_MK, offsets_L = _GridDispatch.apply(x_TD, scores_TK, plan)
        expert_out_XD = experts(copies_XD, offsets_L)
        return _GridCombine.apply(expert_out_XD, recv_scores_MK, plan), tokens_per_expert_E

    def _peer_token_counts(self, num_tokens: int, device: torch.device) -> list[int]:
        """Every rank's token count (this forward's), exchanged when this dispatcher leads."""
        counts = self.token_counts
        if self.leads or counts.values is None:
            # Host to host (gloo): no wait for the GPU, which may still be running the last
            # micro-batch's backward while the host launches this forward.
            if counts.host_group is None:
                if dist.get_backend(self.group) == "gloo":
                    counts.host_group = self.group
                else:
                    ranks = dist.get_process_group_ranks(self.group)
                    counts.host_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            gathered = [torch.empty(1, dtype=torch.long) for _ in range(self.ep)]
            dist.all_gather(gathered, torch.tensor([num_tokens], dtype=torch.long), group=counts.host_group)
            counts.values = [int(value) for value in gathered]
        values = counts.values
        if len(values) != self.ep or values[self.rank] != num_tokens:
            raise RuntimeError(
                f"expert parallel: this layer has {num_tokens} tokens, the first MoE layer of the forward had "
                f"{values}: the layers of one forward must run in order, the first one first"
            )
        return values

    def _scalar(self, value: int, device: torch.device) -> torch.Tensor:
        """A 0-dim int64 tensor on `device` (kept: where's other branch, without a fill per call)."""
        key = (value, device)
        if key not in self._scalars:
            self._scalars[key] = torch.tensor(value, device=device)
        return self._scalars[key]

    def _grid(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(token_G: t of row g = p * T + t, rank_P: the ranks, slot_TP: t's row for rank p)."""
        key = (num_tokens, device)
        if key not in self._grids:
            if len(self._grids) > 8:
                self._grids.clear()
            rows_G = torch.arange(self.ep * num_tokens, device=device)
            slot_TP = rows_G.view(self.ep, num_tokens).t().contiguous()
            self._grids[key] = (rows_G % num_tokens, torch.arange(self.ep, device=device), slot_TP)
        return self._grids[key]


@dataclass
class _GridPlan:
    """One dense-grid layer's forward: what _GridDispatch computes, _GridCombine reads."""

    dispatcher: AllToAllDispatcher
    expert_ids_TK: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    grid: tuple[torch.Tensor, ...]  # AllToAllDispatcher._grid
    recv_splits: list[int]  # rows from each rank (its token count)
    send_splits: list[int]  # rows to each rank (this rank's token count)
    padded: bool
    # Filled by _GridDispatch.forward:
    to_rank_TP: torch.Tensor | None = None
    inverse_MK: torch.Tensor | None = None
    valid_MK: torch.Tensor | None = None
    order_X: torch.Tensor | None = None
    keep_X1: torch.Tensor | None = None  # padded on the plain row moves: the computed rows


class _GridDispatch(torch.autograd.Function):
    """(x_TD, scores_TK) -> (copies_XD grouped by local expert, the received rows' scores
    recv_scores_MK, offsets_L), through the dense grid's exchange (AllToAllDispatcher._dense_grid).
    The backward sums each received row's copies (a gather), sends the rows' and scores' gradients
    back the same way and sums each token's rows (a gather)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, scores_TK: torch.Tensor, plan: _GridPlan) -> tuple[torch.Tensor, ...]:
        self = plan.dispatcher
        num_ranks, num_local, group = self.ep, self.num_local_experts, self.group
        expert_ids_TK = plan.expert_ids_TK
        top_k = expert_ids_TK.shape[1]
        device = x_TD.device
        token_G, rank_P, _ = plan.grid
        recv_splits, send_splits = plan.recv_splits, plan.send_splits

        # 1. Unpadded: the copies each rank computes for this one; only their sum comes to the
        # host, and it is waited for after the rows' exchange and the sort are queued.
        if not plan.padded:
            send_copies_P = plan.tokens_per_expert_E.view(num_ranks, num_local).sum(1)
            recv_copies_P = torch.empty_like(send_copies_P)
            dist.all_to_all_single(recv_copies_P, send_copies_P, group=group)
            num_copies = _HostSizes(recv_copies_P.sum()[None])

        # 2. Rows with their local expert ids (num_local: another rank's) and scores (0 there).
        # (0-dim tensors, not Python numbers, as where's other branch: no scalar tensor filled each call.)
        zero, other_rank = self._scalar(0, device), self._scalar(num_local, device)
        on_rank_PTK = (expert_ids_TK // num_local)[None] == rank_P[:, None, None]
        # Contiguous once: the row moves would copy it in the forward and again in the backward.
        to_rank_TP = on_rank_PTK.any(-1).t().contiguous()
        ids_GK = torch.where(on_rank_PTK, (expert_ids_TK % num_local)[None], other_rank).view(-1, top_k)
        scores_GK = torch.where(on_rank_PTK, scores_TK[None], zero).view(-1, top_k)
        num_cols = x_TD.shape[1]
        if self.options.packed:
            sent_GW, row_cols = _pack_rows(x_TD, token_G, scores_GK, ids_GK)
            recv_MW = _all_to_all(sent_GW, recv_splits, send_splits, group)
            recv_x_MD = recv_MW[:, :num_cols]
            recv_routing_MJ = _routing_view(recv_MW, row_cols)
        else:
            sent_x_GD = gather_rows(x_TD, token_G)
            routing_GJ = torch.cat([scores_GK.to(torch.float32), ids_GK.to(torch.float32)], dim=1)
            recv_x_MD = _all_to_all(sent_x_GD, recv_splits, send_splits, group)
            recv_routing_MJ = _all_to_all(routing_GJ, recv_splits, send_splits, group)
        recv_scores_MK = recv_routing_MJ[:, :top_k].to(scores_TK.dtype, copy=True)
        recv_ids_MK = recv_routing_MJ[:, top_k:].to(torch.long)

        # 3. Copies grouped by local expert (a stable sort: deterministic, no atomics).
        sorted_ids, order = torch.sort(recv_ids_MK.reshape(-1), stable=True)
        boundaries = torch.arange(1, num_local + 1, device=device, dtype=sorted_ids.dtype)
        offsets_L = torch.searchsorted(sorted_ids, boundaries, out_int32=True)
        valid_MK = recv_ids_MK < num_local
        inverse_MK = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
        inverse_MK = torch.where(valid_MK.reshape(-1), inverse_MK, zero).view_as(recv_ids_MK)
        # Padded: the most copies this rank can get; past offsets_L[-1] they repeat received rows
        # of invalid entries (score 0), which the experts leave uncomputed and nothing reads.
        # Unpadded: the layer's one host sync.
        order_X = order[: sum(recv_splits) * min(top_k, num_local) if plan.padded else num_copies.wait()[0]]
        copies_XD = gather_rows(recv_x_MD, order_X // top_k)
        if plan.padded and not fused_rows_available(copies_XD):
            # The plain row moves multiply what they skip by 0 (the fused ones mask it): the rows
            # the experts leave uncomputed, and their gradients, are set to zeros (NaN * 0 is NaN).
            plan.keep_X1 = torch.arange(copies_XD.shape[0], device=device)[:, None] < offsets_L[-1:]
        plan.to_rank_TP, plan.inverse_MK, plan.valid_MK, plan.order_X = to_rank_TP, inverse_MK, valid_MK, order_X
        ctx.plan = plan
        ctx.save_for_backward(on_rank_PTK)
        ctx.layout = (num_cols, top_k, scores_TK.dtype)
        ctx.mark_non_differentiable(offsets_L)
        return copies_XD, recv_scores_MK, offsets_L

    @staticmethod
    def backward(
        ctx, grad_copies_XD: torch.Tensor, grad_recv_scores_MK: torch.Tensor | None, _
    ) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        self = plan.dispatcher
        (on_rank_PTK,) = ctx.saved_tensors
        num_cols, top_k, scores_dtype = ctx.layout
        _, _, slot_TP = plan.grid
        if plan.keep_X1 is not None:
            grad_copies_XD = torch.where(plan.keep_X1, grad_copies_XD, 0)
        grad_recv_x_MD = gather_sum_rows(grad_copies_XD, plan.inverse_MK, valid_TK=plan.valid_MK)
        if grad_recv_scores_MK is None:
            grad_recv_scores_MK = grad_recv_x_MD.new_zeros(grad_recv_x_MD.shape[0], top_k, dtype=torch.float32)
        if self.options.packed:
            row_cols, routing_cols = _routing_layout(grad_recv_x_MD, top_k)
            grad_MW = grad_recv_x_MD.new_empty(grad_recv_x_MD.shape[0], row_cols + routing_cols)
            grad_MW[:, :num_cols] = grad_recv_x_MD
            grad_MW[:, num_cols:].zero_()
            _routing_view(grad_MW, row_cols)[:, :top_k] = grad_recv_scores_MK
            grad_GW = _all_to_all(grad_MW, plan.send_splits, plan.recv_splits, self.group)
            grad_sent_x_GD = grad_GW[:, :num_cols]
            grad_scores_GK = _routing_view(grad_GW, row_cols)[:, :top_k]
        else:
            grad_routing_MJ = torch.cat(
                [grad_recv_scores_MK.to(torch.float32), grad_recv_scores_MK.new_zeros(grad_recv_scores_MK.shape)], dim=1
            ).to(torch.float32)
            grad_sent_x_GD = _all_to_all(grad_recv_x_MD, plan.send_splits, plan.recv_splits, self.group)
            grad_scores_GK = _all_to_all(grad_routing_MJ, plan.send_splits, plan.recv_splits, self.group)[:, :top_k]
        grad_x_TD = gather_sum_rows(grad_sent_x_GD, slot_TP, valid_TK=plan.to_rank_TP)
        # Each (token, k) is on one rank: the sum over ranks adds zeros to it (exactly, in any order).
        grad_scores_PTK = grad_scores_GK.to(scores_dtype).view(on_rank_PTK.shape)
        zero = self._scalar(0, grad_scores_PTK.device)
        grad_scores_TK = torch.where(on_rank_PTK, grad_scores_PTK, zero).sum(0)
        return grad_x_TD, grad_scores_TK, None


class _GridCombine(torch.autograd.Function):
    """(expert outputs expert_out_XD, recv_scores_MK) -> out_TD: each received row's copies summed
    weighted by their scores (float32), sent back, each token's rows summed in rank order. The
    backward: the tokens' gradients sent back as rows (a gather), then each copy's scaled gradient
    and its dot product (the scores' gradient)."""

    @staticmethod
    def forward(ctx, expert_out_XD: torch.Tensor, recv_scores_MK: torch.Tensor, plan: _GridPlan) -> torch.Tensor:
        self = plan.dispatcher
        if plan.keep_X1 is not None:
            expert_out_XD = torch.where(plan.keep_X1, expert_out_XD, 0)
        partial_MD = gather_sum_rows(expert_out_XD, plan.inverse_MK, recv_scores_MK, plan.valid_MK)
        partial_SD = _all_to_all(partial_MD, plan.send_splits, plan.recv_splits, self.group)
        _, _, slot_TP = plan.grid
        ctx.plan = plan
        ctx.save_for_backward(expert_out_XD, recv_scores_MK)
        return gather_sum_rows(partial_SD, slot_TP, None, plan.to_rank_TP)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        self = plan.dispatcher
        expert_out_XD, recv_scores_MK = ctx.saved_tensors
        token_G = plan.grid[0]
        grad_partial_SD = gather_rows(grad_TD, token_G)
        grad_partial_MD = _all_to_all(grad_partial_SD, plan.recv_splits, plan.send_splits, self.group)
        top_k = recv_scores_MK.shape[1]
        order_X = plan.order_X
        grad_rows_XD, grad_weights_X = scaled_rows_and_dots(
            grad_partial_MD, expert_out_XD, order_X // top_k, recv_scores_MK.reshape(-1)[order_X]
        )
        if plan.keep_X1 is not None:
            grad_rows_XD = torch.where(plan.keep_X1, grad_rows_XD, 0)
        grad_scores_MK = torch.where(plan.valid_MK, grad_weights_X[plan.inverse_MK], 0.0).to(recv_scores_MK.dtype)
        return grad_rows_XD, grad_scores_MK, None


@dataclass
class _TokenCounts:
    """The dense grid's last exchange of the ep ranks' token counts, shared by a model's MoE layers."""

    values: list[int] | None = None
    layers: int = 0
    host_group: dist.ProcessGroup | None = None  # gloo, over the same ranks as the dispatchers' group


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


def _pack_rows(
    x_TD: torch.Tensor, token_G: torch.Tensor, scores_GK: torch.Tensor, ids_GK: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The rows `token_G` of `x_TD` with their routing (scores, then local expert ids) in trailing
    columns of the same rows, so that one all-to-all moves both (`_routing_layout`); and the
    number of columns before the routing."""
    num_cols, top_k = x_TD.shape[1], scores_GK.shape[1]
    row_cols, routing_cols = _routing_layout(x_TD, top_k)
    packed_GW = x_TD.new_empty(token_G.shape[0], row_cols + routing_cols)
    gather_rows(x_TD, token_G, out=packed_GW[:, :num_cols])
    if row_cols > num_cols:
        packed_GW[:, num_cols:row_cols].zero_()
    routing_GJ = _routing_view(packed_GW, row_cols)
    routing_GJ[:, :top_k] = scores_GK
    routing_GJ[:, top_k:] = ids_GK
    return packed_GW, row_cols


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
        packed_GW, row_cols = _pack_rows(x_TD, token_G, scores_GK, ids_GK)
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
