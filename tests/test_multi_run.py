"""Three tenants' RL runs on one trainer and one vLLM replica at once, as a launch file's
`[[runs]]` says: `primerl up` starts the services ([trainer.runs]), creates the runs (trainer.v1
CreateRun as the operator, for their owners alice, bob and carol: each its own LoRA rank, seed and
learning rate), starts one orchestrator per run (each on its own environment and task seed,
showing its owner's certificate under mutual TLS), restarts the one that dies, and ends by itself
once every run is trained and served, with a summary.

Checked through the services' own APIs: every run steps; each run's adapter (named by its run
id, versioned by its step) is what the broadcaster published and what the replica serves, at
its own versions and rank, the three held by the engine at once; a tenant cannot read another's
run nor generate with its adapter; a run whose orchestrator is killed (SIGKILL) waits for the
launcher's restart while the other two step on, then trains its remaining steps, none twice; a
run deleted through the API is dropped (its adapter leaves the broadcaster and the replica, the
launcher stops its orchestrator); the replica applies each run's own adapter (greedy outputs
differ; the trainer's logprobs of each run's sampled tokens match vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time

import grpc
import pytest

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.config import TlsConfig
from primerl_common.security.certificates import tls_of

from . import live_runs

pytestmark = pytest.mark.slow

MAX_STEPS = 6
# The killed run's orchestrator goes once every run has trained this many steps.
KILL_AT_STEP = 2
# The launcher's wait before it restarts the killed orchestrator: the other runs step meanwhile.
RESTART_BACKOFF_S = 15.0


@dataclasses.dataclass(frozen=True)
class RunCase:
    run_id: str
    owner: str
    lora_rank: int
    seed: int
    learning_rate: float
    environment: str  # a built-in environment kind
    task_seed: int


RUNS = (
    RunCase("reverse-r2", "alice", lora_rank=2, seed=1, learning_rate=5e-3, environment="reverse_text", task_seed=11),
    RunCase("sort-r4", "bob", lora_rank=4, seed=2, learning_rate=1e-2, environment="sort_letters", task_seed=22),
    RunCase("reverse-r8", "carol", lora_rank=8, seed=3, learning_rate=5e-3, environment="reverse_text", task_seed=33),
)
KILLED = RUNS[1]
# Deleted through the API once it has stepped while the killed run waits for its restart.
DELETED = RUNS[2]
FINISHING = tuple(run for run in RUNS if run is not DELETED)


def run_table(run: RunCase) -> str:
    return f"""[[runs]]
id = "{run.run_id}"
owner = "{run.owner}"
[runs.spec]
lora_rank = {run.lora_rank}
lora_alpha = {2.0 * run.lora_rank}
seed = {run.seed}
learning_rate = {run.learning_rate}
[runs.orchestrator.run]
seed = {run.task_seed}
[[runs.orchestrator.environments]]
name = "{run.environment}"
kind = "{run.environment}"
group_size = 4
[runs.orchestrator.environments.sampling]
max_tokens = 12
"""


def launch_file() -> str:
    return f"""{live_runs.launcher_section("tiny-dense")}check_config = false
tls = "mtls"
restart_backoff_s = {RESTART_BACKOFF_S}

{live_runs.trainer_section(seq_len=1024, optimizer=False)}[trainer.lora]
enabled = true
rank = 8
alpha = 16.0
[trainer.runs]
max_concurrent_runs = {len(RUNS)}

{live_runs.inference_engine(max_model_len=256, max_num_seqs=16, kv_cache_gib=1)}
{live_runs.router_and_broadcaster(no_replica_wait_s=60.0)}
{live_runs.orchestrator_head(max_model_len=256, max_steps=MAX_STEPS, batch_size=8)}max_async_level = 1
{live_runs.NO_ZERO_ADVANTAGE_FILTER}
{"".join(run_table(run) for run in RUNS)}"""


def orchestrator_name(run: RunCase) -> str:
    return f"orchestrator-{run.run_id}"


class Deployment:
    """The launched services' stubs (as the operator), and what the runs do as they go."""

    def __init__(self, launcher: subprocess.Popen[str], run_dir: pathlib.Path, out: pathlib.Path) -> None:
        self.launcher, self.run_dir, self.out = launcher, run_dir, out
        self.services = live_runs.read_services(run_dir) or {}
        self.channels = {
            name: make_channel(self.services[name]["address"], tls=self.tls_of("operator"))
            for name in ("trainer", "weight_broadcaster", "inference-0")
        }
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self.channels["trainer"])
        self.broadcaster = wb_pb2_grpc.WeightBroadcasterServiceStub(self.channels["weight_broadcaster"])
        self.replica = inference_pb2_grpc.InferenceServiceStub(self.channels["inference-0"])
        # Each run's steps as the trainer reports them (WatchSteps): (step, finished_at in seconds).
        self.steps: dict[str, list[tuple[int, float]]] = {run.run_id: [] for run in RUNS}
        self.metrics: dict[str, list[trainer_pb2.StepMetrics]] = {run.run_id: [] for run in RUNS}

    def tls_of(self, name: str) -> TlsConfig:
        """The mTLS section of a certificate the launcher made (<run_dir>/certs)."""
        return tls_of(self.run_dir / "certs", name)

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    async def until(self, check, *, what: str, timeout_s: float = 300):
        return await live_runs.until_while_running(
            check, launcher=self.launcher, out=self.out, timeout_s=timeout_s, what=what
        )

    async def watch_steps(self, run_id: str) -> None:
        """Records the run's steps as they are trained, until cancelled (or the trainer stops)."""
        request = trainer_pb2.WatchStepsRequest(after_step=-1, run_id=run_id)
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in self.trainer.WatchSteps(request):
                finished_at = response.step.finished_at.ToNanoseconds() / 1e9
                self.steps[run_id].append((response.step.step, finished_at))
                self.metrics[run_id].append(response.step)

    async def runs(self) -> dict[str, trainer_pb2.Run]:
        return {run.run_id: run for run in (await self.trainer.ListRuns(trainer_pb2.ListRunsRequest())).runs}

    async def until_steps(self, wanted: dict[str, int], *, what: str) -> dict[str, int]:
        async def reached() -> dict[str, int] | None:
            steps = {run_id: run.step for run_id, run in (await self.runs()).items()}
            return steps if all(steps.get(run_id, -1) >= step for run_id, step in wanted.items()) else None

        return await self.until(reached, what=what)

    async def served(self, run_ids: list[str], *, what: str) -> dict:
        """What the trainer, the broadcaster and the replica say of these runs' adapters, once the
        replica holds each one's latest published version."""

        async def in_step() -> dict | None:
            runs = await self.runs()
            status = await self.broadcaster.GetStatus(wb_pb2.GetStatusRequest())
            load = (await self.replica.GetLoad(inference_pb2.GetLoadRequest())).load
            if any(
                runs[run_id].published_policy_version != runs[run_id].step
                or load.adapter_versions.get(run_id, -1) != runs[run_id].step
                for run_id in run_ids
            ):
                return None
            adapters = (await self.replica.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
            return {"runs": runs, "broadcaster": status, "load": load, "adapters": {a.name: a for a in adapters}}

        return await self.until(in_step, what=what, timeout_s=120)

    async def as_tenant(self, tenant: str, run: RunCase) -> dict[str, grpc.StatusCode]:
        """What `tenant`'s certificate gets when it reads `run` (GetRun) and generates with its
        adapter through the router. The router learns the adapter's owner from the replica's
        load reports: another tenant's request is tried until it is refused (or 20 s pass)."""
        tls = self.tls_of(tenant)
        codes = {}
        async with make_channel(self.services["trainer"]["address"], tls=tls, max_attempts=1) as channel:
            codes["GetRun"] = await _code(
                trainer_pb2_grpc.TrainerServiceStub(channel).GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id))
            )
        async with make_channel(self.services["router"]["address"], tls=tls, max_attempts=1) as channel:
            router = router_pb2_grpc.RouterServiceStub(channel)
            give_up_at = time.monotonic() + 20
            while True:
                codes["Generate"] = await _code(_collect(router.Generate(_greedy_request(run.run_id, max_tokens=1))))
                owner = tenant == run.owner
                if owner or codes["Generate"] != grpc.StatusCode.OK or time.monotonic() > give_up_at:
                    return codes
                await asyncio.sleep(0.5)

    async def adapter_removed(self, run_id: str) -> dict | None:
        """The broadcaster's status and the replica's adapters once neither has the run's adapter."""
        status = await self.broadcaster.GetStatus(wb_pb2.GetStatusRequest())
        adapters = (await self.replica.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
        if run_id in status.latest_adapter_versions or run_id in {adapter.name for adapter in adapters}:
            return None
        return {"broadcaster": status, "adapters": [adapter.name for adapter in adapters]}

    async def greedy(self, adapter: str, *, tenant: str) -> generation_pb2.GenerationOutput:
        """Eight greedy tokens of a fixed prompt with `adapter` ('': the base model), through the
        router as `tenant` (under mTLS a replica generates for the router only, the router for
        orchestrators and tenants)."""
        async with make_channel(self.services["router"]["address"], tls=self.tls_of(tenant)) as channel:
            router = router_pb2_grpc.RouterServiceStub(channel)
            [response] = await _collect(router.Generate(_greedy_request(adapter)))
        return response.output


def _greedy_request(adapter: str, *, max_tokens: int = 8) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        input=generation_pb2.GenerationInput(
            prompt_token_ids=list(range(40, 60)),
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            stream=generation_pb2.StreamOptions(final_only=True),
            lora_adapter=adapter,
        )
    )


async def _collect(call) -> list:
    return [response async for response in call]


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def drive_runs(launcher: subprocess.Popen[str], run_dir: pathlib.Path, out: pathlib.Path) -> dict:
    async def run_orchestrators_started() -> dict | None:
        services = live_runs.read_services(run_dir) or {}
        return services if all(orchestrator_name(run) in services for run in RUNS) else None

    await live_runs.until_while_running(
        run_orchestrators_started, launcher=launcher, out=out, timeout_s=600, what="the runs' orchestrators"
    )
    deployment = Deployment(launcher, run_dir, out)
    watchers = [asyncio.ensure_future(deployment.watch_steps(run.run_id)) for run in RUNS]
    try:
        created = await deployment.runs()
        await deployment.until_steps(
            {run.run_id: KILL_AT_STEP for run in RUNS}, what=f"every run at step {KILL_AT_STEP}"
        )
        before_kill = await deployment.served([run.run_id for run in RUNS], what="every run's adapter on the replica")
        alice = RUNS[0]
        isolation = {tenant: await deployment.as_tenant(tenant, alice) for tenant in ("bob", "alice")}

        killed_pid = deployment.services[orchestrator_name(KILLED)]["pid"]
        os.kill(killed_pid, signal.SIGKILL)
        killed_at_s = time.time()

        async def stepped_since_the_kill() -> bool:
            return all(
                any(finished_at > killed_at_s for _, finished_at in deployment.steps[run.run_id])
                for run in RUNS
                if run is not KILLED
            )

        await deployment.until(stepped_since_the_kill, what="the other runs stepping after the kill")
        deleted_at = (await deployment.runs())[DELETED.run_id].step
        await deployment.trainer.DeleteRun(trainer_pb2.DeleteRunRequest(run_id=DELETED.run_id))
        removed = await deployment.until(
            lambda: deployment.adapter_removed(DELETED.run_id), what="the deleted run's adapter removed", timeout_s=60
        )
        dropped = f"run {DELETED.run_id}: deleted through the trainer's API"
        await deployment.until(lambda: asyncio.to_thread(lambda: dropped in live_runs.printed(out)), what="the drop")

        # The unkilled run that finishes: its adapter at its last version, while the killed one catches up.
        survivor = next(run for run in FINISHING if run is not KILLED)
        await deployment.until_steps({survivor.run_id: MAX_STEPS}, what=f"{survivor.run_id}'s last step")
        at_end = await deployment.served([survivor.run_id], what=f"{survivor.run_id}'s last adapter on the replica")
        greedy = {adapter: await deployment.greedy(adapter, tenant=survivor.owner) for adapter in ("", survivor.run_id)}
        # `primerl up` ends by itself once the killed run has trained and served its last step.
        await asyncio.to_thread(launcher.wait, 600)
        return {
            "created": created,
            "before_kill": before_kill,
            "isolation": isolation,
            "killed_at_s": killed_at_s,
            "deleted_at": deleted_at,
            "removed": removed,
            "at_end": at_end,
            "greedy": greedy,
            "steps": deployment.steps,
            "metrics": deployment.metrics,
        }
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await deployment.close()


def test_three_tenants_runs_train_side_by_side_on_one_trainer_and_one_replica(tmp_path: pathlib.Path) -> None:
    config, run_dir, out = tmp_path / "runs.toml", tmp_path / "run", tmp_path / "launcher.out"
    config.write_text(launch_file())
    # Not the tests' plaintext default (conftest's PRIMERL_<SERVICE>_TLS__MODE): the run file's mTLS.
    with live_runs.primerl_up(config, run_dir, out, env=live_runs.environ_without(suffix="_TLS__MODE")) as launcher:
        seen = asyncio.run(drive_runs(launcher, run_dir, out))
        assert launcher.wait(10) == 0, live_runs.printed(out)
    printed = live_runs.printed(out)
    assert "all services stopped" in printed, printed

    for run in RUNS:
        created = seen["created"][run.run_id]
        assert created.spec.lora_rank == run.lora_rank and created.spec.seed == run.seed, created
        assert created.owner == run.owner and created.state == trainer_pb2.RUN_STATE_ACTIVE, created
        assert f"run {run.run_id}: created for {run.owner}" in printed, printed

    # Before the kill: every run stepped, its adapter served at its own versions, all three at once.
    before = seen["before_kill"]
    assert set(before["adapters"]) == {run.run_id for run in RUNS}
    for run in RUNS:
        trained = before["runs"][run.run_id]
        assert trained.step >= KILL_AT_STEP and trained.published_policy_version == trained.step, trained
        assert before["broadcaster"].latest_adapter_versions[run.run_id] >= KILL_AT_STEP
        assert before["load"].adapter_versions[run.run_id] == trained.step
        assert before["load"].adapter_owners[run.run_id] == run.owner
        adapter = before["adapters"][run.run_id]
        assert adapter.rank == run.lora_rank and adapter.policy_version == trained.step, adapter
    assert before["load"].policy_version == 0  # the base weights are never published

    # A tenant's run and adapter are its own: bob is refused alice's, alice is served.
    assert seen["isolation"]["bob"] == {
        "GetRun": grpc.StatusCode.PERMISSION_DENIED,
        "Generate": grpc.StatusCode.PERMISSION_DENIED,
    }
    assert seen["isolation"]["alice"] == {"GetRun": grpc.StatusCode.OK, "Generate": grpc.StatusCode.OK}

    # The killed run waited for its orchestrator's restart while the two others stepped: each
    # finished a step between the killed run's last step before the restart and its next one.
    steps = seen["steps"]
    killed = steps[KILLED.run_id]
    assert [step for step, _ in killed] == list(range(1, MAX_STEPS + 1)), killed  # each step once
    restarted_from = next(index for index, (_, at) in enumerate(killed) if at > seen["killed_at_s"] + RESTART_BACKOFF_S)
    gap = (killed[restarted_from - 1][1], killed[restarted_from][1])
    for run in RUNS:
        if run is not KILLED:
            assert any(gap[0] < at < gap[1] for _, at in steps[run.run_id]), (run.run_id, gap, steps[run.run_id])
    assert f"{orchestrator_name(KILLED)} was killed by SIGKILL: restart 1 of" in printed, printed
    services = live_runs.read_services(run_dir)
    assert services[orchestrator_name(KILLED)]["restarts"] == 1
    assert all(service["restarts"] == 0 for name, service in services.items() if name != orchestrator_name(KILLED))

    # The deleted run: gone from the broadcaster and the replica, dropped by the launcher.
    assert DELETED.run_id not in seen["removed"]["adapters"]
    assert orchestrator_name(DELETED) not in services
    deleted = [step for step, _ in steps[DELETED.run_id]]
    assert deleted == list(range(1, len(deleted) + 1)) and len(deleted) >= seen["deleted_at"], deleted

    # The end: each run's last step served, said in the summary.
    at_end = seen["at_end"]
    for run in FINISHING:
        if run is KILLED:
            continue
        trained = at_end["runs"][run.run_id]
        assert trained.step == MAX_STEPS and trained.state == trainer_pb2.RUN_STATE_ACTIVE, trained
        assert at_end["broadcaster"].latest_adapter_versions[run.run_id] == MAX_STEPS
        assert at_end["adapters"][run.run_id].policy_version == MAX_STEPS
    summary = json.loads((run_dir / "summary.json").read_text())["runs"]
    for run in FINISHING:
        assert summary[run.run_id] == {
            "outcome": "finished",
            "owner": run.owner,
            "step": MAX_STEPS,
            "max_steps": MAX_STEPS,
            "served_versions": {"inference-0": MAX_STEPS},
            "orchestrator_restarts": 1 if run is KILLED else 0,
        }
    assert summary[DELETED.run_id]["outcome"] == "deleted"
    assert "runs:\n  reverse-r2 (alice): finished, step 6/6, adapter version served 6" in printed, printed

    # The replica applies the run's own adapter: stamped with its version, other greedy outputs
    # than the base model's.
    greedy = seen["greedy"]
    survivor = next(run for run in FINISHING if run is not KILLED)
    assert set(greedy[survivor.run_id].policy_versions) == {MAX_STEPS}, greedy[survivor.run_id]
    assert set(greedy[""].policy_versions) == {0}
    moved = max(abs(a - b) for a, b in zip(greedy[""].logprobs, greedy[survivor.run_id].logprobs, strict=True))
    assert list(greedy[""].token_ids) != list(greedy[survivor.run_id].token_ids) or moved > 1e-3, moved

    # Each run's adapter is what vLLM applied to that run's rollouts: the trainer's logprobs of the
    # sampled tokens match vLLM's (float32 on both sides; ~4e-12 measured with one adapter).
    for run in RUNS:
        for step in seen["metrics"][run.run_id]:
            assert step.metrics["published"] == 1.0 and abs(step.metrics["mismatch_kl"]) < 1e-9, (run, step)
    # ... and the finished runs' rollouts were sampled by their own adapter's versions as they came.
    metrics = run_dir / "runs" / survivor.run_id / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(1, MAX_STEPS + 1))
    assert records[-1]["max_policy_version"] >= MAX_STEPS - 2, records[-1]
