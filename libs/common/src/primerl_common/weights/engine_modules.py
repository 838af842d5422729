"""Which engine module a weight loads into, for HF and vLLM kernel-format tensor names
(named as Qwen3 and Qwen3-MoE name them; for other families the groups are at least as
large as vLLM's modules, and the replica finds the modules it has: see
primerl_inference.worker_extension). vLLM rebuilds a module from all of its tensors: q/k/v_proj make one
qkv_proj, gate/up_proj one gate_up_proj, every expert of a layer (w13 and w2) one experts
module, and a weight goes with its `_scale_inv`. So a delta update carries whole modules:
the weight broadcaster groups changed tensors by this, and a replica checks it."""

from __future__ import annotations

import re

__all__ = ["engine_module"]

# HF projections that vLLM fuses into one module.
_FUSED_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
# An HF expert weight: <layer>.mlp.experts.<expert id>.<projection>.weight.
_HF_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.")


def engine_module(name: str) -> str:
    """The engine module an HF or kernel-format tensor loads into."""
    if match := _HF_EXPERT.match(name):
        return match["experts"]
    module, dot, _ = name.rpartition(".")
    if not dot:  # a top-level tensor is a module of its own
        return name
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED_MODULES[leaf]}" if leaf in _FUSED_MODULES else module
