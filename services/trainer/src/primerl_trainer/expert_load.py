"""Load balance of a mixture-of-experts model over one optimizer step, as step metrics.

The model's forward returns the routed-token counts per MoE layer and expert
(`CausalLMOutput.tokens_per_expert`, over the tokens this rank ran); a forward hook on the model
collects them, and at the end of the step they are summed over the micro-batches and over all
ranks (each rank's tokens are its own, with data and context parallel alike):

    moe/max_load_ratio            the busiest expert of any layer, over its layer's mean
    moe/mean_max_load_ratio       each layer's busiest expert over its mean, averaged over layers
    moe/min_load_ratio            the idlest expert of any layer, over its layer's mean
    moe/unused_expert_fraction    experts of all layers that got no token
    moe/max_ep_rank_load_ratio    with expert parallel: the busiest rank's tokens (its experts'
                                  sum) over the mean, the straggler of the all-to-all
    moe/tokens_per_expert_max     the largest count of any expert of any layer (token copies)
    moe/tokens_per_expert_min     the smallest
    moe/layer_<n>/max_load_ratio  per MoE layer n (the model's layer number): one metric a layer

A ratio of 1 is a perfect balance. The hook sees the model's whole forward, never a block's
recomputation under activation checkpointing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertLoad", "load_metrics"]


class ExpertLoad:
    """Collects the routed-token counts of a model's forwards; `None` from `of` for dense models."""

    def __init__(self, model: nn.Module, moe_layers: tuple[int, ...], ep: int) -> None:
        self.moe_layers = moe_layers
        self.ep = ep
        self._counts: list[torch.Tensor] = []
        model.register_forward_hook(self._collect)

    @classmethod
    def of(cls, model: nn.Module) -> ExpertLoad | None:
        moe_layers = tuple(getattr(getattr(model, "args", None), "moe_layers", ()))
        if not moe_layers:
            return None
        dispatchers = [m.dispatcher for m in model.modules() if getattr(m, "dispatcher", None) is not None]
        return cls(model, moe_layers, ep=dispatchers[0].ep if dispatchers else 1)

    def start(self) -> None:
        """Forget the counts collected so far (at the start of a step)."""
        self._counts.clear()

    def metrics(self, num_forwards: int) -> dict[str, float]:
        """Metrics of the first `num_forwards` forwards since `start` (the later ones repeat a
        micro-batch to even out the ranks), summed over all ranks. Collective."""
        counts_LE = torch.stack(self._counts[:num_forwards]).sum(0) if num_forwards else None
        if counts_LE is None:  # a rank with no micro-batch of its own still joins the reduction
            counts_LE = self._counts[0].new_zeros(self._counts[0].shape)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts_LE)
        self._counts.clear()
        return load_metrics(counts_LE, moe_layers=self.moe_layers, ep=self.ep)

    def _collect(self, module: nn.Module, args: object, output: object) -> None:
        counts = getattr(output, "tokens_per_expert", None)
        if module.training and counts is not None:
            self._counts.append(counts.detach())


def load_metrics(counts_LE: torch.Tensor, *, moe_layers: tuple[int, ...], ep: int = 1) -> dict[str, float]:
    """The module docstring's metrics from routed-token counts [MoE layers, experts]."""
    counts = counts_LE.to(torch.float64)
    num_layers = counts.shape[0]
    load = _ratio_to_mean(counts)
    max_per_layer, min_per_layer = load.max(dim=1).values, load.min(dim=1).values
    values = {
        "moe/max_load_ratio": max_per_layer.max(),
        "moe/mean_max_load_ratio": max_per_layer.mean(),
        "moe/min_load_ratio": min_per_layer.min(),
        "moe/unused_expert_fraction": (counts == 0).to(torch.float64).mean(),
        "moe/tokens_per_expert_max": counts.max(),
        "moe/tokens_per_expert_min": counts.min(),
    }
    if ep > 1:
        values["moe/max_ep_rank_load_ratio"] = _ratio_to_mean(counts.view(num_layers, ep, -1).sum(dim=2)).max()
    for index, layer in enumerate(moe_layers):
        values[f"moe/layer_{layer}/max_load_ratio"] = max_per_layer[index]
    # One device-to-host copy for all of them.
    names = list(values)
    return dict(zip(names, torch.stack([values[n] for n in names]).tolist(), strict=True))


def _ratio_to_mean(counts_LX: torch.Tensor) -> torch.Tensor:
    """Each count over its row's mean; 1 for a row without tokens (nothing to balance)."""
    total_L1 = counts_LX.sum(dim=1, keepdim=True)
    return torch.where(total_L1 > 0, counts_LX * counts_LX.shape[1] / total_L1.clamp(min=1), 1.0)
