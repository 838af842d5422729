"""What the tests of own models against transformers' share: transformers' logits with the
experts its routers chose, and its gradients under the hub's names."""

import torch
from torch import nn

from primerl_trainer.models import HFCausalLM


def reference_forward(
    hf: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and the experts its routers chose [B*T, MoE layers, K], sorted.
    The routers are the `mlp.gate` modules of MoE layers, whose output's third item is the
    chosen expert ids (as in transformers' GLM-4.5 and MiniMax-M2 routers)."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
        for layer in hf.model.layers
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
    ]
    try:
        logits = hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(chosen, dim=1).sort(dim=-1).values


def hub_gradients(hf: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of transformers' model after a backward, under the checkpoint's names."""
    return HFCausalLM(hf).hf_state_dict({f"hf_model.{n}": p.grad for n, p in hf.named_parameters()})
