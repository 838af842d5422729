"""transformers' own model behind the registry's forward (impl="hf"): the reference the own
implementations are checked against, and the fallback for architectures they do not cover."""

import torch
from torch import nn

from primerl_trainer.models.common.outputs import CausalLMOutput


class HFCausalLM(nn.Module):
    """Wraps a transformers causal LM (`hf_model`). Packed rows work as with the own models:
    transformers splits them where the position ids restart. No router replay."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.num_experts = getattr(hf_model.config, "num_experts", None) or 0

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        routed_experts: torch.Tensor | None = None,
        compute_logits: bool = True,
    ) -> CausalLMOutput:
        if routed_experts is not None:
            raise ValueError("routed_experts (router replay) needs the own implementation (impl='custom' or 'auto')")
        if not compute_logits:
            raise ValueError("compute_logits=False (hidden states for a fused loss) needs the own implementation")
        # Without use_cache=False transformers builds a KV cache and skips the
        # packed-sequence mask, so packed samples would attend to each other.
        if not self.num_experts:
            out = self.hf_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            return CausalLMOutput(logits=out.logits)
        out = self.hf_model(input_ids=input_ids, position_ids=position_ids, output_router_logits=True, use_cache=False)
        # Softmax keeps the order, so the top-k of the logits is the router's choice.
        top_k = self.hf_model.config.num_experts_per_tok
        expert_ids = [logits.topk(top_k, dim=-1).indices for logits in out.router_logits]
        counts = [torch.bincount(ids.flatten(), minlength=self.num_experts) for ids in expert_ids]
        return CausalLMOutput(
            logits=out.logits, routed_experts=torch.stack(expert_ids, dim=1), tokens_per_expert=torch.stack(counts)
        )

    def hf_state_dict(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint's names: transformers 5 fuses experts in memory and names them back
        on save; a tied head is saved once, as the embedding."""
        from transformers.core_model_loading import revert_weight_conversion

        prefix = "hf_model."
        if state_dict is None:
            state_dict = self.hf_model.state_dict()
        else:
            state_dict = {key.removeprefix(prefix): value for key, value in state_dict.items()}
        if self.hf_model.config.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)
        return revert_weight_conversion(self.hf_model, state_dict)
