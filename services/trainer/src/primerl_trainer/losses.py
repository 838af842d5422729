"""Per-token logprobs from logits, and the trainer's losses (RL and SFT).

Token alignment, defined here once: a micro-batch is indexed by token t of a packed sequence.
`inference_logprobs[t]` is the logprob the inference engine gave `input_ids[t]` given the
tokens before it, `temperatures[t]` the temperature it was sampled at, and `loss_mask[t]`
marks tokens the policy sampled. The model's logits at row t predict token t + 1, so the
trainer's logprob of token t comes from logits row t - 1 divided by `temperatures[t]`. The
first token of each packed sample (position_ids == 0) has no prediction: the value there is
meaningless and `loss_mask` must be False there (batch.py rejects micro-batches where it is not).

Loss functions return this micro-batch's share of the batch loss, already divided by the
batch's global loss-token count, plus sums (not means) of their statistics, so that summing
over micro-batches and data-parallel ranks gives the batch's loss and statistics whatever the
split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primerl_trainer.config_types import RLLossConfig

__all__ = [
    "LossOutput",
    "RLLossConfig",
    "rl_loss",
    "sft_loss",
    "target_logprobs",
    "token_logprobs",
]

# Float32 elements per chunk of the logits: a chunk's few float32 temporaries take ~128 MiB each,
# whatever the vocabulary (~220 tokens at Qwen3's 151,936), instead of a float32 copy of all logits.
_CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class LossOutput:
    # Scalar: this micro-batch's share of the batch loss (differentiable).
    loss: torch.Tensor
    # Detached scalar sums over this micro-batch's loss tokens, e.g. "mismatch_kl", "masked_high".
    sums: dict[str, torch.Tensor]


# The logit given to excluded tokens: exp() of it is 0 and, unlike -inf, 0 times it is 0 (entropy).
_EXCLUDED_LOGIT = -1e30


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor, dtype: torch.dtype, excluded: torch.Tensor | None):
    """A chunk of logits in `dtype`, divided by its temperatures, the `excluded` columns out."""
    scaled = logits.to(dtype) / temperatures[:, None].to(dtype)
    return scaled if excluded is None else scaled.index_fill_(1, excluded, _EXCLUDED_LOGIT)


class _TokenLogprobs(torch.autograd.Function):
    """logprob[n] = log_softmax(logits[n] / temperatures[n])[targets[n]] and the entropy of that
    distribution, computed over chunks of rows so that no float32 copy of the whole logits
    exists; the backward recomputes each chunk's softmax from the saved logsumexp."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperatures: torch.Tensor,
        chunk_size: int,
        excluded: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows = logits.shape[0]
        # float64 stays float64 (gradient checks); bf16/fp16 are upcast chunk by chunk.
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        logprobs = torch.empty(num_rows, dtype=compute_dtype, device=logits.device)
        entropy = torch.empty_like(logprobs)
        logsumexp = torch.empty_like(logprobs)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            scaled = _scaled(logits[rows], temperatures[rows], compute_dtype, excluded)
            lse = torch.logsumexp(scaled, dim=-1)
            probs = torch.exp(scaled - lse[:, None])
            logsumexp[rows] = lse
            logprobs[rows] = scaled.gather(1, targets[rows, None]).squeeze(1) - lse
            # sum p * (lse - x), not lse - sum p * x: the terms are >= 0, nothing cancels when the
            # distribution is sharp.
            entropy[rows] = (probs * (lse[:, None] - scaled)).sum(dim=-1)
        ctx.save_for_backward(logits, targets, temperatures, logsumexp)
        ctx.chunk_size, ctx.excluded = chunk_size, excluded
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits, targets, temperatures, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            temperature = temperatures[rows, None].to(logsumexp.dtype)
            scaled = _scaled(logits[rows], temperatures[rows], logsumexp.dtype, ctx.excluded)
            grad_out = grad_logprobs[rows, None]
            # d logprob / d scaled = onehot(target) - softmax(scaled); then the 1/temperature.
            grad = torch.exp(scaled - logsumexp[rows, None]).mul_(-grad_out)
            grad.scatter_add_(1, targets[rows, None], grad_out)
            grad_logits[rows] = grad.div_(temperature)
        return grad_logits, None, None, None, None


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor, *, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs and entropies of a packed sequence, aligned with `input_ids`.

    `logits` [T, V] (any float dtype), `input_ids` [T] int64, `temperatures` [T] > 0. Returns
    float32 (float64 for float64 logits) `logprobs` [T] with logprobs[t] = log p(input_ids[t] |
    input_ids[<t]) at temperature temperatures[t], differentiable with respect to `logits`, and
    `entropy` [T], the entropy of the distribution token t was drawn from (not differentiable).
    Index 0 holds 0 for both; sample starts inside the sequence hold meaningless values.
    `chunk_size`: rows of logits upcast at a time (default: ~32M elements' worth).
    """
    # Row t predicts token t + 1. Scoring all T rows (the last against a dummy target) and shifting
    # the result, rather than slicing the logits, keeps the gradient one tensor the size of the
    # logits: the backward of a slice would allocate a second one to scatter into.
    logprobs, entropy = target_logprobs(
        logits, torch.roll(input_ids, -1), torch.roll(temperatures, -1), chunk_size=chunk_size
    )
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs[:-1]]), torch.cat([zero, entropy[:-1]])


def target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    chunk_size: int | None = None,
    excluded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, without the shift of `token_logprobs`: logprobs[n] = log_softmax(logits[n] /
    temperatures[n])[targets[n]] (differentiable) and the entropy of that distribution, for
    logits [N, V], targets [N] int64 and temperatures [N] > 0 (prediction-aligned terms, as
    context parallel splits them). `excluded`: token ids (int64, on the logits' device) the
    distribution leaves out, as the sampler does (a vision-language model's placeholders); a
    target among them gets a logprob of about -1e30."""
    num_rows, vocab_size = logits.shape
    assert targets.shape == temperatures.shape == (num_rows,), (logits.shape, targets.shape, temperatures.shape)
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // vocab_size)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _TokenLogprobs.apply(logits, targets, temperatures, chunk_size, excluded)


def rl_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_loss_tokens: int,
    config: RLLossConfig,
) -> LossOutput:
    """The RL loss of one micro-batch (see `RLLossConfig`), divided by the batch's `num_loss_tokens`.

    All arguments are [T] and aligned per token (see the module docstring). Sums: "mismatch_kl"
    of r - log r - 1 with r = p / q, the k3 estimator of KL(inference || trainer) from tokens the
    inference engine sampled; "masked_high" / "masked_low", the loss tokens the trust region
    dropped for p - q above / below it.
    """
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be positive, got {num_loss_tokens}")
    # Off the loss mask the log-ratio is set to 0 before any other op: values there can be
    # anything (sample starts, padding) and an inf would turn the loss or its gradient into NaN.
    log_ratio = torch.where(loss_mask, logprobs - inference_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        prob_diff = torch.exp(logprobs) - torch.exp(inference_logprobs)
        above = loss_mask & (prob_diff > config.mask_high)
        below = loss_mask & (prob_diff < -config.mask_low)
        if config.mask == "advantage_sign":
            above &= advantages > 0
            below &= advantages < 0
        keep = loss_mask & ~(above | below)
        detached_log_ratio = log_ratio.detach()
        # 0 off the loss mask, where the log-ratio is 0. expm1(x) - x, not exp(x) - x - 1: in
        # float32 the latter cancels to 0 or rounding noise for |x| below ~1e-3.
        mismatch_kl = torch.expm1(detached_log_ratio) - detached_log_ratio
    policy_loss = torch.where(keep, -advantages * ratio, 0.0).sum()
    kl_loss = log_ratio.square().sum()
    loss = (policy_loss + config.kl_coef * kl_loss) / num_loss_tokens
    sums = {
        "mismatch_kl": mismatch_kl.sum(),
        "masked_high": above.sum(),
        "masked_low": below.sum(),
    }
    return LossOutput(loss=loss, sums=sums)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, *, num_loss_tokens: int) -> LossOutput:
    """Cross-entropy of the loss tokens of one micro-batch, divided by the batch's `num_loss_tokens`."""
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be positive, got {num_loss_tokens}")
    loss = -torch.where(loss_mask, logprobs, 0.0).sum() / num_loss_tokens
    return LossOutput(loss=loss, sums={})
