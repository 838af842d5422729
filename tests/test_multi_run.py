"""Three RL runs on one trainer and one vLLM replica at once: `primerl up` starts the services
([trainer.runs], no [orchestrator]), the test creates the runs (trainer.v1 CreateRun: each its
own LoRA rank, seed and learning rate) and starts one orchestrator per run (peers.run_id), each
on its own environment and task seed.

Checked through the services' own APIs: every run steps; each run's adapter (named by its run
id, versioned by its step) is what the broadcaster published and what the replica serves, at
its own versions and rank, the three held by the engine at once (engine.max_loras, which the
launcher sets to [trainer.runs] max_concurrent_runs); a run whose orchestrator is killed
(SIGKILL) stops stepping while the other two go on to their last step; the replica applies each
run's own adapter (greedy outputs differ; the trainer's logprobs of each run's sampled tokens
match vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import pathlib
import subprocess
import sys
import tomllib

import pytest

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_ports
from primerl_launcher.run_orchestrator import run_orchestrator_config

from . import live_runs

pytestmark = pytest.mark.slow

MAX_STEPS = 6
# The killed run's orchestrator goes once every run has trained this many steps.
KILL_AT_STEP = 2


@dataclasses.dataclass(frozen=True)
class RunCase:
    run_id: str
    lora_rank: int
    seed: int
    learning_rate: float
    environment: str  # a built-in environment kind
    task_seed: int


RUNS = (
    RunCase("reverse-r2", lora_rank=2, seed=1, learning_rate=5e-3, environment="reverse_text", task_seed=11),
    RunCase("sort-r4", lora_rank=4, seed=2, learning_rate=1e-2, environment="sort_letters", task_seed=22),
    RunCase("reverse-r8", lora_rank=8, seed=3, learning_rate=5e-3, environment="reverse_text", task_seed=33),
)
KILLED = RUNS[1]


def launch_file() -> str:
    return f"""{live_runs.launcher_section("tiny-dense")}check_config = false

{live_runs.trainer_section(seq_len=1024, optimizer=False)}[trainer.lora]
enabled = true
rank = 8
alpha = 16.0
[trainer.runs]
max_concurrent_runs = {len(RUNS)}

{live_runs.inference_engine(max_model_len=256, max_num_seqs=16, kv_cache_gib=1)}
{live_runs.router_and_broadcaster(no_replica_wait_s=60.0)}"""


def orchestrator_tables(run: RunCase) -> str:
    return f"""{live_runs.orchestrator_head(max_model_len=256, max_steps=MAX_STEPS, batch_size=8)}max_async_level = 1
seed = {run.task_seed}
{live_runs.NO_ZERO_ADVANTAGE_FILTER}[[orchestrator.environments]]
name = "{run.environment}"
kind = "{run.environment}"
group_size = 4
[orchestrator.environments.sampling]
max_tokens = 12
"""


class Runs:
    """The launched services' stubs, and the runs' steps and served versions as they go."""

    def __init__(self, services: dict) -> None:
        self.channels = {
            name: make_channel(services[name]["address"]) for name in ("trainer", "weight_broadcaster", "inference-0")
        }
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self.channels["trainer"])
        self.broadcaster = wb_pb2_grpc.WeightBroadcasterServiceStub(self.channels["weight_broadcaster"])
        self.replica = inference_pb2_grpc.InferenceServiceStub(self.channels["inference-0"])

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    async def create(self, run: RunCase) -> trainer_pb2.Run:
        spec = trainer_pb2.RunSpec(
            lora_rank=run.lora_rank, lora_alpha=2.0 * run.lora_rank, seed=run.seed, learning_rate=run.learning_rate
        )
        return (await self.trainer.CreateRun(trainer_pb2.CreateRunRequest(run_id=run.run_id, spec=spec))).run

    async def steps(self) -> dict[str, int]:
        runs = (await self.trainer.ListRuns(trainer_pb2.ListRunsRequest())).runs
        return {run.run_id: run.step for run in runs}

    async def until_steps(self, wanted: dict[str, int], *, launcher, out: pathlib.Path, what: str) -> dict[str, int]:
        async def reached() -> dict[str, int] | None:
            steps = await self.steps()
            return steps if all(steps[run_id] >= step for run_id, step in wanted.items()) else None

        return await live_runs.until_while_running(reached, launcher=launcher, out=out, timeout_s=300, what=what)

    async def served(self, *, launcher, out: pathlib.Path) -> dict:
        """What the trainer, the broadcaster and the replica say of every run's adapter, once the
        replica holds each run's latest published version."""

        async def in_step() -> dict | None:
            runs = {run.run_id: run for run in (await self.trainer.ListRuns(trainer_pb2.ListRunsRequest())).runs}
            status = await self.broadcaster.GetStatus(wb_pb2.GetStatusRequest())
            load = (await self.replica.GetLoad(inference_pb2.GetLoadRequest())).load
            if any(
                run.published_policy_version != run.step or load.adapter_versions.get(run_id, -1) != run.step
                for run_id, run in runs.items()
            ):
                return None
            adapters = (await self.replica.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
            return {"runs": runs, "broadcaster": status, "load": load, "adapters": {a.name: a for a in adapters}}

        return await live_runs.until_while_running(
            in_step, launcher=launcher, out=out, timeout_s=120, what="every run's latest adapter on the replica"
        )

    async def greedy(self, adapter: str) -> generation_pb2.GenerationOutput:
        return await live_runs.greedy(self.replica, adapter)

    async def step_metrics(self, run_id: str, *, last_step: int) -> list[trainer_pb2.StepMetrics]:
        """The run's steps as the trainer tells them (WatchSteps), up to `last_step`."""
        call = self.trainer.WatchSteps(trainer_pb2.WatchStepsRequest(after_step=-1, run_id=run_id))
        steps = []
        try:
            async with asyncio.timeout(30):
                async for response in call:
                    steps.append(response.step)
                    if response.step.step >= last_step:
                        return steps
        finally:
            call.cancel()
        return steps


async def drive_runs(services: dict, *, launcher: subprocess.Popen[str], out: pathlib.Path, tmp: pathlib.Path) -> dict:
    runs = Runs(services)
    orchestrators: dict[str, ServiceProcess] = {}
    try:
        created = {run.run_id: await runs.create(run) for run in RUNS}
        for run, port in zip(RUNS, free_ports(len(RUNS)), strict=True):
            config = run_orchestrator_config(
                tmp / f"{run.run_id}.toml",
                services,
                tomllib.loads(orchestrator_tables(run))["orchestrator"],
                run_id=run.run_id,
                port=port,
                out_dir=tmp / run.run_id,
            )
            orchestrators[run.run_id] = process = ServiceProcess(
                [sys.executable, "-m", "primerl_orchestrator", "-c", str(config)],
                port=port,
                name=run.run_id,
                log_path=tmp / run.run_id / "orchestrator.log",
            )
            process.launch()
        await asyncio.gather(*(process.until_serving(240) for process in orchestrators.values()))
        await runs.until_steps(
            dict.fromkeys(orchestrators, KILL_AT_STEP),
            launcher=launcher,
            out=out,
            what=f"every run at step {KILL_AT_STEP}",
        )
        before_kill = await runs.served(launcher=launcher, out=out)

        orchestrators[KILLED.run_id].kill()
        assert await orchestrators[KILLED.run_id].wait(10) == -9
        killed_at = (await runs.steps())[KILLED.run_id]
        survivors = {run.run_id: MAX_STEPS for run in RUNS if run is not KILLED}
        # A batch the killed orchestrator had pushed may still be trained; none after it.
        after_kill = await runs.until_steps(
            dict.fromkeys(survivors, killed_at + 2), launcher=launcher, out=out, what="the other runs stepping on"
        )
        finished = await runs.until_steps(survivors, launcher=launcher, out=out, what="the other runs' last step")
        at_end = await runs.served(launcher=launcher, out=out)
        alive = {run_id: process.returncode for run_id, process in orchestrators.items()}
        greedy = {adapter: await runs.greedy(adapter) for adapter in ("", *orchestrators)}
        metrics = {
            run_id: await runs.step_metrics(run_id, last_step=run.step) for run_id, run in at_end["runs"].items()
        }
        return {
            "created": created,
            "before_kill": before_kill,
            "killed_at": killed_at,
            "after_kill": after_kill,
            "finished": finished,
            "at_end": at_end,
            "alive": alive,
            "metrics": metrics,
            "greedy": greedy,
        }
    finally:
        for process in orchestrators.values():
            with contextlib.suppress(TimeoutError):
                await process.stop(grace_s=20)
        await runs.close()


def test_three_runs_train_side_by_side_on_one_trainer_and_one_replica(tmp_path: pathlib.Path) -> None:
    config, run_dir, out = tmp_path / "runs.toml", tmp_path / "run", tmp_path / "launcher.out"
    config.write_text(launch_file())
    with live_runs.primerl_up(config, run_dir, out) as launcher:
        services = live_runs.services_of(launcher, run_dir, out, timeout_s=600)
        seen = asyncio.run(drive_runs(services, launcher=launcher, out=out, tmp=tmp_path))
        launcher.terminate()
        launcher.wait(120)
    # No service died meanwhile (none was restarted), and each stopped cleanly.
    assert all(service["restarts"] == 0 for service in live_runs.read_services(run_dir).values())
    assert "all services stopped" in live_runs.printed(out), live_runs.printed(out)

    for run in RUNS:
        created = seen["created"][run.run_id]
        assert created.spec.lora_rank == run.lora_rank and created.spec.seed == run.seed
        assert created.state == trainer_pb2.RUN_STATE_ACTIVE and created.step == 0

    # Before the kill: every run stepped, its adapter served at its own versions, all three at once.
    before = seen["before_kill"]
    assert set(before["adapters"]) == {run.run_id for run in RUNS}
    for run in RUNS:
        trained = before["runs"][run.run_id]
        assert trained.step >= KILL_AT_STEP and trained.published_policy_version == trained.step, trained
        assert before["broadcaster"].latest_adapter_versions[run.run_id] >= KILL_AT_STEP
        assert before["load"].adapter_versions[run.run_id] == trained.step
        adapter = before["adapters"][run.run_id]
        assert adapter.rank == run.lora_rank and adapter.policy_version == trained.step, adapter
    assert before["load"].policy_version == 0  # the base weights are never published

    # After the kill: the two others went on to their last step; the killed run stopped.
    killed_at, after, finished = seen["killed_at"], seen["after_kill"], seen["finished"]
    assert after[KILLED.run_id] <= killed_at + 1, (killed_at, after)
    assert finished[KILLED.run_id] == after[KILLED.run_id] < MAX_STEPS, (killed_at, after, finished)
    at_end = seen["at_end"]
    for run in RUNS:
        trained = at_end["runs"][run.run_id]
        wanted = finished[KILLED.run_id] if run is KILLED else MAX_STEPS
        assert trained.step == wanted and trained.state == trainer_pb2.RUN_STATE_ACTIVE, trained
        assert at_end["broadcaster"].latest_adapter_versions[run.run_id] == wanted
        assert at_end["load"].adapter_versions[run.run_id] == wanted
        assert at_end["adapters"][run.run_id].policy_version == wanted
    assert seen["alive"] == {run.run_id: (-9 if run is KILLED else None) for run in RUNS}

    # The replica applies each run's own adapter: stamped with its version, and the survivors'
    # adapters (the killed run's had too few steps, on all-or-nothing rewards, to be sure to move)
    # give other greedy outputs than each other and the base model.
    greedy = seen["greedy"]
    for run in RUNS:
        wanted = finished[KILLED.run_id] if run is KILLED else MAX_STEPS
        assert set(greedy[run.run_id].policy_versions) == {wanted}, greedy[run.run_id]
    assert set(greedy[""].policy_versions) == {0}
    compared = {name: output for name, output in greedy.items() if name != KILLED.run_id}
    for (one, first), (other, second) in itertools.combinations(compared.items(), 2):
        moved = max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs, strict=True))
        assert list(first.token_ids) != list(second.token_ids) or moved > 1e-3, (one, other, moved)

    # Each run's adapter is what vLLM applied to that run's rollouts: the trainer's logprobs of the
    # sampled tokens match vLLM's (float32 on both sides; ~4e-12 measured with one adapter).
    for run in RUNS:
        steps = seen["metrics"][run.run_id]
        wanted = finished[KILLED.run_id] if run is KILLED else MAX_STEPS
        assert [step.step for step in steps] == list(range(1, wanted + 1))
        for step in steps:
            assert step.metrics["published"] == 1.0 and abs(step.metrics["mismatch_kl"]) < 1e-9, (run, step)
    # ... and the survivors' rollouts were sampled by their own adapter's versions as they came.
    for run in RUNS:
        if run is KILLED:
            continue
        metrics = tmp_path / run.run_id / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [record["step"] for record in records] == list(range(1, MAX_STEPS + 1))
        assert records[-1]["max_policy_version"] >= MAX_STEPS - 2, records[-1]
