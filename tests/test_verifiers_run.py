"""`primerl up` with the two shipped verifiers environments (a reasoning-gym task, single turn;
a key-value store queried with a tool, multi-turn) on the tiny dense model: a few RL steps,
the rewards and metrics coming from their rubrics, and an environment process killed mid-run
restarted while the run goes on to its last step."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.client import make_channel

pytestmark = pytest.mark.slow

CACHE = pathlib.Path(os.environ.get("PRIMERL_TEST_CACHE", pathlib.Path(tempfile.gettempdir()) / "primerl-test-cache"))
EXAMPLES = "primerl_orchestrator.environments.verifiers_examples"
MAX_STEPS = 5


def launch_file(logs: pathlib.Path) -> str:
    return f"""
[launcher]
model = "tiny-dense"
inference_replicas = 1
cache_dir = "{CACHE / "launcher"}"
poll_interval_s = 0.5
start_timeout_s = 240
check_config = false

[orchestrator.model]
max_model_len = 1024
[orchestrator.peers]
poll_interval_s = 0.2
[orchestrator.run]
max_steps = {MAX_STEPS}
batch_size = 4
max_concurrent_episodes = 8
[orchestrator.advantage]
filter_zero_advantage = false
[[orchestrator.environments]]
name = "spell"
kind = "verifiers"
group_size = 2
[orchestrator.environments.sampling]
max_tokens = 12
[orchestrator.environments.options]
module = "{EXAMPLES}.reasoning_gym_task"
args = {{task = "spell_backward", num_examples = 200, num_eval_examples = 0}}
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

[trainer]
device = "cpu"
seq_len = 2048
[trainer.model]
dtype = "float32"
compute_dtype = "float32"
[trainer.optimizer]
lr = 1e-4

[inference.engine]
dtype = "float32"
enforce_eager = true
max_model_len = 1024
max_num_seqs = 16
kv_cache_gib = 1

[router.health]
interval_s = 0.5
[router.routing]
no_replica_wait_s = 60.0
[weight_broadcaster.push]
probe_interval_s = 0.5
[kvstore]
"""


def text(path: pathlib.Path) -> str:
    return path.read_text() if path.is_file() else ""


def loaded(log: pathlib.Path) -> int:
    """How many times the environment's process loaded its environment (once per start)."""
    return log.read_text().count("rows of its train dataset") if log.is_file() else 0


def environment_process(launcher: subprocess.Popen[str], name: str) -> psutil.Process | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if f"--environment={name}" in child.cmdline():
                return child
        except psutil.Error:
            continue
    return None


async def wait_until(check, *, launcher, out: pathlib.Path, timeout_s: float, what: str):
    give_up_at = time.monotonic() + timeout_s
    while not (value := await check()):
        assert launcher.poll() is None, f"the launcher exited while waiting until {what}:\n{text(out)}"
        assert time.monotonic() < give_up_at, f"gave up waiting until {what}:\n{text(out)}"
        await asyncio.sleep(0.2)
    return value


async def kill_spell_mid_run(launcher, run_dir: pathlib.Path, logs: pathlib.Path, out: pathlib.Path) -> dict:
    """Once a step is done: pauses the run, kills the spell environment's process, resumes once
    it is back; returns what it saw."""
    seen: dict = {}
    metrics = run_dir / "orchestrator" / "metrics.jsonl"

    async def services() -> dict | None:
        path = run_dir / "services.json"
        return json.loads(path.read_text()) if path.is_file() else None

    address = (await wait_until(services, launcher=launcher, out=out, timeout_s=300, what="services up"))[
        "orchestrator"
    ]["address"]
    async with make_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def spell_finished() -> int:
            status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
            return {env.name: env.num_episodes_finished for env in status.environments}["spell"]

        async def first_step() -> bool:
            return bool(text(metrics).strip()) and await spell_finished() > 0

        await wait_until(first_step, launcher=launcher, out=out, timeout_s=240, what="step 1 and spell episodes")
        await stub.PauseRun(orchestrator_pb2.PauseRunRequest())
        victim = environment_process(launcher, "spell")
        assert victim is not None
        seen["victim"] = victim.pid
        victim.send_signal(signal.SIGKILL)

        async def back() -> bool:
            return loaded(logs / "spell.log") == 2

        await wait_until(back, launcher=launcher, out=out, timeout_s=120, what="spell's process restarted")
        restarted = environment_process(launcher, "spell")
        seen["restarted"] = restarted.pid if restarted is not None else None
        seen["finished_before"] = await spell_finished()
        seen["step_at_kill"] = len(text(metrics).splitlines())
        await stub.ResumeRun(orchestrator_pb2.ResumeRunRequest())

        async def played_again() -> bool:
            return await spell_finished() > seen["finished_before"]

        await wait_until(played_again, launcher=launcher, out=out, timeout_s=240, what="spell played again")
    return seen


def test_verifiers_environments_run_through_primerl_up_and_survive_a_killed_process(tmp_path):
    config, run_dir, out, logs = tmp_path / "launch.toml", tmp_path / "run", tmp_path / "launcher.out", tmp_path
    config.write_text(launch_file(logs))
    with out.open("w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "primerl_launcher", "up", "-c", str(config), "--run-dir", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        seen = asyncio.run(kill_spell_mid_run(launcher, run_dir, logs, out))
        assert launcher.wait(240) == 0, out.read_text()
    finally:
        launcher.kill()

    assert seen["restarted"] not in (None, seen["victim"]), seen
    assert seen["step_at_kill"] < MAX_STEPS
    records = [json.loads(line) for line in (run_dir / "orchestrator" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    spell = [r["environments"]["spell"] for r in records if r["environments"]["spell"]["num_rewards"]]
    kv = [r["environments"]["kv"] for r in records if r["environments"]["kv"]["num_rewards"]]
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
    orchestrator_log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "environment spell's process was killed by SIGKILL" in orchestrator_log
    assert "restart 1 of at most" in orchestrator_log
    printed = out.read_text()
    assert "all services stopped" in printed and "not a clean exit" not in printed, printed
