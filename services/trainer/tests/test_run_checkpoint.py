"""Per-run checkpoints: runs restored into a new model continue exactly as the uninterrupted ones
(also under FSDP2); a damaged latest checkpoint falls back; pruning; the runs' metadata; deletion."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from primerl_common.errors import InvalidArgument, NotFound
from primerl_trainer.batch import MicroBatch
from primerl_trainer.checkpoint import LATEST_FILE
from primerl_trainer.config import LoRAConfig
from primerl_trainer.lora import apply_lora
from primerl_trainer.models import model_spec_of
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig
from primerl_trainer.run_checkpoint import META_FILE, RunCheckpoints
from primerl_trainer.runs import RunConfig, RunSet

from .tiny_training import batch_spec, load_tiny_model, make_samples, pack_into

CPU = torch.device("cpu")
NUM_STEPS = 4
# Two runs of different ranks, optimizers and schedules (a warmup and a decay: the schedule's state matters).
_COSINE = LRScheduleConfig(decay="cosine", warmup_steps=1, total_steps=NUM_STEPS, min_lr_ratio=0.1)
CONFIGS = {
    "run-a": RunConfig(rank=2, alpha=4.0, seed=1, optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.1)),
    "run-b": RunConfig(
        rank=4, alpha=16.0, seed=2, optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=0.05), schedule=_COSINE
    ),
}
# DCP says so when it saves or loads in a process that is not part of a process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def batches(dense_dir: pathlib.Path) -> dict[str, list[list[MicroBatch]]]:
    model = load_tiny_model(dense_dir)
    with torch.no_grad():
        return {
            run_id: [
                pack_into(make_samples(model, seed=10 * index + step, num_samples=2), 2) for step in range(NUM_STEPS)
            ]
            for index, run_id in enumerate(CONFIGS)
        }


def _lora_model(dense_dir: pathlib.Path) -> torch.nn.Module:
    model = load_tiny_model(dense_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=8, alpha=1.0, target_modules=["q", "v", "up", "down"]))
    return model


def _run_set(model: torch.nn.Module, run_ids: list[str]) -> RunSet:
    runs = RunSet(model, spec=batch_spec(model), device=CPU)
    for run_id in run_ids:
        runs.add_run(run_id, CONFIGS[run_id])
    return runs


def _train(runs: RunSet, batches, steps: range) -> dict[str, list[float]]:
    return {
        run_id: [runs.train_step(run_id, batches[run_id][step])["loss"] for step in steps] for run_id in runs.run_ids
    }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _assert_same_state(got: dict, wanted: dict) -> None:
    """Two runs' `RunSet.state_dict`s hold equal values, bit for bit."""
    assert (got["step"], got["rank"], got["alpha"]) == (wanted["step"], wanted["rank"], wanted["alpha"])
    assert got["lr_scheduler"] == wanted["lr_scheduler"]
    assert got["optimizer"]["param_groups"] == wanted["optimizer"]["param_groups"]
    for name, tensor in wanted["adapter"].items():
        assert torch.equal(_full(got["adapter"][name]), _full(tensor)), name
    assert got["optimizer"]["state"].keys() == wanted["optimizer"]["state"].keys()
    for index, entries in wanted["optimizer"]["state"].items():
        assert got["optimizer"]["state"][index].keys() == entries.keys()
        for key, tensor in entries.items():
            assert torch.equal(_full(got["optimizer"]["state"][index][key]), _full(tensor)), (index, key)


def test_restored_runs_continue_as_the_uninterrupted_ones(
    dense_dir: pathlib.Path, tmp_path: pathlib.Path, batches
) -> None:
    uninterrupted = _run_set(_lora_model(dense_dir), list(CONFIGS))
    wanted = _train(uninterrupted, batches, range(NUM_STEPS))

    half = NUM_STEPS // 2
    first = _run_set(_lora_model(dense_dir), list(CONFIGS))
    _train(first, batches, range(half))
    checkpoints = RunCheckpoints(tmp_path / "runs")
    for run_id in CONFIGS:
        assert checkpoints.save(run_id, first.state_dict(run_id)) == tmp_path / "runs" / run_id / "step_00000002"
    del first

    # Another process: a fresh model, the runs added in another order, then their checkpoints.
    second = _run_set(_lora_model(dense_dir), list(reversed(CONFIGS)))
    for run_id in reversed(CONFIGS):
        assert RunCheckpoints(tmp_path / "runs").load_latest(run_id, second) == half
        assert second.step_of(run_id) == half
    got = _train(second, batches, range(half, NUM_STEPS))
    for run_id in CONFIGS:
        assert got[run_id] == wanted[run_id][half:], run_id
        _assert_same_state(second.state_dict(run_id), uninterrupted.state_dict(run_id))


def test_runs_on_an_fsdp2_sharded_model_restore_shard_by_shard(
    dense_dir: pathlib.Path, tmp_path: pathlib.Path, batches
) -> None:
    """One CPU rank under FSDP2: the adapters and moments are DTensors, saved and loaded as such."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:

        def sharded_run_set() -> RunSet:
            model = _lora_model(dense_dir)
            model_spec_of(model).parallelize_fn(model, dp_mesh=init_device_mesh("cpu", (1,)), param_dtype=None)
            return _run_set(model, list(CONFIGS))

        first = sharded_run_set()
        _train(first, batches, range(2))
        checkpoints = RunCheckpoints(tmp_path)
        for run_id in CONFIGS:
            checkpoints.save(run_id, first.state_dict(run_id))
        second = sharded_run_set()
        for run_id in CONFIGS:
            assert checkpoints.load_latest(run_id, second) == 2
            state = second.state_dict(run_id)
            assert all(isinstance(t, DTensor) for t in state["adapter"].values())
            assert all(isinstance(s["exp_avg"], DTensor) for s in state["optimizer"]["state"].values())
            _assert_same_state(state, first.state_dict(run_id))
        assert _train(second, batches, range(2, 3)) == _train(first, batches, range(2, 3))
    finally:
        dist.destroy_process_group()


def _cut_shard(step: pathlib.Path) -> None:
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    dense_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, batches
) -> None:
    runs = _run_set(_lora_model(dense_dir), ["run-a"])
    checkpoints = RunCheckpoints(tmp_path)
    _train(runs, batches, range(1))
    checkpoints.save("run-a", runs.state_dict("run-a"))
    at_1 = _saved_copy(runs.state_dict("run-a"))
    _train(runs, batches, range(1, 2))
    checkpoints.save("run-a", runs.state_dict("run-a"))
    _cut_shard(tmp_path / "run-a" / "step_00000002")

    restored = _run_set(_lora_model(dense_dir), ["run-a"])
    with caplog.at_level("WARNING", logger="primerl_trainer.checkpoint"):
        assert checkpoints.load_latest("run-a", restored) == 1
    assert "resuming from step_00000001, the newest complete checkpoint: step_00000002 has" in caplog.text
    _assert_same_state(restored.state_dict("run-a"), at_1)
    # Its next save of step 2 replaces the damaged one.
    _train(restored, batches, range(1, 2))
    checkpoints.save("run-a", restored.state_dict("run-a"))
    assert checkpoints.load_latest("run-a", _run_set(_lora_model(dense_dir), ["run-a"])) == 2


def _saved_copy(state: dict) -> dict:
    """A run's state as it is now (state_dict's tensors are the live ones)."""
    return {
        **state,
        "adapter": {name: t.clone() for name, t in state["adapter"].items()},
        "optimizer": {
            "param_groups": state["optimizer"]["param_groups"],
            "state": {i: {k: t.clone() for k, t in s.items()} for i, s in state["optimizer"]["state"].items()},
        },
    }


def test_keep_last_prunes_each_runs_old_checkpoints(dense_dir: pathlib.Path, tmp_path: pathlib.Path, batches) -> None:
    runs = _run_set(_lora_model(dense_dir), list(CONFIGS))
    checkpoints = RunCheckpoints(tmp_path, keep_last=2)
    checkpoints.save_meta("run-a", {"owner": "alice"})
    for step in range(3):
        runs.train_step("run-a", batches["run-a"][step])
        checkpoints.save("run-a", runs.state_dict("run-a"))
    runs.train_step("run-b", batches["run-b"][0])
    checkpoints.save("run-b", runs.state_dict("run-b"))
    assert sorted(p.name for p in (tmp_path / "run-a").iterdir()) == [
        LATEST_FILE,
        META_FILE,
        "step_00000002",
        "step_00000003",
    ]
    assert (tmp_path / "run-a" / LATEST_FILE).read_text() == "step_00000003\n"
    assert sorted(p.name for p in (tmp_path / "run-b").iterdir()) == [LATEST_FILE, "step_00000001"]
    # The latest step saved again is a no-op.
    assert checkpoints.save("run-a", runs.state_dict("run-a")) == tmp_path / "run-a" / "step_00000003"


def test_saved_runs_lists_each_runs_metadata_and_delete_removes_a_run(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints = RunCheckpoints(tmp_path / "runs")
    assert checkpoints.saved_runs() == {}
    metas = {
        "run-a": {"owner": "alice", "settings": {"rank": 2, "lr": 1e-3}, "created_at": 1.5},
        "run-b": {"owner": "bob", "settings": {}, "created_at": 2.0},
        "run-c": {"owner": "carol"},
    }
    for run_id, meta in metas.items():
        checkpoints.save_meta(run_id, meta)
    checkpoints.save_meta("run-b", metas["run-b"] | {"owner": "bob2"})  # replaced
    (tmp_path / "runs" / "run-c" / META_FILE).write_text('{"owner": "ca')  # cut short
    (tmp_path / "runs" / "run-d").mkdir()  # no run.json
    (tmp_path / "runs" / "notes.txt").write_text("not a run")
    with caplog.at_level("WARNING", logger="primerl_trainer.run_checkpoint"):
        assert checkpoints.saved_runs() == {"run-a": metas["run-a"], "run-b": metas["run-b"] | {"owner": "bob2"}}
    assert f"{tmp_path / 'runs' / 'run-c' / META_FILE} does not load" in caplog.text
    assert f"run folder {tmp_path / 'runs' / 'run-d'} has no {META_FILE}" in caplog.text
    assert json.loads((tmp_path / "runs" / "run-a" / META_FILE).read_text()) == metas["run-a"]

    checkpoints.delete("run-a")
    checkpoints.delete("run-e")  # none: nothing to do
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["notes.txt", "run-b", "run-c", "run-d"]
    assert list(checkpoints.saved_runs()) == ["run-b"]
    # A deletion that crashed after hiding the run's folder is finished by the next one.
    (tmp_path / "runs" / ".run-b.deleted").mkdir()
    checkpoints.delete("run-b")
    assert list(checkpoints.saved_runs()) == []
    assert not (tmp_path / "runs" / ".run-b.deleted").exists()


def test_errors(dense_dir: pathlib.Path, tmp_path: pathlib.Path, batches) -> None:
    runs = _run_set(_lora_model(dense_dir), ["run-a"])
    checkpoints = RunCheckpoints(tmp_path)
    with pytest.raises(ValueError, match="before the optimizer's first update"):
        checkpoints.save("run-a", runs.state_dict("run-a"))
    before = _saved_copy(runs.state_dict("run-a"))
    assert checkpoints.load_latest("run-a", runs) is None
    _assert_same_state(runs.state_dict("run-a"), before)
    for bad in ("", "../up", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="run id"):
            checkpoints.save_meta(bad, {})
    with pytest.raises(ValueError, match="keep_last"):
        RunCheckpoints(tmp_path, keep_last=0)
    with pytest.raises(NotFound):
        checkpoints.load_latest("run-b", runs)

    # A checkpoint of another rank is refused by the run, not passed over.
    _train(runs, batches, range(1))
    checkpoints.save("run-a", runs.state_dict("run-a"))
    other = RunSet(runs.model, spec=runs.spec, device=CPU)
    other.add_run("run-a", dataclasses.replace(CONFIGS["run-a"], rank=3))
    with pytest.raises(InvalidArgument, match="rank 2"):
        checkpoints.load_latest("run-a", other)
    # Without any complete checkpoint left while `latest` names one: an error, not a fresh start.
    _cut_shard(tmp_path / "run-a" / "step_00000001")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoints.load_latest("run-a", runs)
