import dataclasses

import pytest

from primerl_trainer.planner.mesh import Mesh, Workload
from primerl_trainer.planner.rates import GpuRates, LinkRates
from primerl_trainer.planner.shapes import ModelShape
from primerl_trainer.planner.timing import estimate_step_time, model_flops_per_token

LINK = LinkRates(all_gather_gbps=100.0, reduce_scatter_gbps=100.0, all_to_all_gbps=50.0)
# One rate per kernel, so that the step time can be worked out by hand.
RATES = GpuRates(gpu="toy", memory_gib=80, reserved_gib=0, gpus_per_node=8, hbm_gbps=1000.0,
                 matmul=((1, 1, 1, 100.0),), grouped_mm=((1, 1, 1, 50.0),), attention=((1, 1, 40.0, 20.0),),
                 intra_node=LINK, inter_node=dataclasses.replace(LINK, all_to_all_gbps=5.0))  # fmt: skip
DENSE = ModelShape(name="dense", vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                   qk_head_dim=16, v_head_dim=16, intermediate_size=128, num_dense_layers=2)  # fmt: skip


def test_dense_step_on_one_gpu_by_hand():
    workload = Workload(seq_len=1024, tokens_per_step=4096, master_bytes=4)
    time = estimate_step_time(DENSE, Mesh(world=1), workload, RATES)
    linear = 2 * 1024 * (2 * (4 * 64 * 64 + 3 * 64 * 128) + 1000 * 64)  # forward FLOPs of the linears
    attention = 2 * 4 * 32 * 1024**2 / 2  # causal forward FLOPs per layer
    per_micro_batch = 3 * linear / 100e12 + 2 * (attention / 40e12 + 2.5 * attention / 20e12)
    assert time.compute == pytest.approx(4 * per_micro_batch)
    assert time.fsdp == time.ep == time.cp == 0.0
    assert time.optimizer == pytest.approx(8 * 4 * DENSE.total_params / 1000e9)


def test_checkpointing_adds_one_forward_of_the_blocks():
    workload = Workload(seq_len=1024, tokens_per_step=1024)
    plain = estimate_step_time(DENSE, Mesh(world=1), workload, RATES)
    checkpointed = estimate_step_time(
        DENSE, Mesh(world=1), dataclasses.replace(workload, activation_checkpointing=True), RATES
    )
    blocks_forward = 2 * (2 * 1024 * (4 * 64 * 64 + 3 * 64 * 128) / 100e12 + 2 * 4 * 32 * 1024**2 / 2 / 40e12)
    assert checkpointed.compute - plain.compute == pytest.approx(blocks_forward)


def test_expert_parallel_all_to_alls_by_hand_and_across_nodes():
    moe = dataclasses.replace(DENSE, num_dense_layers=0, num_experts=8, top_k=2, moe_intermediate_size=32)
    workload = Workload(seq_len=1024, tokens_per_step=2048)  # one micro-batch per rank
    time = estimate_step_time(moe, Mesh(world=2, ep=2), workload, RATES)
    send = 1024 * 2 * 64 * 2  # tokens x top_k x dim x bf16
    assert time.ep == pytest.approx(2 * 4 * send / 2 / 50e9)
    wide = estimate_step_time(
        moe, Mesh(world=16, ep=8), dataclasses.replace(workload, tokens_per_step=16 * 1024), RATES
    )
    inter = estimate_step_time(
        moe, Mesh(world=16, ep=16), dataclasses.replace(workload, tokens_per_step=16 * 1024), RATES
    )
    assert inter.ep > 5 * wide.ep  # 16 ranks leave the 8-GPU node


def test_model_flops_per_token():
    assert model_flops_per_token(DENSE, 1024) == 6 * DENSE.matmul_params_per_token + 3 * 2 * 4 * 32 * 1024 / 2
