"""`model.fp8`: the decoder blocks' matrix products in block-scaled FP8 (kernels/fp8_linear.py,
DeepSeek-V3's recipe), converted in one place for every own family (parallelize_qwen3, which
all families' parallelize functions end in, calls `convert_to_fp8` before checkpointing,
compile and FSDP2 wrap the blocks).

What converts, inside `model.layers`: every nn.Linear (attention projections, dense MLPs, shared
experts, the linear-attention layers' projections, attention output gates) becomes an
Fp8Linear, and every GroupedExperts runs its products through fp8_grouped_linear. What stays
as it is: the routers' gates (their scores pick the experts), the sparse-attention indexers
(frozen; their scores pick the keys), everything outside the blocks (the embedding, the
vocabulary projection), the norms, attention itself and the loss; and any layer whose
dimensions are not multiples of 16 (cuBLAS's FP8 products refuse them; logged). Classes are
swapped or an attribute set in place: parameters, their names and the state dict stay the
same, so checkpoints, Hugging Face export and weight publishing do not notice. The weights
keep their dtype (master copy and optimizer state as configured); only each product's
operands are quantized, on every call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from primerl_trainer.kernels.fp8_linear import (
    FP8_BACKENDS,
    FP8_WEIGHT_GRADS,
    Fp8Backend,
    Fp8WeightGrad,
    check_fp8_device,
)
from primerl_trainer.models.common.linear import Fp8Linear
from primerl_trainer.models.common.sparse_attention import LightningIndexer
from primerl_trainer.models.moe import GroupedExperts, TokenChoiceTopKRouter

__all__ = ["Fp8Conversion", "convert_to_fp8"]

logger = logging.getLogger(__name__)

# Modules whose layers keep their dtype: their scores choose (experts, keys), as today.
_KEPT_MODULES = (TokenChoiceTopKRouter, LightningIndexer)
# cuBLAS's FP8 products take dimensions in multiples of this (kernels/fp8_linear.py).
_ALIGN = 16


@dataclass(frozen=True)
class Fp8Conversion:
    """What `convert_to_fp8` did, by module name under the converted root."""

    linears: tuple[str, ...]  # nn.Linear layers now Fp8Linear
    experts: tuple[str, ...]  # GroupedExperts now in FP8
    unaligned: tuple[str, ...]  # layers left in their dtype: a dimension not a multiple of 16


def convert_to_fp8(
    blocks: nn.Module, *, backend: Fp8Backend, device: torch.device | str, weight_grad: Fp8WeightGrad = "fp8"
) -> Fp8Conversion:
    """Converts the layers of `blocks` (a model's `layers`) in place, as the module docstring
    says. `device`: where the model will run; a backend is refused (ValueError naming
    model.fp8 or model.fp8_backend) where it cannot run. `weight_grad`: model.fp8_weight_grad."""
    if backend not in FP8_BACKENDS:
        raise ValueError(f"model.fp8_backend must be one of {FP8_BACKENDS}, got {backend!r}")
    if weight_grad not in FP8_WEIGHT_GRADS:
        raise ValueError(f"model.fp8_weight_grad must be one of {FP8_WEIGHT_GRADS}, got {weight_grad!r}")
    check_fp8_device(device, backend)
    kept = [name for name, module in blocks.named_modules() if isinstance(module, _KEPT_MODULES)]
    linears, experts, unaligned = [], [], []
    for name, module in blocks.named_modules():
        if any(name == k or name.startswith(k + ".") for k in kept):
            continue
        if isinstance(module, GroupedExperts):
            # w13 [E, 2F (F without a gate), D] and w2 [E, D, F]: every product's dimensions.
            sizes = (*module.w13.shape[-2:], *module.w2.shape[-2:])
        elif type(module) is nn.Linear:  # not a subclass: already converted, or parametrized
            sizes = (module.out_features, module.in_features)
        else:
            continue
        if any(size % _ALIGN for size in sizes):
            unaligned.append(name)
        elif isinstance(module, GroupedExperts):
            module.fp8_backend, module.fp8_weight_grad = backend, weight_grad
            experts.append(name)
        else:
            module.__class__ = Fp8Linear
            module.fp8_backend, module.fp8_weight_grad = backend, weight_grad
            linears.append(name)
    conversion = Fp8Conversion(tuple(linears), tuple(experts), tuple(unaligned))
    logger.info(
        "model.fp8 (%s backend): %d linear layers and %d expert groups in FP8; %d kept in their dtype, "
        "a dimension not a multiple of %d: %s",
        backend,
        len(linears),
        len(experts),
        len(unaligned),
        _ALIGN,
        ", ".join(unaligned) or "none",
        extra={"fp8_backend": backend, "fp8_unaligned": list(unaligned)},
    )
    return conversion
