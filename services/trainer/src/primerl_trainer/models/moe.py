"""Mixture-of-experts building blocks: a token-choice top-k router (softmax, or grouped sigmoid
with a correction bias) that can replay given expert indices (R3), and routed experts run as
grouped matrix products.

Shape letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token,
N = T * K routed token copies.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from primerl_trainer.config_types import EXPERTS_IMPLS, ExpertsImpl
from primerl_trainer.kernels.fp8_linear import Fp8Backend, Fp8WeightGrad, fp8_grouped_linear
from primerl_trainer.kernels.gather import accumulation_dtype, gather_sum
from primerl_trainer.kernels.grouped_weight_grad import add_grouped_weight_grad, adds_into_grad
from primerl_trainer.kernels.swiglu import SwiGLURows, fused_swiglu_available


@dataclass(frozen=True)
class GroupedSigmoidRouting:
    """Routing of DeepSeek-V3 and GLM-4.5 (in place of the softmax): per-expert sigmoid scores.
    The choice adds the router's `e_score_correction_bias` (a float32 buffer, the checkpoint's
    load-balancing bias; the loss does not train it) to the scores, keeps the `top_k_groups` of
    the `num_groups` equal groups of experts whose two best biased scores sum highest and takes
    the top-k inside them. The weights are the unbiased scores at the chosen experts
    (renormalised with `norm_topk_prob`), times `scaling_factor`."""

    num_groups: int = 1
    top_k_groups: int = 1
    scaling_factor: float = 1.0
    # Laguna's `moe_router_logit_softcapping`: the router's logits become cap * tanh(logits / cap)
    # before the sigmoid (0: none).
    logit_softcap: float = 0.0

    def check(self, *, num_experts: int, top_k: int) -> None:
        if self.num_groups < 1 or num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must be positive and divide the experts ({num_experts})")
        per_group = num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ValueError(f"grouped routing needs at least 2 experts per group, got {per_group}")
        if not 1 <= self.top_k_groups <= self.num_groups:
            raise ValueError(f"topk_group ({self.top_k_groups}) must lie in [1, n_group = {self.num_groups}]")
        if top_k > self.top_k_groups * per_group:
            raise ValueError(f"top_k ({top_k}) exceeds the experts of the topk_group best groups")


class TokenChoiceTopKRouter(nn.Module):
    """Token-choice top-k routing. Default: softmax over the experts, top-k, optional
    renormalisation of the k scores (Qwen3-MoE's `norm_topk_prob`). With `grouped_sigmoid`:
    GroupedSigmoidRouting's rule (the router then holds `e_score_correction_bias`)."""

    def __init__(
        self,
        *,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        grouped_sigmoid: GroupedSigmoidRouting | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.grouped_sigmoid = grouped_sigmoid
        if grouped_sigmoid is not None:
            grouped_sigmoid.check(num_experts=num_experts, top_k=top_k)
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(
        self, x_TD: torch.Tensor, replayed_experts_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (scores [T, K] in x's dtype, expert ids [T, K] int64).

        With `replayed_experts_TK` (int64, validated by the caller) those experts are used
        instead of the router's choice, and the scores are gathered at them by the same rule:
        the gate still gets gradients through the scores of the experts that inference chose."""
        if self.grouped_sigmoid is None:
            probs_TE = F.softmax(self.gate(x_TD), dim=-1, dtype=torch.float32)
        else:
            # In float32 from the start, as the reference computes the router's logits.
            logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
            if self.grouped_sigmoid.logit_softcap > 0:
                cap = self.grouped_sigmoid.logit_softcap
                logits_TE = torch.tanh(logits_TE / cap) * cap
            probs_TE = torch.sigmoid(logits_TE)
        if replayed_experts_TK is None:
            expert_ids_TK = torch.topk(self._choice_scores(probs_TE), self.top_k, dim=-1).indices
        else:
            expert_ids_TK = replayed_experts_TK
        scores_TK = probs_TE.gather(-1, expert_ids_TK)
        if self.norm_topk_prob:
            # The epsilon only matters for sigmoid scores that all round to zero.
            scores_TK = scores_TK / (scores_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.grouped_sigmoid is not None:
            scores_TK = scores_TK * self.grouped_sigmoid.scaling_factor
        return scores_TK.to(x_TD.dtype), expert_ids_TK

    def _choice_scores(self, probs_TE: torch.Tensor) -> torch.Tensor:
        """What the top-k picks from: the scores, or (grouped sigmoid) the biased scores with
        the experts outside the best groups at -inf. No gradient flows through a choice."""
        routing = self.grouped_sigmoid
        if routing is None:
            return probs_TE
        choice_TE = probs_TE.detach() + self.e_score_correction_bias.float()
        if routing.num_groups == 1:
            return choice_TE
        choice_TGX = choice_TE.view(choice_TE.shape[0], routing.num_groups, -1)
        group_scores_TG = choice_TGX.topk(2, dim=-1).values.sum(dim=-1)
        best_TG = group_scores_TG.topk(routing.top_k_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_TG, True)
        return choice_TGX.masked_fill(~keep_TG[..., None], float("-inf")).view_as(choice_TE)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored stacked: w13 [E, 2F, D] (gate rows then up rows, vLLM's and
    transformers' fused layout) and w2 [E, D, F].

    `fp8_backend` (set by models.fp8.convert_to_fp8 for `model.fp8`): the products run in
    block-scaled FP8 (kernels.fp8_linear.fp8_grouped_linear) whatever `experts_impl`; None: in
    the weights' dtype, through torch._grouped_mm or the per-expert loop."""

    fp8_backend: Fp8Backend | None = None
    fp8_weight_grad: Fp8WeightGrad = "fp8"

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, experts_impl: ExpertsImpl = "auto") -> None:
        super().__init__()
        if experts_impl not in EXPERTS_IMPLS:
            raise ValueError(f"experts_impl must be one of {EXPERTS_IMPLS}, got {experts_impl!r}")
        self.num_experts = num_experts
        self.experts_impl = experts_impl
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x_ND: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """x_ND sorted by expert; offsets_E [E] int32: the end of each expert's rows.

        Under expert parallel the weights are DTensors sharded on the expert dim: E is then this
        rank's experts, and the products read its rows (`to_local`, through which gradients flow)."""
        w13, w2 = _local(self.w13), _local(self.w2)
        if self._use_grouped_products(x_ND):
            gate_up = self._grouped_product(x_ND, w13, offsets_E)
            if fused_swiglu_available(gate_up):
                return self._grouped_product(SwiGLURows.apply(gate_up, offsets_E[-1:]), w2, offsets_E)
            gate, up = gate_up.chunk(2, dim=-1)
            return self._grouped_product(F.silu(gate) * up, w2, offsets_E)
        # Reference path: one matmul pair per expert, with a device sync for the sizes.
        sizes = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
        outs = []
        for expert, x in enumerate(torch.split(x_ND, sizes)):
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[expert]))
        return torch.cat(outs)

    def takes_padded_rows(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes rows like `x` past offsets_E[-1] (expert parallel's padded
        copies, distributed.expert_parallel), leaving them uncomputed: their outputs and input
        gradients are then unspecified, and nothing they hold reaches the computed rows. So with
        the grouped products in the weights' dtype (torch._grouped_mm computes the rows of the
        groups alone); not the per-expert loop (which splits every row by the offsets) nor FP8
        (which quantizes every row)."""
        return self.fp8_backend is None and self._use_grouped_products(x)

    def _use_grouped_products(self, x: torch.Tensor) -> bool:
        """Whether the products are grouped (`_grouped_product`) rather than the per-expert loop."""
        if self.fp8_backend is not None:
            return True
        if self.experts_impl != "auto":
            return self.experts_impl == "grouped_mm"
        return grouped_mm_supported(x.device, x.dtype)

    def _grouped_product(self, x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """Row block e of x_NI times w_EOI[e]^T -> [N, O]: in FP8 with `fp8_backend`, else
        through torch._grouped_mm (`_grouped_linear`)."""
        if self.fp8_backend is not None:
            return fp8_grouped_linear(
                x_NI, w_EOI, offsets_E, backend=self.fp8_backend, weight_grad=self.fp8_weight_grad
            )
        return _grouped_linear(x_NI, w_EOI, offsets_E)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _grouped_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Row block e of x_NI times w_EOI[e]^T -> [N, O], through torch._grouped_mm. Where
    kernels.grouped_weight_grad.adds_into_grad allows, the backward adds the weight's gradient
    into `w.grad` inside the product (that module says why); the first micro-batch's gradient
    (no `.grad` yet) is torch._grouped_mm's."""
    if not adds_into_grad(w_EOI):
        return torch._grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offsets_E)
    return _grouped_linear_into_grad(x_NI, w_EOI, offsets_E)


@torch.library.custom_op("primerl::grouped_linear_into_grad", mutates_args=())
def _grouped_linear_into_grad(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offsets_E)


@_grouped_linear_into_grad.register_fake
def _(x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("primerl::grouped_linear_into_grad_backward", mutates_args=())
def _grouped_linear_into_grad_backward(
    grad_NO: torch.Tensor, x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """Returns x's gradient; adds w's into w.grad (creates it when there is none)."""
    grad_NO = grad_NO.contiguous()
    add_grouped_weight_grad(w_EOI, grad_NO, x_NI, offsets_E)
    return torch._grouped_mm(grad_NO, w_EOI, offs=offsets_E)


@_grouped_linear_into_grad_backward.register_fake
def _(grad_NO: torch.Tensor, x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x_NI)


def _grouped_linear_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_linear_backward(ctx, grad_NO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_NI, w_EOI, offsets_E = ctx.saved_tensors
    return _grouped_linear_into_grad_backward(grad_NO, x_NI, w_EOI, offsets_E), None, None


_grouped_linear_into_grad.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup_context)


# Traced as a constant by torch.compile: the answer depends only on the device and dtype,
# which the compiled graph guards on anyway.
@torch.compiler.assume_constant_result
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether "auto" runs the experts through torch._grouped_mm: on the CPU (torch 2.11 and
    2.13 take float32 and bf16), and on CUDA for bf16 on compute capability 9.0+, where its
    CUTLASS kernels are. CUDA float32 (parity runs) keeps the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


class MoE(nn.Module):
    """Router + routed experts. Tokens are permuted so that each expert's rows are contiguous,
    run through the grouped experts, put back in token order and mixed by their scores.

    `dispatcher` (set by expert parallel, distributed.expert_parallel) takes over once the router
    has chosen: called with the tokens, their scores and expert ids and the local experts, it
    returns the mixed outputs and the tokens per expert, as this forward does."""

    dispatcher: (
        Callable[
            [torch.Tensor, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]],
            tuple[torch.Tensor, torch.Tensor],
        ]
        | None
    ) = None

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        experts_impl: ExpertsImpl = "auto",
        grouped_sigmoid: GroupedSigmoidRouting | None = None,
    ) -> None:
        super().__init__()
        self.router = TokenChoiceTopKRouter(
            dim=dim,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
            grouped_sigmoid=grouped_sigmoid,
        )
        self.experts = GroupedExperts(
            dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, experts_impl=experts_impl
        )

    def forward(
        self, x: torch.Tensor, replayed_experts_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> (out like x, expert ids [T, K], tokens per expert [E])."""
        x_TD = x.reshape(-1, x.shape[-1])
        top_k = self.router.top_k
        scores_TK, expert_ids_TK = self.router(x_TD, replayed_experts_TK)
        if self.dispatcher is not None:
            out_TD, tokens_per_expert_E = self.dispatcher(x_TD, scores_TK, expert_ids_TK, self.experts)
            return out_TD.view_as(x), expert_ids_TK, tokens_per_expert_E

        # A stable sort groups the N token copies by expert; searchsorted on the sorted ids
        # gives each expert's end offset. Neither syncs with the host nor needs atomics,
        # so the path is deterministic and compiles without graph breaks.
        sorted_ids_N, order_N = torch.sort(expert_ids_TK.reshape(-1), stable=True)
        boundaries_E = torch.arange(1, self.experts.num_experts + 1, device=x.device, dtype=sorted_ids_N.dtype)
        offsets_E = torch.searchsorted(sorted_ids_N, boundaries_E, out_int32=True)
        # inverse_N[copy] = the row of (token, k) copy `copy` in expert order.
        inverse_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=x.device))

        routed_ND = self.experts(_DispatchToExperts.apply(x_TD, order_N, inverse_N, top_k), offsets_E)
        out_TD = _CombineFromExperts.apply(routed_ND, scores_TK, order_N, inverse_N)
        tokens_per_expert_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).long()
        return out_TD.view_as(x), expert_ids_TK, tokens_per_expert_E


# The two permutations between token order and expert order, with backwards written as
# gathers: autograd's own backward of an index is a scatter-add (a sort or atomics per call),
# although every row here has a known source.


class _DispatchToExperts(torch.autograd.Function):
    """x_TD [T, D] -> x_ND [N, D]: row n is token order_N[n] // K. The backward sums each
    token's K copies, gathered through inverse_N, in float32."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x_TD: torch.Tensor,
        order_N: torch.Tensor,
        inverse_N: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse_N)
        ctx.top_k = top_k
        return x_TD[order_N // top_k]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_ND: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse_N,) = ctx.saved_tensors
        return gather_sum(grad_ND, inverse_N.view(-1, ctx.top_k)), None, None, None


class _CombineFromExperts(torch.autograd.Function):
    """routed_ND [N, D] in expert order, scores_TK [T, K] -> out_TD [T, D], the sum over k of
    scores[t, k] * routed[inverse_N[t * K + k]], accumulated in float32 (as a bmm would)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        routed_ND: torch.Tensor,
        scores_TK: torch.Tensor,
        order_N: torch.Tensor,
        inverse_N: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(routed_ND, scores_TK, order_N, inverse_N)
        return gather_sum(routed_ND, inverse_N.view(scores_TK.shape), scores_TK)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        routed_ND, scores_TK, order_N, inverse_N = ctx.saved_tensors
        num_tokens, top_k = scores_TK.shape
        dtype = accumulation_dtype(routed_ND)
        # Both gradients are taken in expert order, where routed_ND is read contiguously and the
        # gathered rows of grad_TD (T rows, K reads each) mostly hit the cache.
        # Row n of expert order is copy order_N[n] of token order_N[n] // K.
        grad_copies_ND = grad_TD[order_N // top_k].to(dtype)
        grad_routed_ND = None
        if ctx.needs_input_grad[0]:
            copy_scores_N = scores_TK.reshape(-1)[order_N].to(dtype)
            grad_routed_ND = (grad_copies_ND * copy_scores_N[:, None]).to(routed_ND.dtype)
        grad_scores_TK = None
        if ctx.needs_input_grad[1]:
            grad_scores_N = (routed_ND.to(dtype) * grad_copies_ND).sum(dim=-1)
            grad_scores_TK = grad_scores_N[inverse_N].view(num_tokens, top_k).to(scores_TK.dtype)
        return grad_routed_ND, grad_scores_TK, None, None


def check_routed_experts(
    routed_experts: torch.Tensor, *, num_tokens: int, num_moe_layers: int, top_k: int, num_experts: int
) -> torch.Tensor:
    """Validates replayed expert indices [num_tokens, num_moe_layers, top_k] (uint8, uint16
    or any integer dtype, as inference sends them) and returns them as int64.

    The range check reads the values back to the host: one sync per forward, which is the
    price of a ValueError instead of a device-side indexing fault."""
    expected = (num_tokens, num_moe_layers, top_k)
    if tuple(routed_experts.shape) != expected:
        raise ValueError(
            f"routed_experts must have shape [num_tokens, num_moe_layers, top_k] = {list(expected)}, "
            f"got {list(routed_experts.shape)}"
        )
    if routed_experts.dtype.is_floating_point or routed_experts.dtype.is_complex or routed_experts.dtype == torch.bool:
        raise ValueError(f"routed_experts must hold integer expert indices, got dtype {routed_experts.dtype}")
    routed_experts = routed_experts.to(torch.int64)
    if routed_experts.numel() and (routed_experts.min() < 0 or routed_experts.max() >= num_experts):
        raise ValueError(
            f"routed_experts holds expert indices outside [0, {num_experts}): "
            f"min {routed_experts.min().item()}, max {routed_experts.max().item()}"
        )
    return routed_experts
