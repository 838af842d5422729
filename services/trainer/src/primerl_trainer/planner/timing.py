"""Step time of one optimizer step, from the measured per-kernel rates.

Per micro-batch on one GPU (t = seq_len / cp tokens):
- linear layers: 2 * t * parameters FLOPs forward, twice that backward, at the matmul rate of the
  nearest measured shape; routed experts at the grouped-matmul rate (t * top_k rows over the
  local experts); with activation checkpointing the blocks' forward runs twice.
- attention core: 2 * heads * (qk + v dims) * seq^2 / 2 causal FLOPs per sequence, a cp-th of it
  per GPU, at the measured forward and backward rates (backward counted as 2.5x the forward).
- logprobs: the trainer's unfused logprob/entropy path (losses.token_logprobs) reads and writes
  every [tokens, vocab] logit many times over in float32 (`logprob_bytes_per_logit`), at the HBM
  rate.
- copies (memory-bound work on the compute stream, at the HBM rate): the MoE layers' row
  gathers and weighted sums between token and expert order (`routing_bytes`); FSDP's copies each
  micro-batch (sharded units: gathered copy-out, float32 reduce-scatter input; local units: their
  forward gather, on one rank three copies); the local units' float32 gradient accumulation and
  their one reduction per step (`local_gradient_bytes_per_param`).
- FSDP: each sharded block all-gathered in forward and again in backward, its gradient
  reduce-scattered in float32, every micro-batch (with accumulate_unsharded: one all-gather and one
  reduce-scatter per step); overlapped with compute, so what exceeds it counts, and at least the
  fitted exposed fraction (`StepFit.fsdp_exposed_fraction`). Local units (one-rank meshes) move
  nothing between GPUs.
- expert parallel, per MoE layer and micro-batch, on the critical path: the dispatch and combine
  all-to-alls' bytes, forward and backward (and the recomputed forward), each token going once to
  each rank holding one of its experts (balanced random routing), not once per expert, or, where
  the dispatcher takes its dense grid (`uses_dense_grid`: a token expected to need at least 90%
  of the ranks), once to every rank; a fixed cost per all-to-all call
  (`LinkRates.all_to_all_call_s`: per forward 3 calls, the counts, the rows with their routing and
  the partial sums, or 2 on the dense grid with padded copies, whose token counts go host to host
  (not with model.fp8: FP8 experts take no padded copies); 2 per backward);
  and per forward the rest of the dispatch's cost (`StepFit.ep_layer_s`: host time the GPU waits
  for, index kernels), once per doubling of the ranks (log2(ep) times: fitted at ep=2, two ep=4
  runs put it at 3.2x and 1.6x of that, bench/results/parallel_throughput-2026-11-30-x4.txt; the
  milder reading until 8 GPUs measure more). The last two are fitted to measured steps, not
  measured per kernel.
- context parallel: each layer's K/V all-gather forward (and recomputed forward) and the
  reduce-scatter of their gradients backward, on the critical path.
Then the optimizer: gradient clipping and torch's foreach AdamW, one pass over the local shard per
foreach op (`optimizer_bytes_per_param`), at the HBM rate.
Not counted: host time (but for the fitted EP term), kernels slower than the copy rate, the
blocks' own elementwise work (norms, rope, activations: compiled, and small next to the above).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from primerl_trainer.planner.memory import block_params, param_split
from primerl_trainer.planner.mesh import Mesh, Workload
from primerl_trainer.planner.rates import GpuRates
from primerl_trainer.planner.shapes import ModelShape
from primerl_trainer.routing_coverage import dense_grid_by_default, rank_share

__all__ = [
    "StepTime",
    "estimate_step_time",
    "local_gradient_bytes_per_param",
    "logprob_bytes_per_logit",
    "model_flops_per_token",
    "optimizer_bytes_per_param",
    "ranks_per_token",
    "ranks_sent_per_token",
    "routing_bytes",
    "uses_dense_grid",
]

_ATTENTION_BACKWARD_FLOPS = 2.5  # backward FLOPs over forward FLOPs of attention (rates' convention)
# all_to_all_single calls of one MoE layer's dispatcher (distributed.expert_parallel, packed): a
# forward exchanges the counts, the rows with their routing and the partial sums (on the dense
# grid with padded copies the counts go host to host, over gloo, once per forward for all layers:
# no NCCL call; without them, as for FP8 experts, the copy counts take a call); a backward sends
# the partial sums' and the rows' gradients back.
EP_CALLS_FORWARD, EP_CALLS_FORWARD_DENSE_GRID, EP_CALLS_BACKWARD = 3, 2, 2


# The dispatcher's default for its dense grid (AllToAllDispatcher.uses_dense_grid): every token to
# every rank where a token is expected to need at least this share of them anyway.
@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part (fsdp: only what compute does not hide)."""

    compute: float
    logprobs: float
    copies: float
    fsdp: float
    ep: float
    cp: float
    optimizer: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward, without recomputation (MFU's numerator):
    6 * matrix parameters a token passes + causal attention."""
    attention = 3 * shape.num_layers * shape.num_heads * (shape.qk_head_dim + shape.v_head_dim) * seq_len / 2
    return 6 * shape.matmul_params_per_token + attention


def _spans_nodes(group_size: int, stride: int, rates: GpuRates) -> bool:
    """Whether a group of `group_size` ranks `stride` apart leaves one node."""
    return group_size > 1 and group_size * stride > rates.gpus_per_node


def _collective_s(total_bytes: float, group_size: int, gbps: float) -> float:
    if group_size <= 1:
        return 0.0
    return total_bytes * (group_size - 1) / group_size / (gbps * 1e9)


def _linear_s(tokens: float, k: int, n: int, rates: GpuRates) -> float:
    return 2 * tokens * k * n / (rates.matmul_tflops(int(tokens), k, n) * 1e12)


def _forward_compute_s(shape: ModelShape, mesh: Mesh, workload: Workload, rates: GpuRates) -> tuple[float, float]:
    """(the blocks' forward seconds, the head's forward seconds) of one micro-batch on one GPU."""
    t = workload.seq_len / mesh.cp
    dim, heads = shape.hidden_size, shape.num_heads
    attention_proj = _linear_s(t, dim, shape.attention_params // dim, rates)
    causal_flops = 2 * heads * (shape.qk_head_dim + shape.v_head_dim) * workload.seq_len**2 / 2 / mesh.cp
    attention_fwd_tflops, _ = rates.attention_tflops(workload.seq_len, shape.qk_head_dim)
    attention_core = causal_flops / (attention_fwd_tflops * 1e12)
    dense_mlp = _linear_s(t, dim, 2 * shape.intermediate_size, rates) + _linear_s(
        t, shape.intermediate_size, dim, rates
    )
    blocks = shape.num_layers * (attention_proj + attention_core) + shape.num_dense_layers * dense_mlp
    if shape.num_moe_layers:
        f = shape.moe_intermediate_size
        rows = t * shape.top_k  # routed copies this GPU computes (balanced routing)
        rows_per_expert = rows / (shape.num_experts / mesh.ep)
        experts = 2 * rows * dim * 2 * f / (rates.grouped_mm_tflops(rows_per_expert, dim, 2 * f) * 1e12)
        experts += 2 * rows * f * dim / (rates.grouped_mm_tflops(rows_per_expert, f, dim) * 1e12)
        shared = shape.num_shared_experts * (_linear_s(t, dim, 2 * f, rates) + _linear_s(t, f, dim, rates))
        router = _linear_s(t, dim, shape.num_experts, rates)
        blocks += shape.num_moe_layers * (experts + shared + router)
    head = _linear_s(t, dim, shape.vocab_size, rates)
    return blocks, head


def _attention_backward_extra_s(shape: ModelShape, mesh: Mesh, workload: Workload, rates: GpuRates) -> float:
    """The attention core's backward minus twice its forward (the linear layers' convention)."""
    causal_flops = 2 * shape.num_heads * (shape.qk_head_dim + shape.v_head_dim) * workload.seq_len**2 / 2 / mesh.cp
    fwd_tflops, bwd_tflops = rates.attention_tflops(workload.seq_len, shape.qk_head_dim)
    backward = _ATTENTION_BACKWARD_FLOPS * causal_flops / (bwd_tflops * 1e12)
    return shape.num_layers * (backward - 2 * causal_flops / (fwd_tflops * 1e12))


def logprob_bytes_per_logit(compute_bytes: int) -> int:
    """HBM bytes token_logprobs moves per logit, forward and backward (B_c: the logits' bytes;
    every pass over a float32 chunk reads 4 and writes 4)."""
    # Upcast; / temperature; logsumexp (amax, subtract, exp, sum); - lse; exp; lse - x;
    # p * (lse - x) (two reads); sum.
    forward = (compute_bytes + 4) + 8 + (4 + 8 + 8 + 4) + 8 + 8 + 8 + 12 + 4
    # Upcast; / temperature; - lse; exp; * -grad; / temperature; the gradient written in B_c.
    backward = (compute_bytes + 4) + 8 + 8 + 8 + 8 + 8 + (4 + compute_bytes)
    return forward + backward


def optimizer_bytes_per_param(master_bytes: int) -> int:
    """HBM bytes per parameter of clipping and torch's foreach AdamW (the trainer's TritonAdamW
    defers to it for FSDP's DTensor parameters), in B_m: one pass per foreach op."""
    clip = 1 + 2  # the norm reads the gradient; the scaling reads and writes it
    # p *= 1 - lr * wd; m.lerp_(g); v *= b2; v.addcmul_(g, g); s = sqrt(v); s /= c2; s += eps;
    # p.addcdiv_(m, s).
    adamw = 2 + 3 + 2 + 3 + 2 + 2 + 2 + 4
    return (clip + adamw) * master_bytes


def local_gradient_bytes_per_param(micro_batches: int, compute_bytes: int, master_bytes: int) -> int:
    """HBM bytes per parameter of a local FSDP unit's gradient handling over one step: the first
    micro-batch's B_c gradient cast to the float32 accumulator, each later one added to it (two
    reads, a write); then the one reduction: the float32 reduce input (a copy), the one-rank
    reduce-scatter (a copy) and the cast to the B_m gradient."""
    reduce = 8 + (4 + master_bytes)
    if micro_batches == 1:
        return (compute_bytes + 4) + reduce
    return (compute_bytes + 4) + (micro_batches - 1) * (compute_bytes + 8) + 8 + reduce


def ranks_per_token(shape: ModelShape, ep: int) -> float:
    """Expected ranks holding at least one of a token's top_k experts (balanced random routing)."""
    return ep * rank_share(shape.num_experts, ep, shape.top_k)


def uses_dense_grid(shape: ModelShape, ep: int) -> bool:
    """Whether the dispatcher sends every token to every rank (distributed.expert_parallel's
    dense grid, by default where a token is expected to need at least 90% of the ranks)."""
    return ep > 1 and dense_grid_by_default(shape.num_experts, ep, shape.top_k)


def ranks_sent_per_token(shape: ModelShape, ep: int) -> float:
    """Ranks each token's row is sent to: those holding its experts, or every rank on the dense grid."""
    return float(ep) if uses_dense_grid(shape, ep) else ranks_per_token(shape, ep)


def routing_bytes(shape: ModelShape, mesh: Mesh, tokens: float, compute_bytes: int, *, forward_passes: int) -> float:
    """HBM bytes of one MoE layer's moves between token and expert order for `tokens` tokens:
    forward(s) and backward. On one rank the gathers are compiled into the block (a row read and
    written, the weighted sum reads each copy; backward: the copies' gradient gathered and
    written, the outputs read again for the scores' gradient, each token's copies summed). Under
    expert parallel the dispatcher runs eagerly: its backward of the weighted sum goes through
    float32 copies of the gathered rows (36 + 6 B_c bytes per element), and the rows sent to
    each rank are gathered, and summed back, once more each way."""
    b_c = compute_bytes
    copies = tokens * shape.top_k * shape.hidden_size
    if mesh.ep == 1:
        return copies * (forward_passes * 3 * b_c + 4 * b_c)
    sent = tokens * ranks_sent_per_token(shape, mesh.ep) * shape.hidden_size
    return copies * (forward_passes * 3 * b_c + 36 + 6 * b_c) + sent * (forward_passes + 1) * 4 * b_c


def estimate_step_time(shape: ModelShape, mesh: Mesh, workload: Workload, rates: GpuRates) -> StepTime:
    micro_batches = workload.micro_batches_per_rank(mesh)
    t = workload.seq_len / mesh.cp
    b_c = workload.compute_bytes
    hbm = rates.hbm_gbps * 1e9

    blocks_fwd, head_fwd = _forward_compute_s(shape, mesh, workload, rates)
    forward_passes = 2 if workload.activation_checkpointing else 1
    compute = blocks_fwd * (2 + forward_passes) + head_fwd * 3
    compute += _attention_backward_extra_s(shape, mesh, workload, rates)

    logprobs = 0.0
    if workload.loss == "logits":
        logprobs = t * shape.vocab_size * logprob_bytes_per_logit(b_c) / hbm

    split = param_split(shape, mesh)
    b_m = workload.master_bytes
    # accumulate_unsharded: the sharded units are gathered once per step and handle their
    # gradients as the local units do (below), then reduce once.
    unsharded = workload.accumulate_unsharded and micro_batches > 1
    # Per micro-batch: the MoE layers' row moves; the sharded units' copy-out of each of their two
    # all-gathers and their float32 reduce-scatter input; the local units' forward gather (FSDP
    # reshards every unit after backward, torch's default, so each micro-batch gathers them again):
    # the copy-in cast to B_c, the one-rank all-gather (a copy) and the copy-out.
    copies = shape.num_moe_layers * routing_bytes(shape, mesh, t, b_c, forward_passes=forward_passes) / hbm
    if not unsharded:
        copies += split.sharded * (2 * 2 * b_c + b_c + 4) / hbm
    copies += split.local * (b_m + b_c + 2 * b_c + 2 * b_c) / hbm

    # FSDP: the sharded units' non-expert part over all N ranks, experts over N / ep, ep apart.
    dense_link = rates.link(mesh.world, spans_nodes=_spans_nodes(mesh.world, 1, rates))
    expert_group = mesh.world // mesh.ep
    expert_link = rates.link(expert_group, spans_nodes=_spans_nodes(expert_group, mesh.ep, rates))
    unit_gathers = unit_scatters = 0.0  # one all-gather and one reduce-scatter of every sharded unit
    for moe, count in ((False, shape.num_dense_layers), (True, shape.num_moe_layers)):
        dense_params, expert_params = block_params(shape, mesh, moe=moe)
        for params, group, link in ((dense_params, mesh.world, dense_link), (expert_params, expert_group, expert_link)):
            unit_gathers += count * _collective_s(params * b_c, group, link.all_gather_gbps)
            unit_scatters += count * _collective_s(params * 4, group, link.reduce_scatter_gbps)
    head = shape.vocab_size * shape.hidden_size * (1 if shape.tie_embeddings else 2)
    unit_gathers += _collective_s(head * b_c, mesh.world, dense_link.all_gather_gbps)
    unit_scatters += _collective_s(head * 4, mesh.world, dense_link.reduce_scatter_gbps)
    exposed_fraction = rates.fit.fsdp_exposed_fraction
    fsdp = 2 * unit_gathers + unit_scatters  # a micro-batch's: gathered in forward and again in backward
    if unsharded:
        # One all-gather and one reduce-scatter per step, hidden behind the step's compute but
        # for the exposed fraction; counted per micro-batch.
        fsdp_step = unit_gathers + unit_scatters
        fsdp_exposed = max(fsdp_step - micro_batches * (compute + copies), exposed_fraction * fsdp_step) / micro_batches
    else:
        fsdp_exposed = max(fsdp - compute - copies, exposed_fraction * fsdp)

    ep = 0.0
    if mesh.ep > 1 and shape.num_moe_layers:
        link = rates.link(mesh.ep, spans_nodes=_spans_nodes(mesh.ep, 1, rates))
        send_bytes = t * ranks_sent_per_token(shape, mesh.ep) * shape.hidden_size * b_c
        all_to_alls = 2 * (forward_passes + 1)  # dispatch + combine, per forward and the backward
        padded_grid = uses_dense_grid(shape, mesh.ep) and not workload.fp8  # FP8 experts take no padded copies
        calls_forward = EP_CALLS_FORWARD_DENSE_GRID if padded_grid else EP_CALLS_FORWARD
        calls = forward_passes * calls_forward + EP_CALLS_BACKWARD
        ep = shape.num_moe_layers * (
            all_to_alls * _collective_s(send_bytes, mesh.ep, link.all_to_all_gbps)
            + calls * link.all_to_all_call_s
            + forward_passes * math.log2(mesh.ep) * rates.fit.ep_layer_s
        )

    cp = 0.0
    if mesh.cp > 1:
        link = rates.link(mesh.cp, spans_nodes=_spans_nodes(mesh.cp, 1, rates))
        kv_bytes = workload.seq_len * shape.kv_elements_per_token * b_c
        gathers = forward_passes * _collective_s(kv_bytes, mesh.cp, link.all_gather_gbps)
        cp = shape.num_layers * (gathers + _collective_s(kv_bytes, mesh.cp, link.reduce_scatter_gbps))

    # Once per step: the local units' gradients (with accumulate_unsharded the sharded units' too,
    # after their one gather's copy-out); the optimizer.
    accumulating = split.local + (split.sharded if unsharded else 0.0)
    local_grads = accumulating * local_gradient_bytes_per_param(micro_batches, b_c, b_m) / hbm
    if unsharded:
        local_grads += split.sharded * 2 * b_c / hbm
    optimizer = optimizer_bytes_per_param(b_m) * shape.total_params / mesh.world / hbm
    return StepTime(
        compute=micro_batches * compute,
        logprobs=micro_batches * logprobs,
        copies=micro_batches * copies + local_grads,
        fsdp=micro_batches * fsdp_exposed,
        ep=micro_batches * ep,
        cp=micro_batches * cp,
        optimizer=optimizer,
    )
