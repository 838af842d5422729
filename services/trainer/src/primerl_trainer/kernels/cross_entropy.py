"""Cross-entropy of a linear layer's outputs (the vocabulary projection) without materialising
them: rows are processed in chunks, and each chunk's gradient is taken in the same pass (the
fused linear cross-entropy of Liger-Kernel), so one chunk of logits exists at a time, in the
model's dtype, and no float32 copy of the logits is ever written.

    out = linear_cross_entropy(hidden_ND, weight_VD, targets_N)
    out.loss.backward()  # gradients of hidden and weight

Per row n, with z = hidden[n] @ weight.T / temperatures[n]:
    logprobs[n] = z[targets[n]] - logsumexp(z)      entropy[n] = -sum(softmax(z) * log_softmax(z))
    loss = -sum_n token_weights[n] * logprobs[n]
`token_weights` default to the mean over rows whose target is not `ignore_index` (what
F.cross_entropy computes); the trainer's SFT loss is the same with weights loss_mask /
num_loss_tokens. Because the loss is linear in the logprobs with weights known up front,
d loss / d logits is known during the forward: the forward runs all three matrix products
(logits, the hidden states' gradient, the weight's gradient) chunk by chunk, writing each
chunk's gradient over its logits, and the backward only scales the stored gradients by the
incoming scalar. A loss that is not linear in the logprobs (the RL loss: ratios, masks that
depend on p) needs the logprobs' own gradient, which this function does not give.

Shape letters: N rows, D hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path below is used
    triton = None

__all__ = ["LinearCrossEntropyOutput", "linear_cross_entropy"]

# Logit elements per chunk: 2^29 bf16 logits are 1 GiB (~3,500 rows of Qwen3's 151,936),
# wide enough for the three matrix products to run near their full rate.
_CHUNK_ELEMENTS = 2**29
_BLOCK = 2048


class LinearCrossEntropyOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable with respect to hidden and weight
    logprobs: torch.Tensor  # [N] float32 (float64 for float64 inputs), detached
    entropy: torch.Tensor  # [N], detached


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    temperatures: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> LinearCrossEntropyOutput:
    """hidden [N, D] and weight [V, D] of one floating dtype, targets [N] integer ids (rows
    whose target is `ignore_index` add nothing to the loss), token_weights [N] and
    temperatures [N] (> 0) optional. `chunk_size`: rows per chunk (default ~2^29 logits)."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, D] and weight [V, D], got {list(hidden.shape)} and {list(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    num_rows, vocab_size = hidden.shape[0], weight.shape[0]
    for name, tensor in (("targets", targets), ("token_weights", token_weights), ("temperatures", temperatures)):
        if tensor is not None and tuple(tensor.shape) != (num_rows,):
            raise ValueError(f"{name} must have shape [{num_rows}], got {list(tensor.shape)}")
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // vocab_size)
        num_chunks = -(-num_rows // chunk_size)
        chunk_size = max(1, -(-num_rows // num_chunks))  # equal chunks, not one short tail
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    valid = targets != ignore_index
    if token_weights is None:
        # On the device: no sync for the count.
        coefs = valid.to(compute_dtype) / valid.sum().clamp(min=1)
    else:
        coefs = torch.where(valid, token_weights.to(compute_dtype), 0.0)
    safe_targets = torch.where(valid, targets, 0).to(torch.int64)
    if temperatures is None:
        inv_temperatures = torch.ones(num_rows, dtype=compute_dtype, device=hidden.device)
    else:
        inv_temperatures = 1.0 / temperatures.to(compute_dtype)
    loss, logprobs, entropy = _LinearCrossEntropy.apply(
        hidden, weight, safe_targets, coefs.contiguous(), inv_temperatures.contiguous(), chunk_size
    )
    return LinearCrossEntropyOutput(loss, torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        coefs: torch.Tensor,
        inv_temperatures: torch.Tensor,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_rows = hidden.shape[0]
        needs_hidden_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        logprobs = torch.empty(num_rows, dtype=coefs.dtype, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        grad_hidden = torch.empty_like(hidden) if needs_hidden_grad else None
        grad_weight = None
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            hidden_chunk = hidden[rows]
            logits = torch.mm(hidden_chunk, weight.t())
            # Overwrites the logits with d loss / d logits.
            _softmax_gradient_(
                logits, targets[rows], inv_temperatures[rows], coefs[rows], logprobs[rows], entropy[rows]
            )
            if needs_hidden_grad:
                torch.mm(logits, weight, out=grad_hidden[rows])
            if needs_weight_grad:
                # Accumulated in the weight's dtype: one rounding per chunk.
                if grad_weight is None:
                    grad_weight = torch.mm(logits.t(), hidden_chunk)
                else:
                    grad_weight.addmm_(logits.t(), hidden_chunk)
        loss = -(coefs * logprobs).sum()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: torch.Tensor,
        grad_logprobs: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        # Out of place, so that a second backward (retain_graph) scales the stored values again.
        scale = grad_loss.to(grad_hidden.dtype if grad_hidden is not None else grad_weight.dtype)
        return (
            None if grad_hidden is None else grad_hidden * scale,
            None if grad_weight is None else grad_weight * scale,
            None,
            None,
            None,
            None,
        )


def _softmax_gradient_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperatures: torch.Tensor,
    coefs: torch.Tensor,
    logprobs_out: torch.Tensor,
    entropy_out: torch.Tensor,
) -> None:
    """Writes logprobs and entropies of the rows of `logits` [R, V] and replaces the logits
    with coefs * inv_temperature * (softmax - onehot(target)), the gradient of
    -coefs * logprob."""
    if triton is not None and logits.is_cuda:
        assert logits.is_contiguous()
        num_rows, vocab_size = logits.shape
        _softmax_gradient_kernel[(num_rows,)](
            logits,
            logits.stride(0),
            targets,
            inv_temperatures,
            coefs,
            logprobs_out,
            entropy_out,
            vocab_size,
            BLOCK=_BLOCK,
            num_warps=8,
        )
        return
    scaled = logits.to(coefs.dtype) * inv_temperatures[:, None]
    lse = torch.logsumexp(scaled, dim=-1)
    probs = torch.exp(scaled - lse[:, None])
    logprobs_out.copy_(scaled.gather(1, targets[:, None]).squeeze(1) - lse)
    # sum p * (lse - z), not lse - sum p * z: the terms are >= 0, nothing cancels when the
    # distribution is sharp.
    entropy_out.copy_((probs * (lse[:, None] - scaled)).sum(dim=-1))
    probs.scatter_add_(1, targets[:, None], -torch.ones_like(lse[:, None]))
    logits.copy_(probs.mul_((coefs * inv_temperatures)[:, None]))


if triton is not None:

    @triton.jit
    def _softmax_gradient_kernel(
        logits_ptr,
        row_stride,
        targets_ptr,
        inv_temperatures_ptr,
        coefs_ptr,
        logprobs_ptr,
        entropy_ptr,
        vocab_size,
        BLOCK: tl.constexpr,
    ):
        """One program per row: an online max / sum of exponentials over the row, then a second
        pass that writes the gradient in place and sums the entropy."""
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        target = tl.load(targets_ptr + row)
        inv_temperature = tl.load(inv_temperatures_ptr + row).to(tl.float32)
        coef = tl.load(coefs_ptr + row).to(tl.float32)
        columns = tl.arange(0, BLOCK)

        max_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        sum_vec = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + columns
            z = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32) * inv_temperature
            new_max = tl.maximum(max_vec, z)
            # A lane that has seen only padding keeps max -inf; exp(-inf - -inf) would be NaN.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            sum_vec = sum_vec * tl.exp(max_vec - safe_max) + tl.exp(z - safe_max)
            max_vec = new_max
        row_max = tl.max(max_vec, axis=0)
        lse = row_max + tl.log(tl.sum(sum_vec * tl.exp(max_vec - row_max), axis=0))
        logprob = tl.load(row_ptr + target).to(tl.float32) * inv_temperature - lse

        scale = coef * inv_temperature
        entropy_vec = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + columns
            mask = cols < vocab_size
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
            probs = tl.exp(z - lse)
            entropy_vec += tl.where(mask, probs * (lse - z), 0.0)
            grad = scale * (probs - tl.where(cols == target, 1.0, 0.0))
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)
        tl.store(logprobs_ptr + row, logprob)
        tl.store(entropy_ptr + row, tl.sum(entropy_vec, axis=0))
