"""Expert parallel on the CPU (gloo, torchrun): the tiny MoE model with its experts split over 2
ranks (ep=2), and over 2 x 2 (FSDP 2 x ep 2, 4 ranks), trains as one process does: same losses,
per-token logprobs (with replayed experts) and updated weights; router replay decides the
dispatch; a checkpoint saved at ep=2 resumes under plain FSDP on 2 ranks. Also the load-balance
metrics, and what the runtime refuses (degrees, the deepep backend, a dense model under ep)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from primerl_common.config import ConfigError, load_config
from primerl_launcher.tiny_model import TinyQwen3MoeSpec, make_tiny_model
from primerl_trainer.batch import BatchSpec
from primerl_trainer.config import LoRAConfig, TrainerConfig
from primerl_trainer.config_types import OptimizerConfig
from primerl_trainer.distributed.expert_parallel import check_ep_comm_backend
from primerl_trainer.distributed.parallel_dims import ParallelDims
from primerl_trainer.expert_load import load_metrics
from primerl_trainer.export import exported_tensors, gather_state_dict
from primerl_trainer.lora import apply_lora
from primerl_trainer.losses import token_logprobs
from primerl_trainer.models import model_spec_of
from primerl_trainer.models.fp8 import convert_to_fp8
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.runtime import build_runtime
from primerl_trainer.train import Trainer

from .serving import trainer_config
from .tiny_training import (
    DP_SCHEDULE,
    SEQ_LEN,
    load_tiny_model,
    make_samples,
    micro_batches_from_dicts,
    micro_batches_to_dicts,
    pack,
    pack_into,
    parameters,
)

HERE = pathlib.Path(__file__).parent
CPU = torch.device("cpu")
METRICS = ("loss", "grad_norm", "lr", "entropy", "mismatch_kl", "masked_fraction", "num_loss_tokens")
# Adam's first steps move each weight by about lr * sign(gradient): with the default eps, a gradient
# that is rounding noise (summed in another order on other ranks) can flip its sign and move the
# weight by 2 * lr. An eps above that noise keeps such steps small, so updated weights compare at 1e-5.
EP_OPTIMIZER = OptimizerConfig(lr=1e-3, eps=1e-4, weight_decay=0.01)
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q", "experts"])
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _specs(model: torch.nn.Module) -> tuple[BatchSpec, BatchSpec]:
    args = model.args
    plain = BatchSpec(seq_len=SEQ_LEN, vocab_size=args.vocab_size)
    replay = BatchSpec(
        seq_len=SEQ_LEN,
        vocab_size=args.vocab_size,
        router_replay=True,
        num_moe_layers=len(args.moe_layers),
        num_experts_per_token=args.top_k,
        num_experts=args.num_experts,
    )
    return plain, replay


@torch.no_grad()
def _logprobs(model: torch.nn.Module, micro_batch) -> torch.Tensor:
    output = model(
        micro_batch.input_ids[None], micro_batch.position_ids[None], routed_experts=micro_batch.routed_experts
    )
    return token_logprobs(output.logits[0], micro_batch.input_ids, micro_batch.temperatures)[0]


def _replayed(micro_batch, model: torch.nn.Module, generator: torch.Generator):
    """The micro-batch with experts drawn at random (not the router's top-k): K distinct per token."""
    args = model.args
    scores = torch.rand(micro_batch.num_tokens, len(args.moe_layers), args.num_experts, generator=generator)
    routed = scores.topk(args.top_k, dim=-1).indices.to(torch.uint8)
    return dataclasses.replace(micro_batch, routed_experts=routed)


def make_ep_model(root: pathlib.Path) -> pathlib.Path:
    """A smaller MoE than the shared tiny one (2 layers, dim 64, 8 experts, top 2): 2 and 4 ranks
    on a 2-core machine."""
    spec = TinyQwen3MoeSpec(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    return make_tiny_model(root / "ep-tiny-moe", family="qwen3-moe", dtype="float32", spec=spec)


def make_ep_data(moe_dir: pathlib.Path, root: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """Three batches of 4 micro-batches (the third with replayed experts), a replayed probe, and
    the one-process reference: metrics of the 3 steps, probe logprobs after step 2, weights."""
    model = load_tiny_model(moe_dir)
    plain_spec, replay_spec = _specs(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        batches = [pack_into(make_samples(model, seed=seed, num_samples=4), 4) for seed in range(3)]
        probe = _replayed(pack(make_samples(model, seed=10, num_samples=2)), model, generator)

    optimizer = build_optimizer(model, EP_OPTIMIZER)
    trainer = Trainer(model, optimizer, build_lr_scheduler(optimizer, DP_SCHEDULE), spec=plain_spec, device=CPU)
    metrics = [trainer.train_step(batch) for batch in batches[:2]]
    logprobs = _logprobs(model, probe)
    # Inference's logprobs of the replayed batch are the model's own under that routing (plus
    # noise), as an engine that routed so would give: far-off ones make the loss's ratios explode.
    batches[2] = [_replayed(micro_batch, model, generator) for micro_batch in batches[2]]
    batches[2] = [
        dataclasses.replace(
            mb,
            inference_logprobs=(_logprobs(model, mb) + 0.05 * torch.randn(mb.num_tokens, generator=generator)).clamp(
                max=0.0
            ),
        )
        for mb in batches[2]
    ]
    trainer.spec = replay_spec
    metrics.append(trainer.train_step(batches[2]))
    reference = {"metrics": metrics, "logprobs": logprobs, "weights": parameters(model)}

    lora_model = load_tiny_model(moe_dir)
    apply_lora(lora_model, LORA)
    lora_optimizer = build_optimizer(lora_model, EP_OPTIMIZER)
    lora_trainer = Trainer(
        lora_model, lora_optimizer, build_lr_scheduler(lora_optimizer, DP_SCHEDULE), spec=plain_spec, device=CPU
    )
    reference["lora"] = {"metrics": lora_trainer.train_step(batches[0])}
    for kind in ("full", "adapter"):
        source = gather_state_dict(lora_model, kind=kind, is_destination=True)
        scale = LORA.alpha / LORA.rank
        reference["lora"][kind] = dict(
            exported_tensors(lora_model, source, kind=kind, dtype=torch.float32, lora_scale=scale)
        )

    path = root / "batches.pt"
    data = {
        "batches": [micro_batches_to_dicts(batch) for batch in batches],
        "probe": micro_batches_to_dicts([probe])[0],
        "spec": dataclasses.asdict(plain_spec),
        "replay_spec": dataclasses.asdict(replay_spec),
        "optimizer": EP_OPTIMIZER.model_dump(),
        "lora": LORA.model_dump(),
    }
    torch.save(data, path)
    return path, data | {"reference": reference, "probe_routed_experts": probe.routed_experts}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_ep_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def ep_data(moe_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    return make_ep_data(moe_dir, tmp_path_factory.mktemp("ep"))


def _run_workers(
    moe_dir: pathlib.Path, batches: pathlib.Path, out: pathlib.Path, *, nproc: int, ep: int, device_type: str = "cpu"
) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    # Hiding the GPUs makes the workers take gloo on the CPU.
    env = os.environ | ({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"} if device_type == "cpu" else {})
    result = subprocess.run(
        [*command, str(HERE / "ep_worker.py"), str(moe_dir), str(batches), str(out), str(ep)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return torch.load(out / "result.pt")


def test_packed_dispatch_equals_the_unpacked_one_bitwise() -> None:
    """The routing in the rows' all-to-all (bf16 rows carry float32 bits) gives the same outputs
    and gradients as in an all-to-all of its own (ep_dispatch_worker.py, 2 ranks over gloo)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*command, str(HERE / "ep_dispatch_worker.py")],
        capture_output=True,
        text=True,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]


def _assert_matches_one_process(result: dict, reference: dict, probe_routed_experts: torch.Tensor) -> None:
    for step, (got, wanted) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
        for key in METRICS:
            # The gradient norm sums squares in another order (1e-5 relative seen after an Adam step).
            rel = 1e-4 if key == "grad_norm" else 1e-5
            assert got[key] == pytest.approx(wanted[key], rel=rel, abs=1e-5), (step, key)
        # Load balance: the counts of all ranks' tokens, as one process counts them.
        moe_keys = {key for key in wanted if key.startswith("moe/")}
        assert moe_keys and {key: got[key] for key in moe_keys} == {key: wanted[key] for key in moe_keys}, step
        assert "moe/max_ep_rank_load_ratio" in got
    # Replay: the replayed experts are the ones used, and give one process's logprobs.
    assert torch.equal(result["routed_experts"], probe_routed_experts.long())
    # Relative too: logprobs are ~ -6, where float32 resolves ~5e-7 (1.2e-5 apart seen for Qwen3.5-MoE).
    torch.testing.assert_close(result["logprobs"], reference["logprobs"], rtol=1e-5, atol=1e-5)
    assert result["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(
            result["weights"][name], weight, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
        # A publish gathers the same full tensors to rank 0.
        assert torch.equal(result["published"][name], result["weights"][name]), name
    # LoRA (attention and experts) under the same mesh: one process's step, merged weights and adapter.
    lora, wanted_lora = result["lora"], reference["lora"]
    for key in METRICS:
        assert lora["metrics"][key] == pytest.approx(wanted_lora["metrics"][key], rel=1e-5, abs=1e-5), key
    for kind in ("full", "adapter"):
        assert lora[kind].keys() == wanted_lora[kind].keys()
        for name, tensor in wanted_lora[kind].items():
            torch.testing.assert_close(lora[kind][name], tensor, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("device_type", "accumulate_unsharded", "dispatch"),
    [
        ("cpu", False, {}),
        ("cpu", True, {"packed": False}),
        ("cpu", False, {"dense_grid": True}),
        pytest.param("cuda", False, {}, marks=pytest.mark.gpu),
    ],
)
def test_ep2_trains_as_one_process_and_its_checkpoint_resumes_under_fsdp2(
    device_type: str,
    accumulate_unsharded: bool,
    dispatch: dict,
    moe_dir: pathlib.Path,
    ep_data: tuple[pathlib.Path, dict],
    tmp_path: pathlib.Path,
) -> None:
    """accumulate_unsharded: the FSDP units sharded over the 2 ranks stay gathered through each
    rank's 2 micro-batches and reduce once per step. dispatch: DispatchOptions fields (packed
    False: the routing in an all-to-all of its own; dense_grid True: every token sent to both ranks,
    where the default at this shape, top-2 of 8 experts, sends each only to its experts' ranks)."""
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    batches, data = ep_data
    data_file = tmp_path / "batches.pt"
    options = {"resume": True, "accumulate_unsharded": accumulate_unsharded, "dispatch": dispatch}
    torch.save(torch.load(batches) | options, data_file)
    result = _run_workers(moe_dir, data_file, tmp_path, nproc=2, ep=2, device_type=device_type)
    _assert_matches_one_process(result, data["reference"], data["probe_routed_experts"])
    # The third step again, from the ep=2 checkpoint of step 2 loaded into FSDP over 2 ranks.
    for key in METRICS:
        wanted = data["reference"]["metrics"][2][key]
        assert result["resumed_metrics"][key] == pytest.approx(wanted, rel=1e-5, abs=1e-5), key


def test_ep2_with_model_fp8_trains_as_one_process_in_fp8(
    moe_dir: pathlib.Path, ep_data: tuple[pathlib.Path, dict], tmp_path: pathlib.Path
) -> None:
    """model.fp8 (the emulated backend's numbers, weight gradients in the model's dtype) with the
    experts split over 2 ranks: the steps, probe logprobs and weights of one process in FP8, which
    differ from bf16's (the products did run in FP8 on both sides)."""
    batches, data = ep_data
    data_file = tmp_path / "batches.pt"
    torch.save(torch.load(batches) | {"resume": False, "lora": None, "fp8": "emulated"}, data_file)
    result = _run_workers(moe_dir, data_file, tmp_path, nproc=2, ep=2)

    model = load_tiny_model(moe_dir)
    conversion = convert_to_fp8(model.layers, backend="emulated", device="cpu", weight_grad="model_dtype")
    assert conversion.experts and not conversion.unaligned
    plain_spec, replay_spec = BatchSpec(**data["spec"]), BatchSpec(**data["replay_spec"])
    steps = [micro_batches_from_dicts(batch) for batch in data["batches"]]
    optimizer = build_optimizer(model, EP_OPTIMIZER)
    trainer = Trainer(model, optimizer, build_lr_scheduler(optimizer, DP_SCHEDULE), spec=plain_spec, device=CPU)
    metrics = [trainer.train_step(batch) for batch in steps[:2]]
    probe = micro_batches_from_dicts([data["probe"]])[0]
    logprobs = _logprobs(model, probe)
    trainer.spec = replay_spec
    metrics.append(trainer.train_step(steps[2]))
    for step, (got, wanted) in enumerate(zip(result["metrics"], metrics, strict=True)):
        for key in METRICS:
            rel = 1e-4 if key == "grad_norm" else 1e-5
            assert got[key] == pytest.approx(wanted[key], rel=rel, abs=1e-5), (step, key)
    torch.testing.assert_close(result["logprobs"], logprobs, rtol=1e-5, atol=1e-5)
    # An activation a float32 rounding apart (the gradients summed in another order) can fall in
    # the next e4m3 step: a weight then moves a few 1e-5 apart after Adam's normalized update.
    for name, weight in parameters(model).items():
        torch.testing.assert_close(
            result["weights"][name], weight, rtol=0, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert result["metrics"][0]["loss"] != pytest.approx(data["reference"]["metrics"][0]["loss"], rel=1e-6)


@pytest.mark.slow
def test_fsdp2_x_ep2_on_four_ranks_trains_as_one_process(
    moe_dir: pathlib.Path, ep_data: tuple[pathlib.Path, dict], tmp_path: pathlib.Path
) -> None:
    batches, data = ep_data
    data_file = tmp_path / "batches.pt"
    torch.save(torch.load(batches) | {"resume": False}, data_file)
    result = _run_workers(moe_dir, data_file, tmp_path, nproc=4, ep=2)
    _assert_matches_one_process(result, data["reference"], data["probe_routed_experts"])


def test_deepep_is_refused_clearly_when_not_importable() -> None:
    check_ep_comm_backend("torch")
    with pytest.raises(ValueError, match=r"model\.ep_comm_backend 'deepep' needs DeepEP"):
        check_ep_comm_backend("deepep")


def test_load_metrics_from_routed_token_counts() -> None:
    # Two MoE layers (model layers 1 and 3) of 4 experts, split over 2 ep ranks.
    counts = torch.tensor([[4, 4, 4, 4], [8, 0, 6, 2]])
    metrics = load_metrics(counts, moe_layers=(1, 3), ep=2)
    assert metrics == {
        "moe/max_load_ratio": 2.0,
        "moe/mean_max_load_ratio": 1.5,
        "moe/min_load_ratio": 0.0,
        "moe/unused_expert_fraction": 1 / 8,
        "moe/tokens_per_expert_max": 8.0,
        "moe/tokens_per_expert_min": 0.0,
        "moe/max_ep_rank_load_ratio": 1.0,
        "moe/layer_1/max_load_ratio": 1.0,
        "moe/layer_3/max_load_ratio": 2.0,
    }
    # A step without tokens is balanced.
    assert load_metrics(torch.zeros(1, 4), moe_layers=(0,))["moe/max_load_ratio"] == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallel": {"ep": 2}}, r"parallel\.ep 2 must divide the world size 1"),
        ({"parallel": {"cp": 2}}, r"parallel\.cp 2 must divide the world size 1"),
        ({"model": {"ep_comm_backend": "deepep"}}, r"model\.ep_comm_backend 'deepep' needs DeepEP"),
    ],
)
def test_the_runtime_refuses_what_cannot_run_naming_the_field(
    moe_dir: pathlib.Path, overrides: dict, message: str
) -> None:
    config = trainer_config(moe_dir, **{key: {**value} for key, value in overrides.items()})
    with pytest.raises(ValueError, match=message):
        build_runtime(config)
    assert not dist.is_initialized()


def test_config_refuses_degrees_below_one() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ep"):
        load_config(TrainerConfig, ["--model.path", "m", "--parallel.ep", "0"])


def test_a_dense_model_refuses_expert_parallel(dense_dir: pathlib.Path) -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims(world_size=2, ep=2)
        dims.build_mesh("cpu")
        model = load_tiny_model(dense_dir)
        with pytest.raises(ValueError, match=r"parallel\.ep 2 needs a mixture-of-experts model"):
            model_spec_of(model).parallelize_fn(model, dp_mesh=dims.mesh("dp_shard_cp"), ep_mesh=dims.mesh("ep"))
    finally:
        dist.destroy_process_group()
