"""The trackers write what a run logs, read back with each tool's own reader: the W&B offline
run's .wandb log through `wandb leet inspect --json`, the TensorBoard event file through
tensorboard's EventAccumulator."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.evals import EvalResult, SampleRecord
from primerl_orchestrator.tracking import SAMPLE_COLUMNS, Tracker, flatten


def wandb_records(run_dir: pathlib.Path) -> list[dict]:
    """The records of an offline run, as wandb's own reader gives them."""
    [log] = run_dir.glob("run-*.wandb")
    binary = shutil.which("wandb", path=str(pathlib.Path(sys.executable).parent))
    assert binary, "wandb is not installed (the orchestrator's tracking extra)"
    out = subprocess.run([binary, "leet", "inspect", str(log), "--json"], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def tensorboard_events(log_dir: pathlib.Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def eval_result(version: int, reward: float) -> EvalResult:
    sample = SampleRecord(task_id="t-0", prompt="sort: cba", completion="abc", reward=reward, policy_version=version)
    return EvalResult(
        name="sorting",
        environment="sort_letters",
        policy_version=version,
        min_token_version=version,
        max_token_version=version,
        num_tasks=4,
        num_samples=2,
        reward_mean=reward,
        reward_std=0.1,
        pass_at={1: reward, 2: min(1.0, 2 * reward)},
        num_errors=0,
        duration_s=1.5,
        samples=[sample],
    )


def test_flatten_keeps_finite_numbers_under_joined_keys():
    record = {"a": 1, "b": {"c": 2.5, "d": float("nan"), "e": "text", "f": True}, "g": [1, 2]}
    assert flatten(record, "x/") == {"x/a": 1.0, "x/b/c": 2.5, "x/b/f": 1.0}


def test_tracking_off_writes_nothing(tmp_path):
    save_tokenizer(tmp_path)
    config = OrchestratorConfig(
        model={"path": tmp_path}, environments=[{"name": "e"}], output={"metrics_jsonl": tmp_path / "m.jsonl"}
    )
    tracker = Tracker(config)
    assert not tracker.enabled and not tracker.wants_samples(1)
    tracker.log_step(1, {"reward": 1.0})
    tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []


def test_metrics_evals_samples_and_config_reach_wandb_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for variable in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(variable, raising=False)  # the tracker's defaults, beside the run
    (tmp_path / "model").mkdir()
    save_tokenizer(tmp_path / "model")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "trainer.toml").write_text("[optimizer]\nlr = 0.001\n")
    # Another run's orchestrator on the same deployment ([[runs]]): another tenant's, not logged here.
    (tmp_path / "config" / "orchestrator-other-run.toml").write_text("[peers]\nrun_id = 'other-run'\n")
    config = OrchestratorConfig(
        model={"path": tmp_path / "model"},
        environments=[{"name": "reverse", "kind": "reverse_text"}],
        output={"metrics_jsonl": tmp_path / "orchestrator" / "metrics.jsonl"},
        tracking={
            "wandb": {"enabled": True, "project": "primerl-test", "name": "tracking-test"},
            "tensorboard": {"enabled": True},
            "num_sample_rows": 2,
            "sample_interval_steps": 2,
            "config_dir": tmp_path / "config",
        },
    )
    tracker = Tracker(config)
    assert tracker.wandb is not None
    wandb_dir = tracker.wandb.run_dir
    row = {c: 0 for c in SAMPLE_COLUMNS} | {"environment": "reverse", "prompt": "p|q", "completion": "c\nd"}
    try:
        tracker.log_eval(eval_result(0, 0.25))
        for step in (1, 2, 3):
            tracker.log_step(
                step, {"step": step, "batch_reward_mean": step / 10, "environments": {"reverse": {"turns": 8}}}
            )
            tracker.log_trainer_step(step, {"loss": 1.0 / step, "mismatch_kl": 0.0})
            if tracker.wants_samples(step):
                tracker.log_samples(step, [row | {"step": step, "reward": 0.5}] * 3)
        tracker.log_eval(eval_result(2, 0.75))
    finally:
        tracker.close()

    # W&B: an offline run folder beside metrics.jsonl, read back with wandb's reader.
    assert wandb_dir.parent == tmp_path / "orchestrator" / "wandb" and wandb_dir.name.startswith("offline-run-")
    records = wandb_records(wandb_dir)
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "primerl-test" and run["display_name"] == "tracking-test"
    logged_config = run["config"]["update"]
    assert logged_config["orchestrator"]["environments"][0]["kind"] == "reverse_text"
    assert "lr = 0.001" in logged_config["trainer"]
    assert "orchestrator-other-run" not in logged_config
    rows = history(records)
    steps = {r["step"]: r for r in rows if "orchestrator/batch_reward_mean" in r}
    assert {s: r["orchestrator/batch_reward_mean"] for s, r in steps.items()} == {1: 0.1, 2: 0.2, 3: 0.3}
    assert steps[2]["orchestrator/environments/reverse/turns"] == 8
    assert [r["trainer/loss"] for r in rows if "trainer/loss" in r] == pytest.approx([1.0, 0.5, 1 / 3])
    evals = [
        (r["policy_version"], r["eval/sorting/reward_mean"], r["eval/sorting/pass@2"])
        for r in rows
        if "eval/sorting/reward_mean" in r
    ]
    assert evals == [(0, 0.25, 0.5), (2, 0.75, 1.0)]
    tables = [r for r in rows if "samples/rollouts._type" in r]
    assert [r["step"] for r in tables] == [2] and tables[0]["samples/rollouts.nrows"] == 2
    assert any("eval/sorting/samples._type" in r for r in rows)
    [table_file] = (wandb_dir / "files" / "media" / "table" / "samples").glob("rollouts_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and table["data"][0][3] == "p|q"

    # TensorBoard: scalars by step and policy version, config and samples as text.
    events = tensorboard_events(tmp_path / "orchestrator" / "tensorboard")
    scalars = events.Tags()["scalars"]
    rewards = events.Scalars("orchestrator/batch_reward_mean")
    assert [e.step for e in rewards] == [1, 2, 3] and [e.value for e in rewards] == pytest.approx([0.1, 0.2, 0.3])
    assert [(e.step, e.value) for e in events.Scalars("eval/sorting/pass@1")] == [(0, 0.25), (2, 0.75)]
    assert "trainer/mismatch_kl" in scalars
    texts = {tag.removesuffix("/text_summary") for tag in events.Tags()["tensors"]}
    assert {"config/orchestrator", "config/trainer", "samples/rollouts", "eval/sorting/samples"} <= texts
    [samples] = events.Tensors("samples/rollouts/text_summary")
    text = samples.tensor_proto.string_val[0].decode()
    assert samples.step == 2 and "p\\|q" in text and "c<br>d" in text
