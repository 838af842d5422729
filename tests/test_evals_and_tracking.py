"""Evaluations and experiment tracking in a real run: `primerl up` on the tiny dense model for a
few steps with an eval every 2 policy versions and both trackers on. The eval results show in
metrics.jsonl, in the W&B offline run (read back with wandb's own reader) and in the TensorBoard
event file (tensorboard's EventAccumulator); `primerl samples` shows a step of that run, and
`primerl eval` plays the same eval on the model folder alone."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

CACHE = pathlib.Path(os.environ.get("PRIMERL_TEST_CACHE", pathlib.Path(tempfile.gettempdir()) / "primerl-test-cache"))
MAX_STEPS = 5

LAUNCH_FILE = f"""
[launcher]
model = "tiny-dense"
cache_dir = "{CACHE / "launcher"}"
poll_interval_s = 0.5
start_timeout_s = 240
check_config = false

[orchestrator.model]
max_model_len = 256
[orchestrator.peers]
poll_interval_s = 0.2
[orchestrator.run]
max_steps = {MAX_STEPS}
batch_size = 8
max_async_level = 1
max_concurrent_episodes = 8
[orchestrator.advantage]
filter_zero_advantage = false
[[orchestrator.environments]]
name = "reverse_text"
kind = "reverse_text"
group_size = 4
[orchestrator.environments.sampling]
max_tokens = 12

[[orchestrator.evals]]
name = "reverse_heldout"
environment = "reverse_text"
num_tasks = 4
num_samples = 2
pass_threshold = 0.5
interval_steps = 2
[orchestrator.evals.sampling]
temperature = 0.7

[orchestrator.tracking]
num_sample_rows = 4
[orchestrator.tracking.wandb]
enabled = true
project = "primerl-ci"
[orchestrator.tracking.tensorboard]
enabled = true

[trainer]
device = "cpu"
seq_len = 1024
[trainer.model]
dtype = "float32"
compute_dtype = "float32"
[trainer.optimizer]
lr = 1e-4

[inference.engine]
dtype = "float32"
enforce_eager = true
max_model_len = 256
max_num_seqs = 16
kv_cache_gib = 1

[router.health]
interval_s = 0.5
[weight_broadcaster.push]
probe_interval_s = 0.5
"""


def primerl(*args: str, out: pathlib.Path, timeout_s: float) -> str:
    with out.open("w") as log:
        code = subprocess.run(
            [sys.executable, "-m", "primerl_launcher", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
            env={k: v for k, v in os.environ.items() if k != "WANDB_MODE"},
        ).returncode
    printed = out.read_text()
    assert code == 0, printed
    return printed


def test_evals_reach_metrics_wandb_and_tensorboard_and_samples_show_a_step(tmp_path):
    config, run_dir = tmp_path / "launch.toml", tmp_path / "run"
    config.write_text(LAUNCH_FILE)
    printed = primerl("up", "-c", str(config), "--run-dir", str(run_dir), out=tmp_path / "up.out", timeout_s=400)
    assert "not a clean exit" not in printed, printed

    # metrics.jsonl: each step's orchestrator record carries the evals finished since the step before.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    evals = {
        result["policy_version"]: result
        for record in records
        for name, result in record["orchestrator"]["evals"].items()
        if name == "reverse_heldout"
    }
    assert {0, 2} <= set(evals), evals
    for version, result in evals.items():
        assert version % 2 == 0 and (result["num_tasks"], result["num_samples"]) == (4, 2)
        assert 0 <= result["reward_mean"] <= 1 and 0 <= result["pass@1"] <= result["pass@2"] <= 1
        assert result["min_token_version"] >= version and result["num_errors"] == 0
    # Every finished eval, also the one after the last step's line.
    lines = [json.loads(line) for line in (run_dir / "orchestrator" / "evals.jsonl").read_text().splitlines()]
    assert {0, 2} <= {line["policy_version"] for line in lines}

    # W&B offline run, read back with wandb's reader.
    [wandb_run] = (run_dir / "orchestrator" / "wandb").glob("offline-run-*")
    [log] = wandb_run.glob("run-*.wandb")
    wandb_binary = pathlib.Path(sys.executable).parent / "wandb"
    inspected = subprocess.run(
        [str(wandb_binary), "leet", "inspect", str(log), "--json"], capture_output=True, text=True, check=True
    )
    wandb_records = [json.loads(line) for line in inspected.stdout.splitlines() if line.strip()]
    rows = [r["history"]["item"] for r in wandb_records if r["type"] == "history"]
    logged_evals = {
        r["policy_version"]: r["eval/reverse_heldout/pass@1"] for r in rows if "eval/reverse_heldout/pass@1" in r
    }
    assert {v: evals[v]["pass@1"] for v in (0, 2)} == {v: logged_evals[v] for v in (0, 2)}
    steps = sorted(r["step"] for r in rows if "orchestrator/batch_reward_mean" in r)
    assert steps == list(range(1, MAX_STEPS + 1))
    assert any("trainer/loss" in r for r in rows)
    assert any(r.get("samples/rollouts.nrows") == 4 for r in rows)
    [run] = [r["run"] for r in wandb_records if r["type"] == "run"]
    assert run["config"]["update"]["orchestrator"]["evals"][0]["interval_steps"] == 2
    assert "[optimizer]\nlr = 0.0001" in run["config"]["update"]["trainer"]

    # TensorBoard event file.
    events = EventAccumulator(str(run_dir / "orchestrator" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tb_evals = {e.step: e.value for e in events.Scalars("eval/reverse_heldout/reward_mean")}
    assert {0, 2} <= set(tb_evals) and tb_evals[2] == pytest.approx(evals[2]["reward_mean"])
    assert [e.step for e in events.Scalars("orchestrator/batch_reward_mean")] == list(range(1, MAX_STEPS + 1))

    # primerl samples: step 2's rollouts, as text and as a page.
    shown = primerl("samples", str(run_dir), "--step", "2", out=tmp_path / "samples.out", timeout_s=60)
    step_two = next(r for r in records if r["step"] == 2)
    assert f"step 2: {step_two['orchestrator']['num_samples']} samples" in shown, shown
    assert re.search(r"#0 reverse_text  reward \d\.\d{3}  advantage [+-]\d\.\d{3}  policy version \d", shown), shown
    page = tmp_path / "step2.html"
    primerl("samples", str(run_dir), "--step", "2", "--html", str(page), out=tmp_path / "html.out", timeout_s=60)
    assert page.read_text().count("<tr class=") == step_two["orchestrator"]["num_samples"]

    # primerl eval: the same eval on the model folder alone (inference + router, no trainer).
    model = re.search(r"^model: (.+)$", printed, re.MULTILINE).group(1)
    table = primerl(
        "eval", model, "-c", str(config), "--run-dir", str(tmp_path / "eval"), out=tmp_path / "eval.out", timeout_s=300
    )
    [result] = json.loads((tmp_path / "eval" / "evals.json").read_text())["evals"]
    assert result["name"] == "reverse_heldout" and result["policy_version"] == 0 and result["num_errors"] == 0
    assert len(result["samples"]) == 4 and {"prompt", "completion", "reward"} <= set(result["samples"][0])
    assert re.search(r"^reverse_heldout\s+reverse_text\s+4 x 2\s+\d\.\d{3}", table, re.MULTILINE), table
