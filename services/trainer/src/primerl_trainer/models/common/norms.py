"""RMSNorm with Hugging Face's rounding: normalised in float32, cast back, then scaled."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weight multiplies the value already cast to the input dtype (as transformers
        # does), so bf16 outputs round exactly as the reference's; torch.compile fuses this.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
