"""`primerl up` end to end: the six services from one launch file, a few RL steps of the tiny
dense Qwen3 on two inference replicas, the whole data path checked through the services'
own APIs while the run goes on, then the launcher's metrics, plot and clean stop.

The test plays an external environment ("held") through the orchestrator's API, as a
custom environment would: one episode is held open from the first policy version until the
orchestrator drops it as too far off-policy.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from google.rpc import error_details_pb2

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details

from . import live_runs

pytestmark = pytest.mark.slow

# Enough that the test acts while the run is still going, even when steps take a second.
MAX_STEPS = 8
MAX_OFF_POLICY_STEPS = 1
REPLICAS = ("inference-0", "inference-1")


def launch_file() -> str:
    launcher = live_runs.launcher_section("tiny-dense", inference_replicas=len(REPLICAS))
    reverse_text = live_runs.reverse_text_environment(group_size=4, max_tokens=12)
    router_load = "[router.load]\nreport_interval_ms = 100\n"
    return f"""
{launcher}# The services' own validation (--check-config) is tested with cheap services in
# tools/launcher/tests/test_launcher.py; here it would import torch and transformers twice more.
check_config = false

{live_runs.orchestrator_head(max_model_len=256, max_steps=MAX_STEPS, batch_size=8)}max_async_level = 1
max_off_policy_steps = {MAX_OFF_POLICY_STEPS}
# Two reverse_text groups (one batch) and the test's own episodes: a new group starts for the
# next step, not for one only the last batches could take.
max_concurrent_episodes = 10
{live_runs.NO_ZERO_ADVANTAGE_FILTER}{reverse_text}[[orchestrator.environments]]
name = "held"
group_size = 1
[orchestrator.environments.sampling]
max_tokens = 4

{live_runs.trainer_section(seq_len=1024)}
{live_runs.inference_engine(max_model_len=256, max_num_seqs=16, kv_cache_gib=1)}
{live_runs.router_and_broadcaster(no_replica_wait_s=60.0, router_load=router_load)}[kvstore]
"""


async def until(predicate, *, timeout_s: float, what: str):
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        assert loop.time() < give_up_at, f"gave up waiting for {what}"
        await asyncio.sleep(0.2)


def turn(episode_id: str) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        episode_id=episode_id,
        messages=orchestrator_pb2.ChatMessages(messages=[{"role": "user", "content": "Reverse: abc"}]),
    )


async def drive(services: dict) -> dict:
    """Checks the data path while the run goes on; returns what it saw."""
    seen: dict = {}
    channels = {name: make_channel(service["address"]) for name, service in services.items()}
    try:
        orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(channels["orchestrator"])
        trainer = trainer_pb2_grpc.TrainerServiceStub(channels["trainer"])
        router = router_pb2_grpc.RouterServiceStub(channels["router"])
        replicas = {name: inference_pb2_grpc.InferenceServiceStub(channels[name]) for name in REPLICAS}

        async def versions() -> dict[str, int]:
            loads = [await replicas[name].GetLoad(inference_pb2.GetLoadRequest()) for name in REPLICAS]
            return {name: load.load.policy_version for name, load in zip(REPLICAS, loads, strict=True)}

        # An episode held open from the start: sampled by the first policy.
        start = orchestrator_pb2.StartEpisodeRequest(environment="held", task=orchestrator_pb2.Task(task_id="held"))
        [held] = (await orchestrator.StartEpisode(start)).episodes
        first = await orchestrator.Generate(turn(held.episode_id))
        assert first.token_ids
        seen["held_version"] = first.last_policy_version

        # Every replica moves to a newer policy; tokens sampled after that carry it.
        updated = await until(
            lambda: _all_at_least(versions, seen["held_version"] + 1), timeout_s=240, what="a weight update"
        )
        seen["updated_versions"] = updated
        [fresh] = (await orchestrator.StartEpisode(start)).episodes
        seen["fresh_episode_version"] = (await orchestrator.Generate(turn(fresh.episode_id))).first_policy_version
        await orchestrator.FinishEpisode(orchestrator_pb2.FinishEpisodeRequest(episode_id=fresh.episode_id, reward=0))
        request = router_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                prompt_token_ids=list(b"<|im_start|>user\nhi"),
                sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=4),
            )
        )
        sampled = []
        for _ in range(4):  # the router spreads requests over the replicas
            async for response in router.Generate(request):
                sampled.extend(response.output.policy_versions)
        seen["sampled_versions"] = sampled

        # Batches reach the trainer.
        status = await trainer.GetStatus(trainer_pb2.GetStatusRequest())
        seen["trainer_step"], seen["published"] = status.step, status.published_policy_version

        # The held episode is dropped once too far behind, and the environment is told so.
        async def held_dropped():
            status = await orchestrator.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
            return {env.name: env.num_dropped_off_policy for env in status.environments}["held"] >= 1

        await until(held_dropped, timeout_s=240, what="the held episode to be dropped")
        try:
            await orchestrator.Generate(turn(held.episode_id))
            raise AssertionError("a dropped episode took another turn")
        except grpc.aio.AioRpcError as error:
            reasons = [d.reason for d in error_details(error) if isinstance(d, error_details_pb2.ErrorInfo)]
            seen["dropped"] = (error.code(), reasons)
    finally:
        for channel in channels.values():
            await channel.close()
    return seen


async def _all_at_least(versions, minimum: int) -> dict[str, int] | None:
    current = await versions()
    return current if all(v >= minimum for v in current.values()) else None


def test_primerl_up_runs_rl_through_all_six_services(tmp_path):
    config, run_dir, out = tmp_path / "launch.toml", tmp_path / "run", tmp_path / "launcher.out"
    config.write_text(launch_file())
    with live_runs.primerl_up(config, run_dir, out) as launcher:
        services = live_runs.services_of(launcher, run_dir, out, timeout_s=300)
        assert set(services) == {"orchestrator", "trainer", "router", "weight_broadcaster", "kvstore", *REPLICAS}
        seen = asyncio.run(drive(services))
        assert launcher.wait(240) == 0, out.read_text()
    printed = out.read_text()

    assert all(v > seen["held_version"] for v in seen["updated_versions"].values())
    assert seen["sampled_versions"] and min(seen["sampled_versions"]) >= min(seen["updated_versions"].values())
    assert seen["fresh_episode_version"] >= min(seen["updated_versions"].values())
    assert seen["trainer_step"] >= 1 and seen["published"] >= 1
    assert seen["dropped"] == (grpc.StatusCode.FAILED_PRECONDITION, ["EPISODE_DROPPED"])

    records = live_runs.read_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    for record in records:
        assert record["trainer"]["num_samples"] >= 1  # every step trained on a batch
        assert record["orchestrator"] is not None and record["reward_mean"] is not None
        assert record["mismatch_kl"] is not None and record["off_policy_steps_max"] <= MAX_OFF_POLICY_STEPS
    # Policy versions advance on every replica, up to the last step's.
    for name in REPLICAS:
        served = [r["replica_policy_versions"][name] for r in records]
        assert served == sorted(served)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_policy_versions"] == dict.fromkeys(REPLICAS, MAX_STEPS)
    assert summary["num_steps"] == MAX_STEPS and summary["reward_mean_first"] is not None
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot:    {run_dir / 'metrics.png'}" in printed and "all services stopped" in printed, printed
    assert "not a clean exit" not in printed, printed
