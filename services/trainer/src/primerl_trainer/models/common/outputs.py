"""What every causal LM of the registry returns, whatever its implementation."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CausalLMOutput:
    """logits: [B, T, vocab] in the model's dtype.

    For mixture-of-experts models, over the B*T tokens in row-major order and the MoE layers
    in order (dense layers of the model are skipped):
    - routed_experts: [B*T, num_moe_layers, top_k] int64, the experts each token was sent to
      (the replayed ones when the forward was given `routed_experts`);
    - tokens_per_expert: [num_moe_layers, num_experts] int64, routed token counts (load
      balance metrics).
    Both are None for dense models."""

    logits: torch.Tensor
    routed_experts: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None
