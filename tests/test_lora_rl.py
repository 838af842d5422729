"""A LoRA RL run under `primerl up`: `[trainer.lora]` in the launch file is all it takes.

The trainer publishes its adapter alone (a few hundred KB, not the model) as versions of the
adapter "primerl"; the weight broadcaster pushes each to the replica, which loads it in place
beside the base model; the orchestrator generates every turn with it and follows its
versions. Checked through the services' own APIs while the run goes on, then in the run's
metrics: no whole-weights version is ever published, the replica serves the adapter at the
versions the broadcaster published, and the trainer's logprobs of the sampled tokens match
vLLM's with the adapter applied (float32 on both sides; the learning rate is high enough that
the adapter changes greedy tokens within two steps, so the base model would fail the bound).
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.client import make_channel

from . import live_runs

pytestmark = pytest.mark.slow

MAX_STEPS = 5
ADAPTER = "primerl"


def launch_file() -> str:
    return f"""{live_runs.launcher_section("tiny-dense")}check_config = false

{live_runs.orchestrator_head(max_model_len=256, max_steps=MAX_STEPS, batch_size=8)}max_async_level = 1
{live_runs.NO_ZERO_ADVANTAGE_FILTER}{live_runs.reverse_text_environment(group_size=4, max_tokens=12)}
{live_runs.trainer_section(seq_len=1024, optimizer=False)}[trainer.optimizer]
lr = 5e-3
[trainer.lora]
enabled = true
rank = 8
alpha = 16.0

{live_runs.inference_engine(max_model_len=256, max_num_seqs=16, kv_cache_gib=1)}
{live_runs.router_and_broadcaster(no_replica_wait_s=60.0)}"""


async def watch_adapter_versions(services: dict, *, launcher, out: pathlib.Path) -> dict:
    """What the broadcaster, the replica and the router say of the adapter once version 2 is out."""
    channels = {
        name: make_channel(services[name]["address"]) for name in ("weight_broadcaster", "inference-0", "router")
    }
    try:
        broadcaster = wb_pb2_grpc.WeightBroadcasterServiceStub(channels["weight_broadcaster"])
        replica = inference_pb2_grpc.InferenceServiceStub(channels["inference-0"])
        router = router_pb2_grpc.RouterServiceStub(channels["router"])

        async def published() -> wb_pb2.GetStatusResponse | None:
            status = await broadcaster.GetStatus(wb_pb2.GetStatusRequest())
            held = [r.adapter_versions.get(ADAPTER, -1) for r in status.replicas]
            return status if status.latest_adapter_versions.get(ADAPTER, -1) >= 2 and min(held) >= 2 else None

        status = await live_runs.until_while_running(
            published, launcher=launcher, out=out, timeout_s=600, what="adapter version 2 on the replica"
        )
        adapters = (await replica.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
        load = (await replica.GetLoad(inference_pb2.GetLoadRequest())).load
        listed = (await router.ListReplicas(router_pb2.ListReplicasRequest())).replicas
        with_adapter, base = [await live_runs.greedy(replica, adapter) for adapter in (ADAPTER, "")]
        return {
            "status": status,
            "adapters": adapters,
            "load": load,
            "router": listed,
            "with_adapter": with_adapter,
            "base": base,
        }
    finally:
        for channel in channels.values():
            await channel.close()


def test_a_lora_run_publishes_and_serves_the_adapter_alone(tmp_path: pathlib.Path) -> None:
    config, run_dir, out = tmp_path / "lora.toml", tmp_path / "run", tmp_path / "launcher.out"
    config.write_text(launch_file())
    with live_runs.primerl_up(config, run_dir, out) as launcher:
        started = live_runs.services_of(launcher, run_dir, out, timeout_s=600)
        seen = asyncio.run(watch_adapter_versions(started, launcher=launcher, out=out))
        assert launcher.wait(600) == 0, live_runs.printed(out)

    # Only the adapter was ever published: the base weights stay the replica's own.
    assert seen["status"].latest_policy_version == -1
    [adapter] = seen["adapters"]
    assert adapter.name == ADAPTER and adapter.rank == 8 and adapter.policy_version >= 2
    assert adapter.target_modules  # derived from the published tensors' PEFT names
    assert seen["load"].adapter_versions[ADAPTER] >= 2 and seen["load"].policy_version == 0
    # The adapter changes what the replica samples: it is applied, not a no-op.
    with_adapter, base = seen["with_adapter"], seen["base"]
    assert all(version >= 2 for version in with_adapter.policy_versions)
    assert all(version == 0 for version in base.policy_versions)
    assert (
        list(with_adapter.token_ids) != list(base.token_ids)
        or max(abs(a - b) for a, b in zip(with_adapter.logprobs, base.logprobs, strict=True)) > 1e-3
    )
    [routed] = seen["router"]
    assert routed.load.adapter_versions[ADAPTER] >= 2

    records = live_runs.read_records(run_dir)
    assert [record["step"] for record in records] == list(range(1, MAX_STEPS + 1))
    for record in records:
        trainer = record["trainer"]
        assert trainer["published"] == 1.0 and trainer["num_samples"] >= 1
        # vLLM applied the adapter the trainer had: ~4e-12 measured (logprobs within ~3e-6), where
        # the adapter moves logprobs by ~0.1-1 (greedy tokens differ from the first one).
        assert abs(record["mismatch_kl"]) < 1e-9, record
    # Rollouts were sampled by adapter versions (the orchestrator followed them), not stuck at 0.
    assert records[-1]["orchestrator"]["max_policy_version"] >= MAX_STEPS - 2
