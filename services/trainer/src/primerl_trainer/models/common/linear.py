"""Linear products of the decoder blocks that `model.fp8` can run in block-scaled FP8:
`Fp8Linear`, an nn.Linear whose product is kernels.fp8_linear's, and `fused_linear`, the one
product of several layers that read the same input (q, k and v; gate and up). models/fp8.py
decides which layers convert."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.kernels.fp8_linear import Fp8Backend, Fp8WeightGrad, fp8_linear

__all__ = ["Fp8Linear", "fused_linear"]


class Fp8Linear(nn.Linear):
    """nn.Linear whose product runs in FP8 (fp8_linear with `fp8_backend`): the same parameters
    under the same names, so state dicts, checkpoints and exports do not change. Made from an
    nn.Linear in place by models.fp8.convert_to_fp8 (its class is swapped, nothing is copied)."""

    fp8_backend: Fp8Backend = "scaled_mm"
    fp8_weight_grad: Fp8WeightGrad = "fp8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, backend=self.fp8_backend, weight_grad=self.fp8_weight_grad)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_backend={self.fp8_backend}, fp8_weight_grad={self.fp8_weight_grad}"


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> torch.Tensor:
    """x through `layers` (the same in_features; all with a bias or none) as one product of their
    weights concatenated along the outputs, for the caller to split: the weights stay separate
    parameters (checkpoint names, FSDP units, LoRA), the copy is of the weights, not of the
    activations, and one wide product runs at a better efficiency than several narrow ones.
    In FP8 when every layer is an Fp8Linear."""
    weight = torch.cat([layer.weight for layer in layers])
    bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
    if all(isinstance(layer, Fp8Linear) for layer in layers):
        return fp8_linear(x, weight, bias, backend=layers[0].fp8_backend, weight_grad=layers[0].fp8_weight_grad)
    return F.linear(x, weight, bias)
