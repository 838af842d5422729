"""Context parallel: the zig-zag split of packed rows and its gather, the attention masks of a
rank's share of a row, and training on the CPU (gloo, torchrun) with cp=2 and cp=2 x FSDP 2 (4
ranks), dense and MoE with router replay: the same losses, per-token logprobs and updated weights
as one process."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from primerl_trainer.batch import BatchSpec, MicroBatch
from primerl_trainer.distributed.context_parallel import RowLayout, shard_micro_batch
from primerl_trainer.distributed.cp_collectives import row_to_zigzag, zigzag_to_row
from primerl_trainer.losses import token_logprobs
from primerl_trainer.models import load_model
from primerl_trainer.models.common.attention import _document_block_mask
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

from .tiny_training import (
    DP_OPTIMIZER,
    DP_SCHEDULE,
    SEQ_LEN,
    Sample,
    assert_weights_match_after_adam,
    load_tiny_model,
    make_samples,
    micro_batches_to_dicts,
    pack,
    pack_into,
    parameters,
    reference_logprobs,
)

HERE = pathlib.Path(__file__).parent
CPU = torch.device("cpu")
METRICS = ("loss", "grad_norm", "lr", "entropy", "mismatch_kl", "masked_fraction", "num_loss_tokens")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _row(num_tokens: int, sample_lengths: list[int], *, seed: int = 0) -> MicroBatch:
    """A packed row of samples of these lengths (padded by one sample up to num_tokens), with
    distinct values in every field and routed experts [T, 3 layers, top_k 2]."""
    assert sum(sample_lengths) <= num_tokens
    lengths = (
        [*sample_lengths, num_tokens - sum(sample_lengths)] if sum(sample_lengths) < num_tokens else sample_lengths
    )
    positions = torch.cat([torch.arange(n) for n in lengths])
    generator = torch.Generator().manual_seed(seed)
    return MicroBatch(
        input_ids=torch.randint(0, 256, (num_tokens,), generator=generator),
        position_ids=positions,
        loss_mask=positions > 0,
        temperatures=torch.rand(num_tokens, generator=generator) + 0.5,
        advantages=torch.randn(num_tokens, generator=generator),
        inference_logprobs=-torch.rand(num_tokens, generator=generator),
        routed_experts=torch.randint(0, 8, (num_tokens, 3, 2), generator=generator, dtype=torch.uint8),
    )


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_tokens", [3, 16, 45])
def test_split_then_gather_in_zigzag_order_gives_the_row_back(cp_size: int, num_tokens: int) -> None:
    row = _row(num_tokens, [2, 5, 9][: 1 + num_tokens // 16])
    shards = [shard_micro_batch(row, cp_rank=rank, cp_size=cp_size) for rank in range(cp_size)]
    layout = shards[0].layout
    multiple = 2 * cp_size if cp_size > 1 else 1
    assert layout.padded_len % multiple == 0 and 0 <= layout.padded_len - num_tokens < multiple
    for name in ("input_ids", "position_ids", "routed_experts"):
        locals_ = [getattr(shard, name) for shard in shards]
        # Every rank holds as many tokens; in zig-zag order they make the padded row.
        assert {len(local) for local in locals_} == {layout.num_local_tokens}
        padded = zigzag_to_row(torch.cat(locals_), cp_size) if cp_size > 1 else locals_[0]
        assert torch.equal(padded[:num_tokens], getattr(row, name)), name
    # Prediction-aligned fields: index t holds token t+1's term; the pad adds no loss.
    for name, pad in (("targets", 0), ("target_temperatures", 1.0), ("loss_mask", False), ("advantages", 0.0)):
        source = row.input_ids if name == "targets" else getattr(row, name.removeprefix("target_"))
        locals_ = [getattr(shard, name) for shard in shards]
        padded = zigzag_to_row(torch.cat(locals_), cp_size) if cp_size > 1 else locals_[0]
        assert torch.equal(padded[: num_tokens - 1], source[1:]), name
        assert (padded[num_tokens - 1 :] == pad).all(), name
    # Each rank's global positions are where its tokens sit in the padded row.
    for shard in shards:
        padded_ids = torch.cat([row.input_ids, torch.zeros(layout.padded_len - num_tokens, dtype=torch.long)])
        assert torch.equal(padded_ids[shard.layout.global_positions], shard.input_ids)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zigzag_gives_every_rank_the_same_causal_work(cp_size: int) -> None:
    layouts = [RowLayout.of(torch.arange(200), cp_rank=rank, cp_size=cp_size) for rank in range(cp_size)]
    # Query at row index i attends to i + 1 keys.
    work = {int((layout.global_positions + 1).sum()) for layout in layouts}
    assert len(work) == 1
    x = torch.arange(layouts[0].padded_len)
    assert torch.equal(zigzag_to_row(row_to_zigzag(x, cp_size), cp_size), x)


def test_pad_tokens_are_a_sample_of_their_own() -> None:
    layout = RowLayout.of(torch.arange(5), cp_rank=1, cp_size=2)
    assert layout.padded_len == 8
    assert layout.document_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert layout.single_document
    assert not RowLayout.of(torch.tensor([0, 1, 2, 0, 1]), cp_rank=0, cp_size=2).single_document
    with pytest.raises(ValueError, match="cp rank 2"):
        RowLayout.of(torch.arange(5), cp_rank=2, cp_size=2)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_flex_block_mask_of_a_ranks_share_is_the_document_causal_rule(cp_size: int) -> None:
    # 700 tokens: tiles of 128 straddle chunk and sample boundaries, and a 400-token sample
    # gives full tiles.
    row = _row(700, [3, 60, 400, 1, 100, 17])
    generator = torch.Generator().manual_seed(0)
    q_all = torch.randn(1, 4, 702, 8, generator=generator)
    k, v = (torch.randn(1, 2, 702, 8, generator=generator) for _ in range(2))
    for rank in range(cp_size):
        layout = RowLayout.of(row.position_ids, cp_rank=rank, cp_size=cp_size)
        positions, docs = layout.global_positions, layout.document_ids
        num_keys = layout.padded_len
        dense = (positions[:, None] >= torch.arange(num_keys)) & (docs[positions][:, None] == docs)

        def rule(b, h, q_idx, kv_idx, positions=positions, docs=docs):
            return (positions[q_idx] >= kv_idx) & (docs[positions[q_idx]] == docs[kv_idx])

        q = q_all[:, :, positions]
        keys, values = k[:, :, :num_keys], v[:, :, :num_keys]
        block = _document_block_mask(rule, positions, docs)
        got = flex_attention(q, keys, values, block_mask=block, enable_gqa=True)
        wanted = F.scaled_dot_product_attention(q, keys, values, attn_mask=dense, enable_gqa=True)
        torch.testing.assert_close(got, wanted, rtol=0, atol=1e-5)
        # Tiles are skipped (empty), and in the whole row some need no mask (full).
        num_tiles = -(-len(positions) // 128) * -(-num_keys // 128)
        assert int(block.kv_num_blocks.sum() + block.full_kv_num_blocks.sum()) < num_tiles
        assert cp_size > 1 or int(block.full_kv_num_blocks.sum()) > 0


def test_trainer_logprobs_are_the_models_at_every_token(dense_dir: pathlib.Path) -> None:
    model = load_tiny_model(dense_dir)
    micro_batch = pack(make_samples(model, seed=3, num_samples=3))
    trainer = _trainer(model, BatchSpec(seq_len=SEQ_LEN, vocab_size=model.args.vocab_size))
    logprobs, entropy = trainer.token_logprobs(micro_batch)
    with torch.no_grad():
        logits = model(micro_batch.input_ids[None], micro_batch.position_ids[None]).logits[0]
    wanted, wanted_entropy = token_logprobs(logits, micro_batch.input_ids, micro_batch.temperatures)
    torch.testing.assert_close(logprobs, wanted, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, wanted_entropy, rtol=0, atol=1e-6)


def _trainer(model: torch.nn.Module, spec: BatchSpec) -> Trainer:
    optimizer = build_optimizer(model, DP_OPTIMIZER)
    return Trainer(model, optimizer, build_lr_scheduler(optimizer, DP_SCHEDULE), spec=spec, device=CPU)


def _short_row(model: torch.nn.Module) -> MicroBatch:
    """Three tokens, fewer than 2 * cp: padded, not refused."""
    prompt, completion = torch.tensor([5, 6]), torch.tensor([7])
    ids = torch.cat([prompt, completion])
    logprobs = torch.log_softmax(model(ids[None]).logits[0, 1].double() / 0.7, -1)[7:8].float()
    return pack(
        [Sample(prompt=prompt, completion=completion, advantage=0.5, temperature=0.7, inference_logprobs=logprobs)]
    )


def _replayed(micro_batch: MicroBatch, model: torch.nn.Module, generator: torch.Generator) -> MicroBatch:
    """Experts drawn at random (not the router's top-k): K distinct per token."""
    args = model.args
    scores = torch.rand(micro_batch.num_tokens, len(args.moe_layers), args.num_experts, generator=generator)
    return dataclasses.replace(micro_batch, routed_experts=scores.topk(args.top_k, dim=-1).indices.to(torch.uint8))


def _cp_data(
    model_dir: pathlib.Path, out: pathlib.Path, *, replay: bool, dtype: torch.dtype = torch.float32
) -> tuple[pathlib.Path, dict]:
    """Two batches of 4 micro-batches (several samples per row, a one-sample row, a row shorter
    than 2 * cp), a probe row, and the one-process reference, trained in `dtype`."""
    # torch._grouped_mm has no float64 kernel: float64 runs the experts one by one (as cp_worker).
    model = load_model(
        model_dir, impl="auto", dtype=torch.float32, experts_impl="loop" if dtype == torch.float64 else "auto"
    )
    args = model.args
    spec = BatchSpec(seq_len=SEQ_LEN, vocab_size=args.vocab_size)
    if replay:
        spec = dataclasses.replace(
            spec,
            router_replay=True,
            num_moe_layers=len(args.moe_layers),
            num_experts_per_token=args.top_k,
            num_experts=args.num_experts,
            num_hidden_layers=None,
            moe_layers=None,
        )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        one_sample = pack(make_samples(model, seed=2, num_samples=1))
        batches = [
            [*pack_into(make_samples(model, seed=0, num_samples=7), 3), _short_row(model)],
            [
                *pack_into(make_samples(model, seed=1, num_samples=6), 2),
                one_sample,
                pack(make_samples(model, seed=3, num_samples=4)),
            ],
        ]
        probe = pack(make_samples(model, seed=4, num_samples=14))
        if replay:
            batches = [[_replayed(mb, model, generator) for mb in batch] for batch in batches]
            probe = _replayed(probe, model, generator)
    trainer = _trainer(model.to(dtype), spec)
    initial_logprobs, _ = trainer.token_logprobs(probe)
    metrics = [trainer.train_step(batch) for batch in batches]
    logprobs, entropy = trainer.token_logprobs(probe)
    reference = {
        "metrics": metrics,
        "initial_logprobs": initial_logprobs,
        "logprobs": logprobs,
        "entropy": entropy,
        "weights": parameters(model),
    }
    path = out / "data.pt"
    data = {
        "batches": [micro_batches_to_dicts(batch) for batch in batches],
        "probe": micro_batches_to_dicts([probe])[0],
        "spec": dataclasses.asdict(spec),
    }
    torch.save(data, path)
    return path, reference


def _run_workers(
    model_dir: pathlib.Path,
    data: pathlib.Path,
    out: pathlib.Path,
    *,
    nproc: int,
    cp: int,
    dtype: torch.dtype,
    gpu_options: tuple[str, ...] | None = None,
    ep: int = 1,
) -> dict:
    """cp_worker.py's result; on the CPU unless `gpu_options` (cp_worker's options) are given."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = os.environ | {"OMP_NUM_THREADS": "1"} | ({} if gpu_options is not None else {"CUDA_VISIBLE_DEVICES": ""})
    options = ["--dtype", str(dtype).removeprefix("torch."), "--ep", str(ep), *(gpu_options or ())]
    result = subprocess.run(
        [*command, str(HERE / "cp_worker.py"), str(model_dir), str(data), str(out), str(cp), *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return torch.load(out / "result.pt")


# float64 shows the split is exact (all within ~1e-13). In float32 the ranks sum in another order
# (gradients over cp and FSDP ranks, expert matrix products over half the tokens): the dense
# model's losses and logprobs stay within 1e-5, but Adam's normalisation lifts the rounding to
# up to lr in the rare weights whose gradient nearly cancels (seen: 1 entry of 131,072 by 1.5e-4),
# ~1e-5 elsewhere (tiny_training.assert_weights_match_after_adam), and the MoE model's losses move by
# ~3e-5: the MoE model is compared in float64.
TOLERANCES = {torch.float32: (1e-5, None), torch.float64: (1e-10, 1e-10)}
# The trained model's logprobs and entropy, float32: one process attends each packed sample on
# its own (models/common/attention.py), the cp ranks their row share under the dense mask; the
# two kernels round apart (~5e-6 before training, ~1e-6 in the gradients), and two Adam steps,
# which normalise gradients, carry that to ~3e-4. float64 holds the exact claim.
TRAINED_FLOAT32_TOLERANCE = 1e-3


def _assert_matches_one_process(result: dict, reference: dict, dtype: torch.dtype) -> None:
    tolerance, weight_tolerance = TOLERANCES[dtype]
    assert len(result["metrics"]) == len(reference["metrics"])
    for step, (got, wanted) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
        for key in METRICS:
            assert got[key] == pytest.approx(wanted[key], rel=tolerance, abs=tolerance), (step, key)
    trained = TRAINED_FLOAT32_TOLERANCE if dtype == torch.float32 else tolerance
    for key, bound in (("initial_logprobs", tolerance), ("logprobs", trained), ("entropy", trained)):
        # Relative too: logprobs are ~ -6 (float32 resolves ~5e-7 there).
        torch.testing.assert_close(result[key], reference[key], rtol=bound, atol=bound, msg=key)
    # Flex (forward only on the CPU) gives the same as the dense mask; every rank the same row.
    torch.testing.assert_close(result["other_backend_logprobs"], result["logprobs"], rtol=tolerance, atol=tolerance)
    for logprobs in result["all_ranks_logprobs"]:
        assert torch.equal(logprobs, result["logprobs"])
    assert result["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        if dtype == torch.float64:
            torch.testing.assert_close(
                result["weights"][name], weight, rtol=0, atol=weight_tolerance, msg=lambda m, n=name: f"{n}: {m}"
            )
        else:
            assert_weights_match_after_adam(name, result["weights"][name], weight)
        # A publish gathers the same full tensors to rank 0.
        assert torch.equal(result["published"][name], result["weights"][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=pytest.mark.slow)])
def test_cp2_trains_as_one_process(
    dtype: torch.dtype, dense_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: pathlib.Path
) -> None:
    data, reference = _cp_data(dense_dir, tmp_path_factory.mktemp("cp-dense"), replay=False, dtype=dtype)
    _assert_matches_one_process(_run_workers(dense_dir, data, tmp_path, nproc=2, cp=2, dtype=dtype), reference, dtype)


@pytest.mark.slow
def test_cp2_by_fsdp2_trains_as_one_process(
    dense_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: pathlib.Path
) -> None:
    data, reference = _cp_data(dense_dir, tmp_path_factory.mktemp("cp-fsdp"), replay=False)
    result = _run_workers(dense_dir, data, tmp_path, nproc=4, cp=2, dtype=torch.float32)
    _assert_matches_one_process(result, reference, torch.float32)


def test_cp2_with_router_replay_trains_the_moe_model_as_one_process(
    moe_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: pathlib.Path
) -> None:
    # Experts replicated over the cp ranks (no expert parallel), replayed routing on every token.
    data, reference = _cp_data(moe_dir, tmp_path_factory.mktemp("cp-moe"), replay=True, dtype=torch.float64)
    result = _run_workers(moe_dir, data, tmp_path, nproc=2, cp=2, dtype=torch.float64)
    _assert_matches_one_process(result, reference, torch.float64)


@pytest.mark.slow
def test_cp2_by_ep2_trains_the_moe_model_as_one_process(
    moe_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: pathlib.Path
) -> None:
    """Expert parallel over the cp ranks (ep=2 = cp=2, 2 ranks), router replay, in float32: expert
    matrix products over other token counts round differently (losses ~3e-5 apart after a step,
    weights ~1e-4), so the bounds are float32's rounding; the forward before any step is exact."""
    data, reference = _cp_data(moe_dir, tmp_path_factory.mktemp("cp-ep"), replay=True)
    result = _run_workers(moe_dir, data, tmp_path, nproc=2, cp=2, dtype=torch.float32, ep=2)
    for step, (got, wanted) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
        for key in METRICS:
            assert got[key] == pytest.approx(wanted[key], rel=2e-4, abs=1e-4), (step, key)
    torch.testing.assert_close(result["initial_logprobs"], reference["initial_logprobs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result["logprobs"], reference["logprobs"], rtol=0, atol=5e-4)
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(
            result["weights"][name], weight, rtol=0, atol=5e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def _long_sample(model: torch.nn.Module, generator: torch.Generator, num_prompt: int, num_completion: int) -> Sample:
    prompt = torch.randint(0, 256, (num_prompt,), generator=generator)
    completion = torch.randint(0, 256, (num_completion,), generator=generator)
    logprobs = reference_logprobs(model, torch.cat([prompt, completion]), 0.7)[num_prompt:]
    advantage = float(torch.randn((), generator=generator))
    return Sample(
        prompt=prompt, completion=completion, advantage=advantage, temperature=0.7, inference_logprobs=logprobs
    )


def _long_rows_data(model_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """One batch of rows thousands of tokens long (attention tiles of 128 full, partial and
    empty; a one-sample row takes the flash path) and a packed probe row."""
    model = load_tiny_model(model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        samples = [_long_sample(model, generator, p, c) for p, c in ((100, 2900), (300, 400), (20, 1480), (5, 295))]
        short = [_long_sample(model, generator, 2, 1)]
        probe = [_long_sample(model, generator, p, c) for p, c in ((200, 1000), (5, 5), (600, 1200))]
    batch = [pack(samples[:1]), pack(samples[1:]), pack(short)]
    spec = BatchSpec(seq_len=4096, vocab_size=model.args.vocab_size)
    data = {"batches": [micro_batches_to_dicts(batch)], "probe": micro_batches_to_dicts([pack(probe)])[0]}
    torch.save(data | {"spec": dataclasses.asdict(spec)}, out / "data.pt")
    return out / "data.pt"


@pytest.mark.gpu
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attn_backend", ["sdpa", "flex"])
def test_cp2_on_two_gpus_trains_as_one_gpu(
    attn_backend: str, compute_dtype: str, dense_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """NCCL, compiled blocks with activation checkpointing, long rows: cp=2 on two GPUs against
    one GPU with the same settings (bfloat16: within its rounding)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    data = _long_rows_data(dense_dir, tmp_path)
    options = ("--compute-dtype", compute_dtype, "--attn-backend", attn_backend, "--compile")
    results = []
    for nproc in (1, 2):
        (out := tmp_path / f"cp{nproc}").mkdir()
        results.append(
            _run_workers(dense_dir, data, out, nproc=nproc, cp=nproc, dtype=torch.float32, gpu_options=options)
        )
    one, two = results
    bf16 = compute_dtype == "bfloat16"
    for key in ("loss", "grad_norm", "entropy"):
        wanted = pytest.approx(one["metrics"][0][key], rel=2e-2 if bf16 else 1e-4, abs=1e-2 if bf16 else 1e-5)
        assert two["metrics"][0][key] == wanted, key
    # Before the step: the forward alone.
    difference = (two["initial_logprobs"] - one["initial_logprobs"]).abs()
    assert float(difference.max()) < (5e-2 if bf16 else 1e-4)
    assert float(difference.mean()) < (5e-3 if bf16 else 1e-5)
    backends = (two["other_backend_logprobs"] - two["logprobs"]).abs()
    assert float(backends.mean()) < (5e-3 if bf16 else 1e-5)
    for name, weight in one["weights"].items():
        # One AdamW step of lr 1e-3: Adam's normalisation lifts gradient rounding in entries whose
        # gradient nearly cancels to ~1e-4 (float32, on the CPU), up to 6.6e-4 (one entry of 32,768,
        # float32 on two H100s, 2026-11-25) and up to ~lr (bfloat16).
        torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=2e-3 if bf16 else 1e-3)
