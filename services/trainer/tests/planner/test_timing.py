import dataclasses

import pytest

from primerl_trainer.planner.mesh import Mesh, Workload
from primerl_trainer.planner.rates import GpuRates, LinkRates, StepFit
from primerl_trainer.planner.shapes import ModelShape
from primerl_trainer.planner.timing import (
    estimate_step_time,
    local_gradient_bytes_per_param,
    logprob_bytes_per_logit,
    model_flops_per_token,
    optimizer_bytes_per_param,
    ranks_per_token,
    ranks_sent_per_token,
    routing_bytes,
    uses_dense_grid,
)

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
    # 130 bytes per logit (bf16 logits), 1024 x 1000 logits per micro-batch, at 1000 GB/s.
    assert time.logprobs == pytest.approx(4 * 1024 * 1000 * 130 / 1000e9)
    # One rank: no FSDP traffic. Each micro-batch gathers every unit again: copy-in cast from
    # float32 (4 + 2), the one-rank all-gather and the copy-out (2 + 2 each). The float32 gradient
    # accumulation: cast (2 + 4), three adds (2 + 4 + 4 each), the reduce input and the one-rank
    # reduce-scatter (8 each), the float32 cast (4 + 4).
    gathers = 4 * (6 + 4 + 4)
    assert time.copies == pytest.approx(DENSE.total_params * (gathers + 6 + 3 * 10 + 8 + 8 + 8) / 1000e9)
    assert time.fsdp == time.ep == time.cp == 0.0
    # Clipping and foreach AdamW: 23 float32 passes (see below).
    assert time.optimizer == pytest.approx(23 * 4 * DENSE.total_params / 1000e9)


def test_logprob_and_local_gradient_bytes_by_hand():
    # Forward: upcast 2+4, /T 8, logsumexp 4+8+8+4, -lse 8, exp 8, lse-x 8, p*(lse-x) 12, sum 4.
    # Backward: upcast 2+4, /T 8, -lse 8, exp 8, *-g 8, /T 8, written back 4+2.
    assert logprob_bytes_per_logit(2) == (6 + 8 + 24 + 8 + 8 + 8 + 12 + 4) + (6 + 8 + 8 + 8 + 8 + 8 + 6) == 130
    # Clipping: norm 1, scale 2; AdamW: p*= 2, lerp 3, v*= 2, addcmul 3, sqrt 2, /= 2, += 2, addcdiv 4.
    assert optimizer_bytes_per_param(2) == (1 + 2 + 2 + 3 + 2 + 3 + 2 + 2 + 2 + 4) * 2 == 46
    assert local_gradient_bytes_per_param(1, 2, 4) == (2 + 4) + 8 + (4 + 4)
    assert local_gradient_bytes_per_param(8, 2, 2) == (2 + 4) + 7 * (2 + 8) + 8 + 8 + (4 + 2) == 98


def test_routing_bytes_by_hand():
    moe = dataclasses.replace(DENSE, num_dense_layers=0, num_experts=8, top_k=2, moe_intermediate_size=32)
    copies = 1024 * 2 * 64  # elements of the routed copies
    # One rank (compiled): forward gather written and read again (3 x 2 bytes), backward 4 x 2.
    assert routing_bytes(moe, Mesh(world=1), 1024, 2, forward_passes=1) == copies * (6 + 8)
    # Expert parallel over 2 ranks of 4 experts each: a token's 2 experts both on the other rank
    # with probability 4/8 * 3/7, so it goes to 2 * (1 - 3/14) ranks on average.
    assert ranks_per_token(moe, 2) == pytest.approx(2 * (1 - 3 / 14))
    sent = 1024 * 2 * (1 - 3 / 14) * 64
    expected = copies * (2 * 6 + 36 + 6 * 2) + sent * 3 * 8  # checkpointed: two forwards
    assert routing_bytes(moe, Mesh(world=2, ep=2), 1024, 2, forward_passes=2) == pytest.approx(expected)


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
    send = 1024 * 2 * (1 - 3 / 14) * 64 * 2  # tokens x ranks each goes to x dim x bf16
    assert time.ep == pytest.approx(2 * 4 * send / 2 / 50e9)
    # The experts (ep = N) are local units; the rest is sharded over 2: per micro-batch two
    # copy-outs of the gathered bf16 (2 + 2 bytes each) and the float32 reduce input (2 + 4).
    routed = 2 * 8 * 3 * 64 * 32
    # The experts' forward gather (float32 master weights: 4 + 2, then 4, 4), their gradient.
    local = routed / 2 * ((6 + 4 + 4) + local_gradient_bytes_per_param(1, 2, 4))
    sharded = (moe.total_params - routed) * (8 + 6)
    routing = 2 * routing_bytes(moe, Mesh(world=2, ep=2), 1024, 2, forward_passes=1)
    assert time.copies == pytest.approx((local + sharded + routing) / 1000e9)
    moe16 = dataclasses.replace(moe, num_experts=16)  # ep 16 needs 16 experts
    wide = estimate_step_time(
        moe16, Mesh(world=16, ep=8), dataclasses.replace(workload, tokens_per_step=16 * 1024), RATES
    )
    inter = estimate_step_time(
        moe16, Mesh(world=16, ep=16), dataclasses.replace(workload, tokens_per_step=16 * 1024), RATES
    )
    assert inter.ep > 5 * wide.ep  # 16 ranks leave the 8-GPU node


def test_fitted_terms_all_to_all_calls_layers_and_exposed_fsdp():
    moe = dataclasses.replace(DENSE, num_dense_layers=0, num_experts=8, top_k=2, moe_intermediate_size=32)
    workload = Workload(seq_len=1024, tokens_per_step=4 * 1024)  # two micro-batches per rank
    mesh = Mesh(world=2, ep=2)
    plain = estimate_step_time(moe, mesh, workload, RATES)
    fitted_rates = dataclasses.replace(
        RATES,
        intra_node=dataclasses.replace(LINK, all_to_all_call_s=1e-3),
        fit=StepFit(ep_layer_s=2e-3, fsdp_exposed_fraction=0.5),
    )
    fitted = estimate_step_time(moe, mesh, workload, fitted_rates)
    # Per MoE layer and micro-batch: 3 calls forward, 2 backward, and one layer term per forward.
    assert fitted.ep - plain.ep == pytest.approx(2 * 2 * (5 * 1e-3 + 2e-3))
    checkpointed = dataclasses.replace(workload, activation_checkpointing=True)
    twice = (
        estimate_step_time(moe, mesh, checkpointed, fitted_rates).ep
        - estimate_step_time(moe, mesh, checkpointed, RATES).ep
    )
    assert twice == pytest.approx(2 * 2 * (8 * 1e-3 + 2 * 2e-3))
    # The layer term once per doubling of the ranks: twice at ep=4 (two micro-batches per rank again).
    mesh4, workload4 = Mesh(world=4, ep=4), dataclasses.replace(workload, tokens_per_step=8 * 1024)
    assert not uses_dense_grid(moe, 4)  # 3 calls a forward
    four = (
        estimate_step_time(moe, mesh4, workload4, fitted_rates).ep - estimate_step_time(moe, mesh4, workload4, RATES).ep
    )
    assert four == pytest.approx(2 * 2 * (5 * 1e-3 + 2 * 2e-3))
    # The non-expert part sharded over 2 ranks (the experts are local): per micro-batch two bf16
    # all-gathers and a float32 reduce-scatter, of which half shows; with accumulate_unsharded one
    # of each per step.
    sharded = moe.total_params - 2 * 8 * 3 * 64 * 32
    blocks_and_head = sharded - 64  # the final norm (the root's) is not counted
    gather, scatter = blocks_and_head * 2 / 2 / 100e9, blocks_and_head * 4 / 2 / 100e9
    assert fitted.fsdp == pytest.approx(2 * 0.5 * (2 * gather + scatter))
    held = estimate_step_time(moe, mesh, dataclasses.replace(workload, accumulate_unsharded=True), fitted_rates)
    assert held.fsdp == pytest.approx(0.5 * (gather + scatter))
    # Its copies: the sharded units' gathered copy-out once per step and their gradients handled as
    # the local units' are, instead of two copy-outs and a float32 reduce input per micro-batch.
    per_step = sharded * (2 * 2 + local_gradient_bytes_per_param(2, 2, 4)) / 1000e9
    assert held.copies - fitted.copies == pytest.approx(per_step - 2 * sharded * (8 + 6) / 1000e9)


# Per MoE layer, per micro-batch, the planner's expert-parallel time is
#   all-to-alls x send_bytes x (ep - 1) / ep / all_to_all_gbps + calls x all_to_all_call_s,
# all-to-alls = 2 (dispatch, combine) x (forwards + the backward); calls = forwards x (3, or 2 on
# the dense grid) + 2 for the backward.
CALL_RATES = dataclasses.replace(RATES, intra_node=dataclasses.replace(LINK, all_to_all_call_s=1e-3))
MOE_256_TOP_8 = dataclasses.replace(
    DENSE, num_dense_layers=0, num_experts=256, top_k=8, moe_intermediate_size=32
)  # 2 MoE layers


def test_dense_grid_every_token_to_every_rank_and_two_calls_a_forward():
    shape, mesh = MOE_256_TOP_8, Mesh(world=2, ep=2)
    # 128 experts a rank: a token's 8 experts all on the other rank with probability
    # 128/256 x 127/255 x ... x 121/249 (~0.0037), so it needs 2 x 99.6% of the 2 ranks: at least
    # 90%, the dense grid, which sends it to both.
    miss = 1.0
    for i in range(8):
        miss *= (128 - i) / (256 - i)
    assert ranks_per_token(shape, 2) == pytest.approx(2 * (1 - miss))
    assert 1 - miss > 0.99
    assert uses_dense_grid(shape, 2)
    assert ranks_sent_per_token(shape, 2) == 2.0

    workload = Workload(seq_len=1024, tokens_per_step=2048)  # one micro-batch per rank
    send = 1024 * 2 * 64 * 2  # 1024 tokens x 2 ranks (every rank) x dim 64 x bf16 = 262144 bytes
    plain = estimate_step_time(shape, mesh, workload, RATES)
    # 2 layers x 4 all-to-alls (dispatch and combine, forward and backward), half of each leaving.
    assert plain.ep == pytest.approx(2 * 4 * send * (2 - 1) / 2 / 50e9)
    # The calls: 2 layers x (2 forward + 2 backward) x 1 ms (not 3 + 2).
    called = estimate_step_time(shape, mesh, workload, CALL_RATES)
    assert called.ep - plain.ep == pytest.approx(2 * (2 + 2) * 1e-3)
    # Checkpointed: 2 forwards, so 6 all-to-alls and 2 x 2 + 2 = 6 calls a layer.
    checkpointed = dataclasses.replace(workload, activation_checkpointing=True)
    plain_ckpt = estimate_step_time(shape, mesh, checkpointed, RATES)
    assert plain_ckpt.ep == pytest.approx(2 * 6 * send / 2 / 50e9)
    called_ckpt = estimate_step_time(shape, mesh, checkpointed, CALL_RATES)
    assert called_ckpt.ep - plain_ckpt.ep == pytest.approx(2 * (2 * 2 + 2) * 1e-3)
    # model.fp8: FP8 experts take no padded copies, so the grid's forward calls 3 times, not 2.
    fp8 = dataclasses.replace(workload, fp8=True)
    assert estimate_step_time(shape, mesh, fp8, CALL_RATES).ep - plain.ep == pytest.approx(2 * (3 + 2) * 1e-3)
    # The row moves count the grid's rows too: 1024 x 8 copies and 1024 x 2 sent rows of 64.
    copies, sent = 1024 * 8 * 64, 1024 * 2 * 64
    # One forward: each sent element moved 4 times a pass (forward and backward) in bf16.
    expected = copies * (6 + 36 + 12) + sent * (1 + 1) * 4 * 2
    assert routing_bytes(shape, mesh, 1024, 2, forward_passes=1) == pytest.approx(expected)


def test_sparse_routing_keeps_the_deduplicated_rows_and_three_calls_a_forward():
    shape = dataclasses.replace(DENSE, num_dense_layers=0, num_experts=8, top_k=2, moe_intermediate_size=32)
    mesh = Mesh(world=8, ep=8)  # one node of 8: the intra-node link
    # One expert a rank: a token's 2 experts miss a given rank with probability 7/8 x 6/7 = 3/4,
    # so it needs 8 x 1/4 = 2 of the 8 ranks (25%, under 90%): no dense grid, 2 ranks, not 8.
    assert ranks_per_token(shape, 8) == pytest.approx(2.0)
    assert not uses_dense_grid(shape, 8)
    assert ranks_sent_per_token(shape, 8) == pytest.approx(2.0)

    workload = Workload(seq_len=1024, tokens_per_step=8 * 1024)  # one micro-batch per rank
    send = 1024 * 2 * 64 * 2  # 1024 tokens x 2 ranks x dim 64 x bf16
    plain = estimate_step_time(shape, mesh, workload, RATES)
    assert plain.ep == pytest.approx(2 * 4 * send * (8 - 1) / 8 / 50e9)
    # The calls: 2 layers x (3 forward + 2 backward) x 1 ms; checkpointed 3 x 2 + 2 = 8 a layer.
    called = estimate_step_time(shape, mesh, workload, CALL_RATES)
    assert called.ep - plain.ep == pytest.approx(2 * (3 + 2) * 1e-3)
    checkpointed = dataclasses.replace(workload, activation_checkpointing=True)
    twice = (
        estimate_step_time(shape, mesh, checkpointed, CALL_RATES).ep
        - estimate_step_time(shape, mesh, checkpointed, RATES).ep
    )
    assert twice == pytest.approx(2 * (3 * 2 + 2) * 1e-3)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "ep", "dense"),
    [
        (8, 3, 2, True),  # misses a rank with 4/8 x 3/7 x 2/6 = 1/14: needs 92.9% of them
        (8, 2, 2, False),  # 4/8 x 3/7 = 3/14: 78.6%
        (256, 3, 2, False),  # 128/256 x 127/255 x 126/254: 87.6%
        (256, 8, 4, True),  # 192/256 x ... x 185/249: 90.4%
        (64, 6, 4, False),  # 48/64 x ... x 43/59: 84.6%
        (1, 1, 1, False),  # one rank: nothing sent
    ],
)
def test_dense_grid_threshold_by_hand(num_experts, top_k, ep, dense):
    shape = dataclasses.replace(DENSE, num_dense_layers=0, num_experts=num_experts, top_k=top_k)
    assert uses_dense_grid(shape, ep) is dense
    assert ranks_sent_per_token(shape, ep) == pytest.approx(ep if dense else ranks_per_token(shape, ep))


def test_dense_grid_choice_agrees_with_the_dispatcher(monkeypatch):
    """The planner repeats the dispatcher's default rule (AllToAllDispatcher.uses_dense_grid with
    DispatchOptions.dense_grid None) rather than importing it (the planner does not import torch):
    they must agree on every shape, 16 experts top-3 over 2 ranks (exactly 90%) included."""
    from primerl_trainer.distributed import expert_parallel

    monkeypatch.setattr(expert_parallel.dist, "get_rank", lambda group: 0)
    seen = set()
    for num_experts in (8, 16, 64, 128, 160, 256):
        for ep in (2, 4, 8, 16, 32, 64):
            if num_experts % ep:
                continue
            monkeypatch.setattr(expert_parallel.dist, "get_world_size", lambda group, ep=ep: ep)
            dispatcher = expert_parallel.AllToAllDispatcher(None, num_experts=num_experts)
            for top_k in (1, 2, 3, 4, 6, 8):
                shape = dataclasses.replace(DENSE, num_dense_layers=0, num_experts=num_experts, top_k=top_k)
                planned = uses_dense_grid(shape, ep)
                assert planned == dispatcher.uses_dense_grid(top_k), (num_experts, top_k, ep)
                seen.add(planned)
    assert seen == {True, False}


def test_model_flops_per_token():
    assert model_flops_per_token(DENSE, 1024) == 6 * DENSE.matmul_params_per_token + 3 * 2 * 4 * 32 * 1024 / 2
