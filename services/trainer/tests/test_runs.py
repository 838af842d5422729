"""Multi-tenant LoRA: runs of different ranks, seeds, schedules and tasks trained interleaved on one
model each equal the same run trained alone; one run's bad batch or failure leaves the others and
the backbone alone; a run's state round-trips through its checkpoint."""

from __future__ import annotations

import dataclasses
import io
import math
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from primerl_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from primerl_trainer.batch import MicroBatch
from primerl_trainer.config import LoRAConfig
from primerl_trainer.export import exported_tensors
from primerl_trainer.lora import apply_lora, lora_parametrizations
from primerl_trainer.models import model_spec_of
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.runs import RunConfig, RunSet
from primerl_trainer.train import Trainer

from .tiny_training import LORA_TARGETS as TARGETS
from .tiny_training import batch_spec, load_tiny_model, make_samples, pack_into, runs_batches, train_lora_alone

CPU = torch.device("cpu")
MAX_RANK = 8
NUM_STEPS = 10
ATOL = 1e-5
CONFIGS = {
    "a": RunConfig(
        rank=2,
        alpha=4.0,
        seed=1,
        optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.1),
        schedule=LRScheduleConfig(warmup_steps=3),
    ),
    "b": RunConfig(
        rank=4,
        alpha=16.0,
        seed=2,
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=0.05),
        schedule=LRScheduleConfig(decay="cosine", warmup_steps=1, total_steps=NUM_STEPS, min_lr_ratio=0.1),
    ),
    # Another task: supervised fine-tuning.
    "c": RunConfig(rank=8, alpha=8.0, seed=3, optimizer=OptimizerConfig(lr=3e-3), mode="sft"),
}


@pytest.fixture(scope="module")
def batches(dense_dir: pathlib.Path) -> dict[str, list[list[MicroBatch]]]:
    """Each run's own batches (its own task's data)."""
    return runs_batches(dense_dir, {run_id: config.mode for run_id, config in CONFIGS.items()}, num_steps=NUM_STEPS)


@pytest.fixture(scope="module")
def solo(dense_dir: pathlib.Path, batches: dict[str, list[list[MicroBatch]]]):
    """Each run's losses and final adapter, trained alone on a fresh model."""
    return {run_id: train_lora_alone(dense_dir, config, batches[run_id]) for run_id, config in CONFIGS.items()}


def _run_set(dense_dir: pathlib.Path) -> RunSet:
    model = load_tiny_model(dense_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=MAX_RANK, alpha=1.0, target_modules=TARGETS))
    runs = RunSet(model, spec=batch_spec(model), device=CPU)
    for run_id, config in CONFIGS.items():
        runs.add_run(run_id, config)
    return runs


def _assert_matches_solo(runs: RunSet, run_id: str, losses: list[float], solo) -> None:
    solo_losses, solo_adapter = solo[run_id]
    assert losses == pytest.approx(solo_losses, rel=0, abs=ATOL), run_id
    adapter = runs.adapter_tensors(run_id)
    assert adapter.keys() == solo_adapter.keys()
    for name, tensor in adapter.items():
        assert tensor.shape == solo_adapter[name].shape, name
        torch.testing.assert_close(tensor, solo_adapter[name], rtol=0, atol=ATOL, msg=f"{run_id} {name}")


def _backbone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}


def test_interleaved_runs_equal_each_run_trained_alone(dense_dir: pathlib.Path, batches, solo) -> None:
    runs = _run_set(dense_dir)
    backbone = _backbone(runs.model)
    losses = {run_id: [] for run_id in CONFIGS}
    switch_s = []
    for step in range(NUM_STEPS):
        # Another order every step: c a b, a b c, b c a, ...
        order = list(CONFIGS)[step % 3 :] + list(CONFIGS)[: step % 3]
        for run_id in reversed(order) if step % 2 else order:
            metrics = runs.train_step(run_id, batches[run_id][step])
            losses[run_id].append(metrics["loss"])
            switch_s.append(metrics["run_switch_s"])
            assert metrics["update_skipped"] == 0
    for run_id in CONFIGS:
        assert runs.step_of(run_id) == NUM_STEPS
        _assert_matches_solo(runs, run_id, losses[run_id], solo)
    assert max(switch_s) < 0.5
    for name, tensor in _backbone(runs.model).items():
        assert torch.equal(tensor, backbone[name]), name

    # Past each run's rank its adapter and AdamW moments (weight decay included) stayed exactly zero.
    trained = [name for name, p in runs.model.named_parameters() if p.requires_grad]
    for run_id, config in CONFIGS.items():
        state = runs.state_dict(run_id)
        moments = state["optimizer"]["state"]
        assert len(moments) == len(trained)
        for index, name in enumerate(trained):
            for tensor in (state["adapter"][name], moments[index]["exp_avg"], moments[index]["exp_avg_sq"]):
                padding = tensor[config.rank :] if name.endswith("lora_A") else tensor[:, config.rank :]
                assert padding.numel() == 0 or torch.count_nonzero(padding) == 0, (run_id, name)
    # Every run has its own moments.
    moment_storages = {runs.state_dict(run_id)["optimizer"]["state"][0]["exp_avg"].data_ptr() for run_id in CONFIGS}
    assert len(moment_storages) == len(CONFIGS)


# A step without an update steps the schedule before the optimizer ever has: torch warns.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_one_runs_failures_leave_the_others_alone(dense_dir: pathlib.Path, batches, solo) -> None:
    runs = _run_set(dense_dir)
    backbone = _backbone(runs.model)
    losses = {run_id: [] for run_id in CONFIGS}

    def step(run_id: str, index: int) -> None:
        losses[run_id].append(runs.train_step(run_id, batches[run_id][index])["loss"])

    for index in range(NUM_STEPS):
        for run_id in ("a", "b", "c"):
            if run_id == "b" and index == 4:
                # NaN advantages: the batch is refused before any work, the run is as before.
                good = batches["b"][index]
                advantages = good[1].advantages.clone()
                advantages[-1] = float("nan")
                before = runs.adapter_tensors("b")
                with pytest.raises(InvalidArgument) as excinfo:
                    runs.train_step("b", [good[0], dataclasses.replace(good[1], advantages=advantages)])
                assert excinfo.value.field == "micro_batch.advantages"
                assert runs.step_of("b") == index and runs.failure_of("b") is None
                for name, tensor in runs.adapter_tensors("b").items():
                    assert torch.equal(tensor, before[name]), name
            if run_id == "c" and index == 6:
                # An error in the forward: the run is as before the step, and takes the batch again.
                handle = runs.model.layers["0"].register_forward_hook(_raise)
                with pytest.raises(RuntimeError, match="boom"):
                    step("c", index)
                handle.remove()
                assert runs.failure_of("c") is None and runs.step_of("c") == index
            step(run_id, index)
    for run_id in CONFIGS:
        _assert_matches_solo(runs, run_id, losses[run_id], solo)

    # A NaN gradient skips that run's update only, as for a single run.
    saved = _saved(runs, "a")
    nan_hook = next(p for p in runs.model.parameters() if p.requires_grad).register_hook(lambda g: g * math.nan)
    metrics = runs.train_step("a", batches["a"][0])
    nan_hook.remove()
    assert metrics["update_skipped"] == 1 and math.isnan(metrics["grad_norm"])
    assert runs.step_of("a") == NUM_STEPS + 1
    after = runs.state_dict("a")
    for name, tensor in saved["adapter"].items():
        assert torch.equal(after["adapter"][name], tensor), name
    for index, moments in saved["optimizer"]["state"].items():
        assert torch.equal(after["optimizer"]["state"][index]["exp_avg"], moments["exp_avg"])

    # An error once the update began fails the run alone, until its checkpoint is loaded.
    saved = _saved(runs, "b")
    failing = runs._runs["b"].optimizer.register_step_post_hook(_raise)
    with pytest.raises(RuntimeError, match="boom"):
        runs.train_step("b", batches["b"][0])
    assert "boom" in runs.failure_of("b")
    with pytest.raises(FailedPrecondition):
        runs.train_step("b", batches["b"][0])
    assert runs.train_step("c", batches["c"][0])["update_skipped"] == 0
    failing.remove()
    runs.load_state_dict("b", saved)
    assert runs.failure_of("b") is None and runs.step_of("b") == NUM_STEPS
    assert runs.train_step("b", batches["b"][0])["update_skipped"] == 0

    for name, tensor in _backbone(runs.model).items():
        assert torch.equal(tensor, backbone[name]), name


def _raise(*_: object) -> None:
    raise RuntimeError("boom")


def _saved(runs: RunSet, run_id: str) -> dict:
    """A run's state as a checkpoint holds it: written out and read back."""
    buffer = io.BytesIO()
    torch.save(runs.state_dict(run_id), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_runs_state_round_trips_and_continues_identically(dense_dir: pathlib.Path, batches, solo) -> None:
    half = NUM_STEPS // 2
    first = _run_set(dense_dir)
    losses = {run_id: [] for run_id in CONFIGS}
    for index in range(half):
        for run_id in CONFIGS:
            losses[run_id].append(first.train_step(run_id, batches[run_id][index])["loss"])
    states = {run_id: _saved(first, run_id) for run_id in CONFIGS}
    del first

    # Another process's model, its runs added in another order.
    second = _run_set(dense_dir)
    for run_id in reversed(CONFIGS):
        second.load_state_dict(run_id, states[run_id])
        assert second.step_of(run_id) == half
    for index in range(half, NUM_STEPS):
        for run_id in CONFIGS:
            losses[run_id].append(second.train_step(run_id, batches[run_id][index])["loss"])
    for run_id in CONFIGS:
        _assert_matches_solo(second, run_id, losses[run_id], solo)

    # A state fits only a run of its rank and alpha.
    second.add_run("d", dataclasses.replace(CONFIGS["a"], rank=3))
    with pytest.raises(InvalidArgument, match="rank 2"):
        second.load_state_dict("d", states["a"])


def test_a_runs_adapter_exports_at_its_own_rank(dense_dir: pathlib.Path, batches) -> None:
    runs = _run_set(dense_dir)
    runs.train_step("a", batches["a"][0])
    adapter = dict(
        exported_tensors(
            runs.model,
            iter(runs.adapter_tensors("a").items()),
            kind="adapter",
            dtype=torch.bfloat16,
            lora_scale=CONFIGS["a"].scale,
        )
    )
    attention = "base_model.model.model.layers.0.self_attn"
    q_a, q_b = adapter[f"{attention}.q_proj.lora_A.weight"], adapter[f"{attention}.q_proj.lora_B.weight"]
    assert q_a.shape[0] == 2 and q_b.shape[1] == 2 and q_b.abs().sum() > 0
    assert len(adapter) == 2 * len(lora_parametrizations(runs.model))


def test_run_set_contract(dense_dir: pathlib.Path) -> None:
    runs = _run_set(dense_dir)
    assert runs.max_rank == MAX_RANK and runs.run_ids == list(CONFIGS)
    with pytest.raises(AlreadyExists):
        runs.add_run("a", CONFIGS["a"])
    with pytest.raises(InvalidArgument, match="rank"):
        runs.add_run("e", RunConfig(rank=MAX_RANK + 1, alpha=1.0))
    runs.remove_run("a")
    with pytest.raises(NotFound):
        runs.train_step("a", [])
    assert runs.run_ids == ["b", "c"]
    # The backbone must be frozen: a trainable weight would be shared between the runs.
    model = load_tiny_model(dense_dir)
    with pytest.raises(ValueError, match="no LoRA modules"):
        RunSet(model, spec=batch_spec(model), device=CPU)
    apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=1.0, target_modules=TARGETS))
    model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"norm\.weight"):
        RunSet(model, spec=batch_spec(model), device=CPU)


def test_expert_adapters_of_two_runs_equal_each_alone(moe_dir: pathlib.Path) -> None:
    """The padding holds for the experts' stacked A [E, rank, in] and B [E, out, rank] too.

    Without clipping: the norm it clips by is reduced over the padded gradients, which rounds
    differently in the last bit, and the routers' top-k turns such a difference into a whole
    expert's gradient on a token whose scores nearly tie. Unclipped, the steps are the same."""
    targets = ["q", "experts"]
    unclipped = {"max_grad_norm": 1e9}
    configs = {
        "x": RunConfig(rank=2, alpha=4.0, seed=5, optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.1, **unclipped)),
        "y": RunConfig(rank=3, alpha=3.0, seed=6, optimizer=OptimizerConfig(lr=1e-3, **unclipped)),
    }
    model = load_tiny_model(moe_dir)
    with torch.no_grad():
        data = {
            run_id: [pack_into(make_samples(model, seed=10 * i + s, num_samples=2), 1) for s in range(3)]
            for i, run_id in enumerate(configs)
        }
    apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=1.0, target_modules=targets))
    runs = RunSet(model, spec=batch_spec(model), device=CPU)
    losses = {run_id: [] for run_id in configs}
    for run_id, config in configs.items():
        runs.add_run(run_id, config)
    for index in range(3):
        for run_id in configs:
            losses[run_id].append(runs.train_step(run_id, data[run_id][index])["loss"])
    for run_id, config in configs.items():
        alone = load_tiny_model(moe_dir)
        lora = LoRAConfig(enabled=True, rank=config.rank, alpha=config.alpha, target_modules=targets)
        apply_lora(alone, lora, seed=config.seed)
        optimizer = build_optimizer(alone, config.optimizer)
        trainer = Trainer(
            alone,
            optimizer,
            build_lr_scheduler(optimizer, config.schedule),
            spec=batch_spec(alone),
            device=CPU,
            max_grad_norm=config.optimizer.max_grad_norm,
        )
        solo_losses = [trainer.train_step(batch)["loss"] for batch in data[run_id]]
        assert losses[run_id] == pytest.approx(solo_losses, rel=0, abs=ATOL)
        adapter = runs.adapter_tensors(run_id)
        assert any(name.endswith("experts.parametrizations.w13.0.gate_lora_A") for name in adapter)
        for name, param in alone.named_parameters():
            if param.requires_grad:
                torch.testing.assert_close(adapter[name], param.detach(), rtol=0, atol=ATOL, msg=name)


def test_runs_on_an_fsdp2_sharded_model(dense_dir: pathlib.Path, batches) -> None:
    """One CPU rank under FSDP2, as the trainer runs alone: the LoRA parameters are DTensors, and
    a run's tensors are copied shard to shard."""
    num_steps = 3
    model = load_tiny_model(dense_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=MAX_RANK, alpha=1.0, target_modules=TARGETS))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model_spec_of(model).parallelize_fn(model, dp_mesh=init_device_mesh("cpu", (1,)), param_dtype=None)
        runs = RunSet(model, spec=batch_spec(model), device=CPU)
        assert all(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad)
        losses = {run_id: [] for run_id in ("a", "b")}
        for run_id in losses:
            runs.add_run(run_id, CONFIGS[run_id])
        for index in range(num_steps):
            for run_id in losses:
                losses[run_id].append(runs.train_step(run_id, batches[run_id][index])["loss"])
        saved = {run_id: _saved(runs, run_id) for run_id in losses}
        runs.train_step("a", batches["a"][num_steps])
        runs.load_state_dict("a", saved["a"])
        for run_id in losses:
            solo_losses, solo_adapter = train_lora_alone(dense_dir, CONFIGS[run_id], batches[run_id][:num_steps])
            assert losses[run_id] == pytest.approx(solo_losses, rel=0, abs=ATOL), run_id
            for name, tensor in runs.adapter_tensors(run_id).items():
                torch.testing.assert_close(tensor, solo_adapter[name], rtol=0, atol=ATOL, msg=name)
    finally:
        dist.destroy_process_group()
