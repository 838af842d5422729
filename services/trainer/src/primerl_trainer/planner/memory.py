"""Peak memory per GPU of one training step, by part.

What each part counts (bytes, per GPU, B_m = master bytes, B_c = compute bytes):
- states: parameters, gradients and both AdamW moments, all in the master dtype and sharded by
  FSDP2 over all N ranks (experts over ep, then over N / ep): 4 * B_m * params / N.
- fsdp: the transient unsharded copies: a block gathered in B_c and the next one prefetched, then
  in backward the block's unsharded gradient in B_c and its float32 reduce-scatter input; the
  output head likewise (kept gathered from its forward to its backward).
- activations: what autograd saves for backward, per token and layer (`layer_activation_elements`),
  over the seq_len / cp tokens of one micro-batch on this GPU; with activation checkpointing only
  each block's input, plus one block recomputed. Then the backward's working set: one layer's
  activations again (their gradients).
- cp: the K and V (MLA: the latent) of the whole sequence, gathered by each layer's attention,
  beyond the local part.
- ep: the all-to-all send and receive buffers of one MoE layer's dispatch (balanced routing).
- logits: the trainer's loss path materialises [tokens, vocab] logits in B_c and their gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from primerl_trainer.planner.mesh import Mesh, Workload
from primerl_trainer.planner.rates import GpuRates
from primerl_trainer.planner.shapes import ModelShape

__all__ = ["MemoryEstimate", "estimate_memory", "layer_activation_elements"]

# token_logprobs' float32 chunks (losses._CHUNK_ELEMENTS = 2**25 elements): a few at a time.
_LOSS_CHUNK_BYTES = 3 * 2**25 * 4


@dataclass(frozen=True)
class MemoryEstimate:
    states: float
    fsdp: float
    activations: float
    cp: float
    ep: float
    logits: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def layer_activation_elements(shape: ModelShape, *, moe: bool) -> float:
    """Elements autograd saves per token in one layer (in the compute dtype; float32 router
    probabilities count double)."""
    dim = shape.hidden_size
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    qk, v = shape.qk_head_dim, shape.v_head_dim
    # Norm input and output; q and k before their norms and after rope; v; the attention output.
    attention = 2 * dim + 2 * heads * qk + 2 * kv_heads * qk + kv_heads * v + heads * v
    if shape.is_mla:
        attention += shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim
    if not moe:
        # Norm input and output; gate and up outputs; their SwiGLU product (the down input).
        return attention + 2 * dim + 3 * shape.intermediate_size
    moe_part = 2 * dim + 2 * shape.num_experts  # norms; router probabilities (float32)
    # Per routed copy: the dispatched input, gate+up outputs, the product, the expert output.
    moe_part += shape.top_k * (2 * dim + 3 * shape.moe_intermediate_size)
    moe_part += shape.num_shared_experts * 3 * shape.moe_intermediate_size
    return attention + moe_part


def _layer_kinds(shape: ModelShape) -> list[tuple[bool, int]]:
    """(is MoE, count) of the model's layers."""
    kinds = [(False, shape.num_dense_layers)]
    if shape.num_moe_layers:
        kinds.append((True, shape.num_moe_layers))
    return [(moe, count) for moe, count in kinds if count]


def block_params(shape: ModelShape, mesh: Mesh, *, moe: bool) -> tuple[float, float]:
    """(non-expert parameters, this rank's routed-expert parameters) of one layer: what one FSDP
    all-gather unshards (the experts gathered over the N / ep ranks sharing them)."""
    dense = shape.attention_params + 2 * shape.hidden_size
    if not moe:
        return dense + shape.dense_mlp_params, 0.0
    dense += shape.num_shared_experts * shape.expert_params + shape.router_params
    return dense, shape.num_experts / mesh.ep * shape.expert_params


def estimate_memory(shape: ModelShape, mesh: Mesh, workload: Workload, rates: GpuRates) -> MemoryEstimate:
    b_m, b_c = workload.master_bytes, workload.compute_bytes
    states = 4 * b_m * shape.total_params / mesh.world

    # Unsharded in B_c twice (current + prefetched), gradient in B_c and in float32.
    per_param = 2 * b_c + b_c + 4
    largest_block = max(sum(block_params(shape, mesh, moe=moe)) for moe, _ in _layer_kinds(shape))
    head = shape.vocab_size * shape.hidden_size
    fsdp = per_param * largest_block + (b_c + b_c + 4) * head

    tokens = workload.seq_len / mesh.cp
    layer_bytes = {
        moe: layer_activation_elements(shape, moe=moe)
        * b_c
        * tokens
        * (rates.activation_factor_moe if moe else rates.activation_factor_dense)
        for moe, _ in _layer_kinds(shape)
    }
    largest_layer = max(layer_bytes.values())
    if workload.activation_checkpointing:
        saved = shape.num_layers * shape.hidden_size * b_c * tokens
        working = 2 * largest_layer  # the recomputed block and its gradients
    else:
        saved = sum(layer_bytes[moe] * count for moe, count in _layer_kinds(shape))
        working = largest_layer
    activations = saved + working

    cp = 0.0
    if mesh.cp > 1:
        kv_bytes = workload.seq_len * shape.kv_elements_per_token * b_c
        remote = kv_bytes * (mesh.cp - 1) / mesh.cp
        saved_layers = 1 if workload.activation_checkpointing else shape.num_layers
        cp = remote * saved_layers + kv_bytes  # the gathered K/V kept per layer; one layer's gradient

    ep = 0.0
    if mesh.ep > 1:
        ep = 2 * tokens * shape.top_k * shape.hidden_size * b_c

    logits = 0.0
    if workload.loss == "logits":
        logits = 2 * tokens * shape.vocab_size * b_c + _LOSS_CHUNK_BYTES

    return MemoryEstimate(states=states, fsdp=fsdp, activations=activations, cp=cp, ep=ep, logits=logits)
