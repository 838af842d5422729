import dataclasses

import pytest

from primerl_trainer.planner.memory import estimate_memory, layer_activation_elements
from primerl_trainer.planner.mesh import Mesh, Workload, candidate_meshes
from primerl_trainer.planner.rates import load_rates
from primerl_trainer.planner.shapes import ModelShape, builtin_shape

RATES = load_rates("h200")
# 2 dense layers, then 2 MoE layers of 8 experts (top-2), no shared expert.
SHAPE = ModelShape(name="toy", vocab_size=1000, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                   qk_head_dim=16, v_head_dim=16, intermediate_size=256, num_dense_layers=2, num_experts=8,
                   top_k=2, moe_intermediate_size=32)  # fmt: skip


def test_layer_activations_by_hand():
    attention = 2 * 64 + 2 * 4 * 16 + 2 * 2 * 16 + 2 * 16 + 4 * 16
    assert layer_activation_elements(SHAPE, moe=False) == attention + 2 * 64 + 3 * 256
    assert layer_activation_elements(SHAPE, moe=True) == attention + 2 * 64 + 2 * 8 + 2 * (2 * 64 + 3 * 32)


def test_states_shard_over_every_rank_and_checkpointing_keeps_block_inputs():
    workload = Workload(seq_len=512, tokens_per_step=4096, master_bytes=4, activation_checkpointing=True)
    one = estimate_memory(SHAPE, Mesh(world=1), workload, RATES)
    four = estimate_memory(SHAPE, Mesh(world=4, ep=2, cp=2), workload, RATES)
    assert one.states == 16 * SHAPE.total_params
    assert four.states == one.states / 4
    # Block inputs of 256 local tokens, plus the largest (a dense) layer recomputed and its gradients.
    dense_layer = layer_activation_elements(SHAPE, moe=False) * 2 * 256
    assert dense_layer > layer_activation_elements(SHAPE, moe=True) * 2 * 256
    assert four.activations == 4 * 64 * 2 * 256 + 2 * dense_layer
    # The gathered K/V of the other half of the sequence (one layer), and one layer's gradient.
    kv = 512 * 2 * (16 + 16) * 2
    assert four.cp == kv / 2 + kv
    assert four.ep == 2 * 256 * 2 * 64 * 2
    assert four.logits == 2 * 256 * 1000 * 2 + 3 * 2**25 * 4


def test_without_checkpointing_every_layer_is_saved():
    workload = Workload(seq_len=512, tokens_per_step=4096)
    memory = estimate_memory(SHAPE, Mesh(world=1), workload, RATES)
    dense, moe = (layer_activation_elements(SHAPE, moe=m) * 2 * 512 for m in (False, True))
    assert memory.activations == 2 * dense + 2 * moe + dense


def test_context_parallel_halves_activations_and_expert_parallel_shrinks_the_gathered_block():
    shape = builtin_shape("Qwen3-30B-A3B")
    workload = Workload(seq_len=32768, tokens_per_step=32768 * 8)
    base = estimate_memory(shape, Mesh(world=8), workload, RATES)
    cp2 = estimate_memory(shape, Mesh(world=8, cp=2), workload, RATES)
    ep8 = estimate_memory(shape, Mesh(world=8, ep=8), workload, RATES)
    assert cp2.activations == pytest.approx(base.activations / 2)
    assert ep8.fsdp < base.fsdp / 2
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
