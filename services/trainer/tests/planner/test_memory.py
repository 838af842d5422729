import dataclasses

import pytest

from primerl_trainer.planner.memory import estimate_memory, layer_activation_elements
from primerl_trainer.planner.mesh import Mesh, Workload, candidate_meshes
from primerl_trainer.planner.rates import load_rates
from primerl_trainer.planner.shapes import ModelShape, builtin_shape

# The shipped H200 rates, but with the planner's own activation count (factors 1): the cases below
# work the bytes out by hand (the file's measured factors scale the per-layer activations).
RATES = dataclasses.replace(load_rates("h200"), activation_factor_dense=1.0, activation_factor_moe=1.0)
# 2 dense layers, then 2 MoE layers of 8 experts (top-2), no shared expert.
SHAPE = ModelShape(name="toy", vocab_size=1000, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                   qk_head_dim=16, v_head_dim=16, intermediate_size=256, num_dense_layers=2, num_experts=8,
                   top_k=2, moe_intermediate_size=32)  # fmt: skip


def test_layer_activations_by_hand():
    attention = 2 * 64 + 2 * 4 * 16 + 2 * 2 * 16 + 2 * 16 + 4 * 16
    assert layer_activation_elements(SHAPE, moe=False) == attention + 2 * 64 + 3 * 256
    assert layer_activation_elements(SHAPE, moe=True) == attention + 2 * 64 + 2 * 8 + 2 * (2 * 64 + 3 * 32)


# The toy's FSDP units: one layer's parameters (attention 4*64*16 + 2*2*64*16 + 4*16*64, two norms).
ATTENTION = 4 * 64 * 16 + 2 * 2 * 64 * 16 + 4 * 16 * 64 + 2 * 64
DENSE_BLOCK = ATTENTION + 3 * 64 * 256
EXPERT = 3 * 64 * 32
MOE_NON_EXPERT = ATTENTION + 64 * 8  # and the router
ROUTED = 2 * 8 * EXPERT  # both MoE layers' experts
CHUNKS = 3 * 2**25 * 4  # token_logprobs' float32 chunks


def test_toy_parameters_by_hand():
    assert SHAPE.total_params == 2 * DENSE_BLOCK + 2 * (MOE_NON_EXPERT + 8 * EXPERT) + 64 + 2 * 1000 * 64


def test_one_gpu_peak_is_the_losss_backward_with_logits_and_their_gradient():
    workload = Workload(seq_len=512, tokens_per_step=512, master_bytes=4, activation_checkpointing=True)
    memory = estimate_memory(SHAPE, Mesh(world=1), workload, RATES)
    params = SHAPE.total_params
    assert memory.moment == "loss"
    # Parameters and moments in float32, no gradient yet (set to None after every step); the
    # one-rank units keep a bf16 copy of every parameter gathered.
    assert memory.states == 12 * params
    assert memory.fsdp == 2 * params
    # Block inputs, and the final norm's input and output; the recomputed block comes later.
    assert memory.activations == 4 * 64 * 2 * 512 + 2 * 512 * 64 * 2
    assert memory.logits == 2 * 512 * 1000 * 2 + CHUNKS
    assert memory.cp == memory.ep == 0.0
    assert memory.total == 14 * params + memory.activations + memory.logits


def test_one_gpu_blocks_moment_holds_float32_accumulators():
    # No logits (fused loss): the peak is the largest layer's backward. Four micro-batches: the
    # one-rank units accumulate float32 gradients instead of bf16 shards until the last one.
    workload = Workload(seq_len=512, tokens_per_step=4 * 512, master_bytes=2, loss="fused")
    memory = estimate_memory(SHAPE, Mesh(world=1), workload, RATES)
    params = SHAPE.total_params
    assert memory.moment == "blocks"
    assert memory.states == 6 * params
    largest = MOE_NON_EXPERT + 8 * EXPERT  # 62,080 against the dense block's 61,568
    assert largest > DENSE_BLOCK
    # Gathered bf16, float32 accumulators; the block's bf16 gradient and float32 reduce input.
    assert memory.fsdp == 2 * params + 4 * params + (2 + 4) * largest
    dense, moe = (layer_activation_elements(SHAPE, moe=m) * 2 * 512 for m in (False, True))
    assert memory.activations == 2 * dense + 2 * moe + dense  # every layer saved, one's gradients
    assert memory.logits == 0.0


def test_optimizer_temporary_can_set_the_peak():
    # Two tokens, float32 master weights, one micro-batch: the blocks' backward holds parameters,
    # moments and float32 gradients (16 bytes), the bf16 copies (2) and one block's gradient and
    # reduce input; AdamW's sqrt of the second moment makes 20 bytes per parameter.
    workload = Workload(seq_len=2, tokens_per_step=2, master_bytes=4, loss="fused")
    memory = estimate_memory(SHAPE, Mesh(world=1), workload, RATES)
    assert memory.moment == "optimizer"
    assert memory.states == memory.total == 20 * SHAPE.total_params


def test_expert_parallel_over_every_rank_keeps_the_experts_gathered():
    # ep = N = 2: the experts' FSDP mesh is one rank (local units), the rest is sharded over 2.
    workload = Workload(seq_len=512, tokens_per_step=4 * 512, master_bytes=2, loss="fused")  # 2 per rank
    memory = estimate_memory(SHAPE, Mesh(world=2, ep=2), workload, RATES)
    local = ROUTED / 2
    shard = (SHAPE.total_params - ROUTED) / 2
    assert memory.moment == "blocks"
    # Parameters and moments; the sharded units' bf16 gradient shards.
    assert memory.states == 3 * 2 * (local + shard) + 2 * shard
    # Local: gathered + float32 accumulators, this layer's gradient and reduce input; sharded: the
    # block gathered and prefetched, its bf16 gradient and float32 reduce-scatter input.
    assert memory.fsdp == (2 + 4) * local + (2 + 4) * 4 * EXPERT + (3 * 2 + 4) * DENSE_BLOCK
    assert memory.ep == 2 * 512 * 2 * 64 * 2
    with_logits = estimate_memory(SHAPE, Mesh(world=2, ep=2), dataclasses.replace(workload, loss="logits"), RATES)
    assert with_logits.moment == "loss"
    # The output head stays gathered from its forward to its backward.
    assert with_logits.fsdp == (2 + 4) * local + 1000 * 64 * 2
    assert with_logits.states == 3 * 2 * (local + shard) + 2 * shard
    # accumulate_unsharded: the sharded units held as the local ones (gathered, float32
    # accumulators), their block's gradient as a local unit's; no gradient shards until the end.
    held = estimate_memory(SHAPE, Mesh(world=2, ep=2), dataclasses.replace(workload, accumulate_unsharded=True), RATES)
    sharded = SHAPE.total_params - ROUTED
    assert held.moment == "blocks"
    assert held.fsdp == (2 + 4) * (local + sharded) + (2 + 4) * (4 * EXPERT + DENSE_BLOCK)
    assert held.states == memory.states


def test_context_parallel_keeps_the_gathered_kv_of_one_layer_under_checkpointing():
    workload = Workload(seq_len=512, tokens_per_step=512, activation_checkpointing=True, loss="fused")
    four = estimate_memory(SHAPE, Mesh(world=4, ep=2, cp=2), workload, RATES)
    # Block inputs of 256 local tokens, plus the largest (a dense) layer recomputed and its gradients.
    dense_layer = layer_activation_elements(SHAPE, moe=False) * 2 * 256
    assert dense_layer > layer_activation_elements(SHAPE, moe=True) * 2 * 256
    assert four.activations == 4 * 64 * 2 * 256 + 2 * dense_layer
    # The gathered K/V of the other half of the sequence (one layer), and one layer's gradient.
    kv = 512 * 2 * (16 + 16) * 2
    assert four.cp == kv / 2 + kv


def test_context_parallel_halves_activations_and_expert_parallel_shrinks_the_gathered_block():
    shape = builtin_shape("Qwen3-30B-A3B")
    workload = Workload(seq_len=32768, tokens_per_step=32768 * 8, loss="fused")
    base = estimate_memory(shape, Mesh(world=8), workload, RATES)
    cp2 = estimate_memory(shape, Mesh(world=8, cp=2), workload, RATES)
    ep4 = estimate_memory(shape, Mesh(world=8, ep=4), workload, RATES)
    ep8 = estimate_memory(shape, Mesh(world=8, ep=8), workload, RATES)
    assert cp2.activations == pytest.approx(base.activations / 2)
    assert ep4.fsdp < base.fsdp / 2
    # At ep = N the experts' mesh is one rank: they stay gathered, with float32 accumulators.
    assert ep8.fsdp > base.fsdp
    checkpointed = estimate_memory(
        shape, Mesh(world=8), dataclasses.replace(workload, activation_checkpointing=True), RATES
    )
    assert checkpointed.activations < base.activations / 5


def test_candidate_meshes_follow_the_trainer_rules():
    meshes = {(m.cp, m.ep) for m in candidate_meshes(builtin_shape("Qwen3-30B-A3B"), 8, 4096)}
    assert (2, 4) in meshes and (1, 8) in meshes and (2, 1) in meshes
    assert (4, 2) not in meshes  # ep not a multiple of cp
    dense = ModelShape(name="d", vocab_size=10, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                       qk_head_dim=8, v_head_dim=8, intermediate_size=8, num_dense_layers=1)  # fmt: skip
    assert {m.ep for m in candidate_meshes(dense, 8, 4096)} == {1}
    assert Mesh(world=8, cp=8).problem(dense, 4100) is not None
