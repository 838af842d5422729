"""Peak memory per GPU of one training step, by part.

A step's peak is the largest of three moments (the logits and their gradient are freed before
the blocks' backward starts, activations before the optimizer runs, so none of them add up):
- "loss": the last micro-batch's loss backward, when the logits and their gradient are both alive;
- "blocks": its backward through the largest layer (recomputed under activation checkpointing);
- "optimizer": the step of torch's foreach AdamW (the trainer's TritonAdamW defers to it for
  FSDP's DTensor parameters), whose sqrt of the second moment is one temporary the size of the
  parameters; FSDP has resharded every unit after backward.

Parameters fall in two kinds of FSDP units (B_m = master bytes, B_c = compute bytes, N ranks):
- local units, whose mesh has one rank (every unit on one GPU; the routed experts when ep = N):
  they keep their parameters gathered in B_c, and with several micro-batches accumulate their
  unsharded gradients in float32 until the last one reduces them (distributed/fsdp.py);
- sharded units (the rest): a block gathered in B_c while it runs and the next one prefetched,
  in backward its unsharded gradient in B_c and its float32 reduce-scatter input; the output
  head kept gathered from its forward to its backward; gradients reduced every micro-batch into
  the B_m shard. With accumulate_unsharded and several micro-batches they are held as the local
  units are: gathered in B_c and accumulating float32 gradients through the step.

What each part counts (bytes, per GPU):
- states: parameters and both AdamW moments in B_m, sharded (experts over ep, then over N / ep),
  and the B_m gradient shards that exist at that moment (none before the first reduction: the
  trainer sets gradients to None after each step); at "optimizer", AdamW's temporary.
- fsdp: the gathered and accumulating copies above.
- activations: what autograd keeps for backward, per token and layer (`layer_activation_elements`),
  over the seq_len / cp tokens of one micro-batch on this GPU; with activation checkpointing only
  each block's input. At "loss" also the final norm's input and output; at "blocks" the working
  set: one layer's activations again (their gradients), and with checkpointing the recomputed one.
- cp: the K and V (MLA: the latent) of the whole sequence, gathered by each layer's attention,
  beyond the local part, and one layer's gradient of them (at "blocks").
- ep: the all-to-all send and receive buffers of one MoE layer's dispatch (at "blocks").
- logits: at "loss", the [tokens, vocab] logits in B_c, their gradient (token_logprobs' backward
  writes it whole) and that backward's float32 chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from primerl_trainer.planner.mesh import Mesh, Workload
from primerl_trainer.planner.rates import GpuRates
from primerl_trainer.planner.shapes import ModelShape

__all__ = ["MemoryEstimate", "ParamSplit", "estimate_memory", "layer_activation_elements", "param_split"]

# token_logprobs' float32 chunks (losses._CHUNK_ELEMENTS = 2**25 elements): three at a time.
_LOSS_CHUNK_BYTES = 3 * 2**25 * 4


@dataclass(frozen=True)
class MemoryEstimate:
    states: float
    fsdp: float
    activations: float
    cp: float
    ep: float
    logits: float
    moment: Literal["loss", "blocks", "optimizer"] = "blocks"

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "moment")


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


@dataclass(frozen=True)
class ParamSplit:
    """This rank's parameters by kind of FSDP unit: `local` (units on a one-rank mesh, whole),
    `sharded` (the rest, as gathered: non-expert parameters whole, experts this rank's ep part)
    and `sharded_shard` (this rank's shard of them)."""

    local: float
    sharded: float
    sharded_shard: float


def experts_local(mesh: Mesh) -> bool:
    """Whether the routed experts' FSDP mesh (the N / ep ranks sharing them) is one rank."""
    return mesh.world == mesh.ep


def param_split(shape: ModelShape, mesh: Mesh) -> ParamSplit:
    if mesh.world == 1:
        return ParamSplit(local=shape.total_params, sharded=0.0, sharded_shard=0.0)
    routed = shape.routed_expert_params
    non_expert = shape.total_params - routed
    if experts_local(mesh):
        return ParamSplit(local=routed / mesh.ep, sharded=non_expert, sharded_shard=non_expert / mesh.world)
    return ParamSplit(local=0.0, sharded=non_expert + routed / mesh.ep, sharded_shard=shape.total_params / mesh.world)


def unit_params(shape: ModelShape, mesh: Mesh, *, moe: bool) -> tuple[float, float]:
    """(local, sharded-as-gathered) parameters of one layer's FSDP units on this rank."""
    dense, experts = block_params(shape, mesh, moe=moe)
    if mesh.world == 1:
        return dense + experts, 0.0
    if experts_local(mesh):
        return experts, dense
    return 0.0, dense + experts


def estimate_memory(shape: ModelShape, mesh: Mesh, workload: Workload, rates: GpuRates) -> MemoryEstimate:
    b_m, b_c = workload.master_bytes, workload.compute_bytes
    accumulating = workload.micro_batches_per_rank(mesh) > 1
    split = param_split(shape, mesh)
    # accumulate_unsharded: the sharded units held as the local ones are (their shards stay states).
    held_unsharded = split.sharded if workload.accumulate_unsharded and accumulating else 0.0
    # Parameters and moments; gradient shards of the sharded units from earlier micro-batches.
    states = 3 * b_m * (split.local + split.sharded_shard)
    held_grads = b_m * split.sharded_shard if accumulating and not held_unsharded else 0.0
    # Local units: gathered copies, and the float32 accumulators that stand in for their shards.
    local = b_c * split.local + (4 * split.local if accumulating else 0.0) + (b_c + 4) * held_unsharded

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

    kv_bytes = workload.seq_len * shape.kv_elements_per_token * b_c
    remote_kv = kv_bytes * (mesh.cp - 1) / mesh.cp
    saved_kv = 0.0 if workload.activation_checkpointing else remote_kv * shape.num_layers

    logits = 0.0
    if workload.loss == "logits":
        logits = 2 * tokens * shape.vocab_size * b_c + _LOSS_CHUNK_BYTES
    head_gathered = shape.vocab_size * shape.hidden_size * b_c if mesh.world > 1 else 0.0
    loss = MemoryEstimate(
        states=states + held_grads,
        fsdp=local + head_gathered,
        activations=saved + 2 * tokens * shape.hidden_size * b_c,
        cp=saved_kv,
        ep=0.0,
        logits=logits,
        moment="loss",
    )

    # By the largest layer's backward its gradients are reduced, or (one micro-batch, local units)
    # their shards written; the current block's unsharded gradient and float32 reduce input.
    final_local_grads = 0.0 if accumulating else b_m * split.local
    largest_local, largest_sharded = (
        max(unit_params(shape, mesh, moe=moe)[i] for moe, _ in _layer_kinds(shape)) for i in (0, 1)
    )
    if held_unsharded:
        largest_local, largest_sharded = largest_local + largest_sharded, 0.0
    transient = (3 * b_c + 4) * largest_sharded + (b_c + 4) * largest_local
    cp = 0.0
    if mesh.cp > 1:
        cp = (remote_kv if workload.activation_checkpointing else saved_kv) + kv_bytes
    ep = 2 * tokens * shape.top_k * shape.hidden_size * b_c if mesh.ep > 1 else 0.0
    blocks = MemoryEstimate(
        states=states + b_m * split.sharded_shard + final_local_grads,
        fsdp=local + transient,
        activations=saved + working,
        cp=cp,
        ep=ep,
        logits=0.0,
        moment="blocks",
    )
    shard = split.local + split.sharded_shard
    optimizer = MemoryEstimate(
        states=4 * b_m * shard + b_m * shard, fsdp=0.0, activations=0.0, cp=0.0, ep=0.0, logits=0.0, moment="optimizer"
    )
    return max(loss, blocks, optimizer, key=lambda estimate: estimate.total)
