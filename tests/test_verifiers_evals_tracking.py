"""One `primerl up` run of the tiny dense model covers the ecosystem: two verifiers environments
(a reasoning-gym task, single turn; a key-value store queried with a tool, multi-turn) trained on
with their rubrics' rewards and metrics, the spell environment's process killed mid-run and
restarted while the run goes on; an eval every 2 policy versions of a verifiers environment
(played by its process, its eval split) and of a built-in one; both trackers on. Then, on that
run's folder: the eval results in metrics.jsonl, the W&B offline run (read back with wandb's own
reader) and the TensorBoard event file (tensorboard's EventAccumulator); `primerl samples` on a
step; and `primerl eval` playing the same evals on the model folder alone."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import psutil
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.client import make_channel

from . import live_runs

pytestmark = pytest.mark.slow

EXAMPLES = "primerl_orchestrator.environments.verifiers_examples"
MAX_STEPS = 4


def launch_file(logs: pathlib.Path) -> str:
    return f"""
{live_runs.launcher_section("tiny-dense", inference_replicas=1)}check_config = false

{live_runs.orchestrator_head(max_model_len=1024, max_steps=MAX_STEPS, batch_size=4)}max_concurrent_episodes = 8
{live_runs.NO_ZERO_ADVANTAGE_FILTER}[[orchestrator.environments]]
name = "spell"
kind = "verifiers"
group_size = 2
[orchestrator.environments.sampling]
max_tokens = 12
[orchestrator.environments.options]
module = "{EXAMPLES}.reasoning_gym_task"
args = {{task = "spell_backward", num_examples = 200, num_eval_examples = 20}}
restart_backoff_s = 0.5
log_file = "{logs / "spell.log"}"
[[orchestrator.environments]]
name = "kv"
kind = "verifiers"
group_size = 2
[orchestrator.environments.sampling]
max_tokens = 24
[orchestrator.environments.options]
module = "{EXAMPLES}.key_value_store"
args = {{num_keys = 4, max_turns = 2}}
log_file = "{logs / "kv.log"}"

[[orchestrator.evals]]
name = "spell_heldout"
environment = "spell"
options = {{split = "eval"}}
num_tasks = 2
num_samples = 2
interval_steps = 2
[[orchestrator.evals]]
name = "reverse_heldout"
kind = "reverse_text"
num_tasks = 2
num_samples = 2
pass_threshold = 0.5
interval_steps = 2
[orchestrator.evals.sampling]
temperature = 0.7
max_tokens = 12

[orchestrator.tracking]
num_sample_rows = 4
[orchestrator.tracking.wandb]
enabled = true
project = "primerl-ci"
[orchestrator.tracking.tensorboard]
enabled = true

{live_runs.trainer_section(seq_len=2048)}
{live_runs.inference_engine(max_model_len=1024, max_num_seqs=16, kv_cache_gib=1)}
{live_runs.router_and_broadcaster(no_replica_wait_s=60.0)}"""


@dataclass(frozen=True)
class Run:
    root: pathlib.Path
    config: pathlib.Path
    run_dir: pathlib.Path
    printed: str
    # What the kill saw: the victim's pid, the restarted one's, the step then, spell's finished episodes.
    seen: dict


def text(path: pathlib.Path) -> str:
    return path.read_text() if path.is_file() else ""


def loaded(log: pathlib.Path) -> int:
    """How many times the environment's process loaded its environment (once per start)."""
    return text(log).count("rows of its train dataset")


def environment_process(launcher: subprocess.Popen[str], name: str) -> psutil.Process | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if f"--environment={name}" in child.cmdline():
                return child
        except psutil.Error:
            continue
    return None


async def kill_spell_mid_run(launcher, run_dir: pathlib.Path, logs: pathlib.Path, out: pathlib.Path) -> dict:
    """Once a step is done: pauses the run, kills the spell environment's process, resumes once
    it is back; returns what it saw."""
    seen: dict = {}
    metrics = run_dir / "orchestrator" / "metrics.jsonl"

    async def services() -> dict | None:
        return live_runs.read_services(run_dir)

    address = (
        await live_runs.until_while_running(services, launcher=launcher, out=out, timeout_s=300, what="services up")
    )["orchestrator"]["address"]
    async with make_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def spell_finished() -> int:
            status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
            return {env.name: env.num_episodes_finished for env in status.environments}["spell"]

        async def first_step() -> bool:
            return bool(text(metrics).strip()) and await spell_finished() > 0

        await live_runs.until_while_running(
            first_step, launcher=launcher, out=out, timeout_s=240, what="step 1 and spell episodes"
        )
        await stub.PauseRun(orchestrator_pb2.PauseRunRequest())
        victim = environment_process(launcher, "spell")
        assert victim is not None
        seen["victim"] = victim.pid
        victim.send_signal(signal.SIGKILL)

        async def back() -> bool:
            return loaded(logs / "spell.log") == 2

        await live_runs.until_while_running(
            back, launcher=launcher, out=out, timeout_s=120, what="spell's process restarted"
        )
        restarted = environment_process(launcher, "spell")
        seen["restarted"] = restarted.pid if restarted is not None else None
        seen["finished_before"] = await spell_finished()
        seen["step_at_kill"] = len(text(metrics).splitlines())
        await stub.ResumeRun(orchestrator_pb2.ResumeRunRequest())

        async def played_again() -> bool:
            return await spell_finished() > seen["finished_before"]

        await live_runs.until_while_running(
            played_again, launcher=launcher, out=out, timeout_s=240, what="spell played again"
        )
    return seen


def primerl(*args: str, out: pathlib.Path, timeout_s: float) -> str:
    with out.open("w") as log:
        code = subprocess.run(
            [sys.executable, "-m", "primerl_launcher", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
            env=live_runs.environ_without("WANDB_MODE"),
        ).returncode
    printed = out.read_text()
    assert code == 0, printed
    return printed


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("ecosystem")
    config, run_dir, out = root / "launch.toml", root / "run", root / "up.out"
    config.write_text(launch_file(root))
    with live_runs.primerl_up(config, run_dir, out, env=live_runs.environ_without("WANDB_MODE")) as launcher:
        seen = asyncio.run(kill_spell_mid_run(launcher, run_dir, root, out))
        assert launcher.wait(240) == 0, out.read_text()
    return Run(root, config, run_dir, out.read_text(), seen)


def records(run: Run) -> list[dict]:
    return live_runs.read_records(run.run_dir)


def test_verifiers_environments_train_with_their_rubrics_and_survive_a_killed_process(run):
    seen = run.seen
    assert seen["restarted"] not in (None, seen["victim"]), seen
    assert seen["step_at_kill"] < MAX_STEPS
    steps = [r["orchestrator"] for r in records(run)]
    assert [r["step"] for r in steps] == list(range(1, MAX_STEPS + 1))
    spell = [r["environments"]["spell"] for r in steps if r["environments"]["spell"]["num_rewards"]]
    kv = [r["environments"]["kv"] for r in steps if r["environments"]["kv"]["num_rewards"]]
    # The rubrics' own reward functions and metrics, per step.
    assert spell and all({"reasoning_gym_score", "num_turns"} <= set(e["episode_metrics"]) for e in spell)
    assert kv and all(
        {"correct_value", "looked_up_value_in_answer", "lookup_calls", "total_tool_calls", "num_turns"}
        <= set(e["episode_metrics"])
        for e in kv
    )
    for env in spell:
        assert env["reward_mean"] == pytest.approx(env["episode_metrics"]["reasoning_gym_score"])
    for env in kv:
        assert env["reward_mean"] == pytest.approx(env["episode_metrics"]["correct_value"])
    # The orchestrator saw its process die and started another; the run went on to its last step.
    orchestrator_log = (run.run_dir / "logs" / "orchestrator.log").read_text()
    assert "environment spell's process was killed by SIGKILL" in orchestrator_log
    assert "restart 1 of at most" in orchestrator_log
    assert "all services stopped" in run.printed and "not a clean exit" not in run.printed, run.printed


def eval_results(run: Run, name: str) -> dict[int, dict]:
    """The results of eval `name` in metrics.jsonl, by policy version."""
    return {
        result["policy_version"]: result
        for record in records(run)
        for evaluation, result in record["orchestrator"]["evals"].items()
        if evaluation == name
    }


def test_evals_of_a_verifiers_and_a_builtin_environment_reach_metrics_wandb_and_tensorboard(run):
    orchestrator = run.run_dir / "orchestrator"
    evals = {name: eval_results(run, name) for name in ("spell_heldout", "reverse_heldout")}
    for name, results in evals.items():
        assert {0, 2} <= set(results), (name, results)
        for version, result in results.items():
            assert version % 2 == 0 and (result["num_tasks"], result["num_samples"]) == (2, 2)
            assert 0 <= result["reward_mean"] <= 1 and 0 <= result["pass@1"] <= result["pass@2"] <= 1
            assert result["min_token_version"] >= version and result["num_errors"] == 0, result
    assert {e["environment"] for e in (evals["spell_heldout"][0], evals["reverse_heldout"][0])} == {
        "verifiers",
        "reverse_text",
    }
    # Eval episodes are never trained on: the environments' counts hold training episodes only.
    lines = [json.loads(line) for line in (orchestrator / "evals.jsonl").read_text().splitlines()]
    assert {(line["name"], line["policy_version"]) for line in lines} >= {
        (name, version) for name in evals for version in (0, 2)
    }

    # W&B offline run, read back with wandb's reader.
    [wandb_run] = (orchestrator / "wandb").glob("offline-run-*")
    [log] = wandb_run.glob("run-*.wandb")
    wandb_binary = pathlib.Path(sys.executable).parent / "wandb"
    inspected = subprocess.run(
        [str(wandb_binary), "leet", "inspect", str(log), "--json"], capture_output=True, text=True, check=True
    )
    wandb_records = [json.loads(line) for line in inspected.stdout.splitlines() if line.strip()]
    rows = [r["history"]["item"] for r in wandb_records if r["type"] == "history"]
    for name, results in evals.items():
        key = f"eval/{name}/pass@1"
        logged = {r["policy_version"]: r[key] for r in rows if key in r}
        assert {v: results[v]["pass@1"] for v in (0, 2)} == {v: logged[v] for v in (0, 2)}
    steps = sorted(r["step"] for r in rows if "orchestrator/batch_reward_mean" in r)
    assert steps == list(range(1, MAX_STEPS + 1))
    assert any("trainer/loss" in r for r in rows)
    assert any(r.get("samples/rollouts.nrows") == 4 for r in rows)
    [config] = [r["run"]["config"]["update"] for r in wandb_records if r["type"] == "run"]
    assert [e["interval_steps"] for e in config["orchestrator"]["evals"]] == [2, 2]
    assert "[optimizer]\nlr = 0.0001" in config["trainer"]

    # TensorBoard event file.
    events = EventAccumulator(str(orchestrator / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for name, results in evals.items():
        logged = {e.step: e.value for e in events.Scalars(f"eval/{name}/reward_mean")}
        assert {0, 2} <= set(logged) and logged[2] == pytest.approx(results[2]["reward_mean"])
    assert [e.step for e in events.Scalars("orchestrator/batch_reward_mean")] == list(range(1, MAX_STEPS + 1))


def test_primerl_samples_shows_a_step_of_the_run(run):
    shown = primerl("samples", str(run.run_dir), "--step", "2", out=run.root / "samples.out", timeout_s=60)
    step_two = next(r for r in records(run) if r["step"] == 2)
    assert f"step 2: {step_two['orchestrator']['num_samples']} samples" in shown, shown
    assert re.search(r"#0 (spell|kv)  reward \d\.\d{3}  advantage [+-]\d\.\d{3}  policy version \d", shown), shown
    page = run.root / "step2.html"
    primerl("samples", str(run.run_dir), "--step", "2", "--html", str(page), out=run.root / "html.out", timeout_s=60)
    assert page.read_text().count("<tr class=") == step_two["orchestrator"]["num_samples"]


def test_primerl_eval_plays_the_same_evals_on_the_model_folder_alone(run):
    model = re.search(r"^model: (.+)$", run.printed, re.MULTILINE).group(1)
    eval_dir = run.run_dir / "eval"
    table = primerl(
        "eval", model, "-c", str(run.config), "--run-dir", str(eval_dir), out=run.root / "eval.out", timeout_s=300
    )
    results = {r["name"]: r for r in json.loads((eval_dir / "evals.json").read_text())["evals"]}
    assert set(results) == {"spell_heldout", "reverse_heldout"}
    for result in results.values():
        assert result["policy_version"] == 0 and result["num_errors"] == 0, result
        assert len(result["samples"]) == 2 and {"prompt", "completion", "reward"} <= set(result["samples"][0])
    # The verifiers eval was played by the spell environment's own process, served the API.
    assert "backward" in results["spell_heldout"]["samples"][0]["prompt"]
    assert re.search(r"^spell_heldout\s+verifiers\s+2 x 2\s+\d\.\d{3}", table, re.MULTILINE), table
    assert re.search(r"^reverse_heldout\s+reverse_text\s+2 x 2\s+\d\.\d{3}", table, re.MULTILINE), table
