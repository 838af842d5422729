"""What every causal LM of the registry returns, whatever its implementation."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CausalLMOutput:
    """logits: [B, T, vocab] in the model's dtype; None when the forward was asked for
    hidden_states instead (`compute_logits=False`).

    hidden_states: [B, T, dim], the final-normed hidden states the vocabulary projection
    reads, for a loss that applies the head itself (kernels.linear_cross_entropy with the
    model's `output_weight`); None otherwise.

    For mixture-of-experts models, over the B*T tokens in row-major order and the MoE layers
    in order (dense layers of the model are skipped):
    - routed_experts: [B*T, num_moe_layers, top_k] int64, the experts each token was sent to
      (the replayed ones when the forward was given `routed_experts`);
    - tokens_per_expert: [num_moe_layers, num_experts] int64, routed token counts (load
      balance metrics).
    Both are None for dense models."""

    logits: torch.Tensor | None
    routed_experts: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
