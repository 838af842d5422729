"""The dense SwiGLU feed-forward block of Qwen-style models."""

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.models.common.linear import fused_linear


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x); w1/w3/w2 are Hugging Face's gate/up/down projections."""

    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Gate and up projections as one matrix product (the weights stay two parameters).
        gate, up = fused_linear(x, (self.w1, self.w3)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
