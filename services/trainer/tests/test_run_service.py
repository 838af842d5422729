"""A trainer with runs (runs.max_concurrent_runs > 0) through its real stub, in-process on port 0:
runs of different ranks, seeds, optimizers and tasks fed at once each train as the run trained
alone; turns go round so no run starves; one run's bad batch or crash leaves the others stepping;
runs survive a restart; quotas refuse naming the quota; a tenant can use only its own runs."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.testing import eventually, in_process_service
from primerl_trainer.batch import MicroBatch
from primerl_trainer.config import LoRAConfig
from primerl_trainer.lora import apply_lora
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig
from primerl_trainer.run_checkpoint import RunCheckpoints
from primerl_trainer.runs import RunConfig, RunSet
from primerl_trainer.server import build

from .serving import broadcaster_process, push, serving, trainer_config, watch
from .tiny_training import (
    LORA_TARGETS,
    batch_spec,
    load_tiny_model,
    runs_batches,
    train_lora_alone,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

NUM_STEPS = 6
ATOL = 1e-5
SFT = trainer_pb2.TRAINING_MODE_SFT
SPECS = {
    "alpha-run": trainer_pb2.RunSpec(lora_rank=2, lora_alpha=4.0, seed=1, learning_rate=2e-3),
    "beta-run": trainer_pb2.RunSpec(lora_rank=4, lora_alpha=16.0, seed=2, max_grad_norm=0.05, warmup_steps=2),
    # Another task: supervised fine-tuning.
    "gamma-run": trainer_pb2.RunSpec(lora_rank=8, lora_alpha=8.0, seed=3, mode=SFT, weight_decay=0.0),
}


def runs_config(model_dir: pathlib.Path, **overrides: Any):
    return trainer_config(
        model_dir,
        lora={"enabled": True, "rank": 8, "alpha": 16.0},
        runs={"max_concurrent_runs": 4} | overrides.pop("runs", {}),
        **overrides,
    )


def _run_config(spec: trainer_pb2.RunSpec) -> RunConfig:
    """What the trainer (trainer_config's optimizer and schedule) trains the run with."""
    return RunConfig(
        rank=spec.lora_rank,
        alpha=spec.lora_alpha,
        seed=spec.seed,
        optimizer=OptimizerConfig(
            lr=spec.learning_rate if spec.HasField("learning_rate") else 1e-3,
            weight_decay=spec.weight_decay if spec.HasField("weight_decay") else 0.01,
            max_grad_norm=spec.max_grad_norm if spec.HasField("max_grad_norm") else 1.0,
        ),
        schedule=LRScheduleConfig(
            decay="cosine",
            warmup_steps=spec.warmup_steps if spec.HasField("warmup_steps") else 1,
            total_steps=8,
            min_lr_ratio=0.1,
        ),
        mode="sft" if spec.mode == SFT else "rl",
    )


@pytest.fixture(scope="module")
def batches(dense_dir: pathlib.Path) -> dict[str, list[list[MicroBatch]]]:
    """Each run's own batches (its own task's data)."""
    return runs_batches(
        dense_dir, {run_id: "sft" if spec.mode == SFT else "rl" for run_id, spec in SPECS.items()}, num_steps=NUM_STEPS
    )


@pytest.fixture(scope="module")
def alone(dense_dir: pathlib.Path, batches) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {run_id: train_lora_alone(dense_dir, _run_config(spec), batches[run_id]) for run_id, spec in SPECS.items()}


async def _push_all(stub, run_id: str, run_batches: list[list[MicroBatch]], first_step: int = 1) -> None:
    """Push the batches as the run's steps from `first_step`, waiting while its queue is full."""
    for step, batch in enumerate(run_batches, first_step):
        while True:
            try:
                await push(stub, step, batch, run_id=run_id)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(0.05)


async def _run(stub, run_id: str) -> trainer_pb2.Run:
    return (await stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id))).run


def _reason(error: grpc.aio.AioRpcError) -> str:
    return next((d.reason for d in error_details(error) if hasattr(d, "reason")), "")


async def test_runs_fed_at_once_each_train_as_alone_and_survive_a_restart(
    dense_dir: pathlib.Path, batches, alone, tmp_path: pathlib.Path
) -> None:
    config = runs_config(dense_dir, checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2})
    half = NUM_STEPS // 2
    async with serving(config) as stub:
        for run_id, spec in SPECS.items():
            created = (await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=spec))).run
            assert (created.state, created.step, created.next_step, created.owner) == (
                trainer_pb2.RUN_STATE_ACTIVE,
                0,
                1,
                "local",
            )
        spec = await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest(run_id="gamma-run"))
        assert (spec.lora_adapter, spec.mode, spec.next_step) == ("gamma-run", SFT, 1)

        async def feed(run_id: str) -> list[float]:
            await _push_all(stub, run_id, batches[run_id][:half])
            return [step.metrics["loss"] for step in await watch(stub, after_step=0, count=half, run_id=run_id)]

        losses = dict(zip(SPECS, await asyncio.gather(*(feed(run_id) for run_id in SPECS)), strict=True))
        listed = (await stub.ListRuns(trainer_pb2.ListRunsRequest())).runs
        assert {run.run_id: (run.step, run.next_step) for run in listed} == {r: (half, half + 1) for r in SPECS}
        saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="beta-run"))
        assert saved.step == half
    # A new trainer on the same checkpoint folder has the runs back, each at its latest checkpoint.
    async with serving(config) as stub:
        runs = {run.run_id: run for run in (await stub.ListRuns(trainer_pb2.ListRunsRequest())).runs}
        assert set(runs) == set(SPECS)
        for run_id, run in runs.items():
            assert (run.step, run.last_checkpoint_step, run.spec.lora_rank) == (half, half, SPECS[run_id].lora_rank)

        async def resume(run_id: str) -> list[float]:
            await _push_all(stub, run_id, batches[run_id][half:], first_step=half + 1)
            steps = await watch(stub, after_step=half, count=NUM_STEPS - half, run_id=run_id)
            return [step.metrics["loss"] for step in steps]

        for run_id, more in zip(SPECS, await asyncio.gather(*(resume(r) for r in SPECS)), strict=True):
            losses[run_id] += more
        for run_id in SPECS:
            final = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id=run_id))
            assert final.step == NUM_STEPS
    # Each run's adapter, as its checkpoint holds it, is the one the run trained alone has.
    model = load_tiny_model(dense_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=8, alpha=16.0, target_modules=LORA_TARGETS))
    run_set = RunSet(model, spec=batch_spec(model), device=torch.device("cpu"))
    checkpoints = RunCheckpoints(tmp_path / "ckpt" / "runs")
    for run_id, (alone_losses, alone_adapter) in alone.items():
        assert losses[run_id] == pytest.approx(alone_losses, rel=0, abs=ATOL), run_id
        run_set.add_run(run_id, _run_config(SPECS[run_id]))
        assert checkpoints.load_latest(run_id, run_set) == NUM_STEPS
        adapter = run_set.adapter_tensors(run_id)
        assert adapter.keys() == alone_adapter.keys()
        for name, tensor in adapter.items():
            torch.testing.assert_close(tensor, alone_adapter[name], rtol=0, atol=ATOL, msg=f"{run_id} {name}")


async def test_turns_go_round_so_no_run_starves(dense_dir: pathlib.Path, batches) -> None:
    """A run with batches queued waits for at most one step of each other run, however many the
    others have queued."""
    async with serving(runs_config(dense_dir)) as stub:
        for run_id in ("alpha-run", "beta-run"):
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=SPECS[run_id]))
            await stub.PauseRun(trainer_pb2.PauseRunRequest(run_id=run_id))
        await _push_all(stub, "alpha-run", batches["alpha-run"][:3])
        await _push_all(stub, "beta-run", batches["beta-run"][:2])
        paused = await _run(stub, "alpha-run")
        assert (paused.state, paused.num_queued_batches, paused.step) == (trainer_pb2.RUN_STATE_PAUSED, 3, 0)
        await stub.ResumeRun(trainer_pb2.ResumeRunRequest(run_id="alpha-run"))
        await stub.ResumeRun(trainer_pb2.ResumeRunRequest(run_id="beta-run"))
        finished = []
        for run_id, count in (("alpha-run", 3), ("beta-run", 2)):
            for step in await watch(stub, after_step=0, count=count, run_id=run_id):
                finished.append((step.finished_at.ToNanoseconds(), run_id, step.step))
    order = [(run_id, step) for _, run_id, step in sorted(finished)]
    assert order == [("alpha-run", 1), ("beta-run", 1), ("alpha-run", 2), ("beta-run", 2), ("alpha-run", 3)]
    # Each run's progress is in the trainer's metrics, by run.
    assert REGISTRY.get_sample_value("primerl_trainer_run_step", {"run": "alpha-run"}) == 3
    assert REGISTRY.get_sample_value("primerl_trainer_run_step", {"run": "beta-run"}) == 2
    assert REGISTRY.get_sample_value("primerl_trainer_runs", {"state": "active"}) == 2


async def test_one_runs_bad_batch_or_crash_fails_that_run_alone(
    dense_dir: pathlib.Path, batches, alone, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = RunSet.train_step
    crash = {"beta-run"}

    def train_step(self: RunSet, run_id: str, *args, **kwargs):
        if run_id in crash:
            raise RuntimeError("out of memory (injected)")
        return real_step(self, run_id, *args, **kwargs)

    monkeypatch.setattr(RunSet, "train_step", train_step)
    async with serving(runs_config(dense_dir)) as stub:
        for run_id in ("alpha-run", "beta-run"):
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=SPECS[run_id]))
        # NaN advantages: refused at the door, naming the field; nothing of the run changes.
        nan_batch = [
            dataclasses.replace(mb, advantages=torch.full_like(mb.advantages, math.nan))
            for mb in batches["beta-run"][0]
        ]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(stub, 1, nan_batch, run_id="beta-run")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "advantages" in refused.value.details()
        # A crash in its step fails beta alone (its queue dropped); alpha trains all its steps.
        await _push_all(stub, "beta-run", batches["beta-run"][:1])
        await _push_all(stub, "alpha-run", batches["alpha-run"][:3])

        async def beta_failed() -> bool:
            return (await _run(stub, "beta-run")).state == trainer_pb2.RUN_STATE_FAILED

        await eventually(beta_failed, what="beta-run failed")
        alpha_steps = await watch(stub, after_step=0, count=3, run_id="alpha-run")
        assert [s.metrics["loss"] for s in alpha_steps] == pytest.approx(alone["alpha-run"][0][:3], rel=0, abs=ATOL)
        failed = await _run(stub, "beta-run")
        assert (failed.step, failed.next_step, failed.num_queued_batches) == (0, 1, 0)
        assert "out of memory (injected)" in failed.error
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(stub, 1, batches["beta-run"][0], run_id="beta-run")
        assert (refused.value.code(), _reason(refused.value)) == (grpc.StatusCode.FAILED_PRECONDITION, "RUN_FAILED")
        # Its update never began: resumed, it takes the step again and trains as alone.
        crash.clear()
        resumed = (await stub.ResumeRun(trainer_pb2.ResumeRunRequest(run_id="beta-run"))).run
        assert (resumed.state, resumed.next_step) == (trainer_pb2.RUN_STATE_ACTIVE, 1)
        await _push_all(stub, "beta-run", batches["beta-run"][:2])
        beta_steps = await watch(stub, after_step=0, count=2, run_id="beta-run")
        assert [s.metrics["loss"] for s in beta_steps] == pytest.approx(alone["beta-run"][0][:2], rel=0, abs=ATOL)


async def test_quotas_refuse_naming_the_quota(dense_dir: pathlib.Path, batches) -> None:
    batch = batches["alpha-run"][0]
    num_tokens = sum(mb.input_ids.numel() for mb in batch)
    quota = {"max_runs": 2, "max_lora_rank": 4, "max_tokens_per_step": num_tokens - 1}
    config = runs_config(dense_dir, runs={"max_concurrent_runs": 3, "tenant_quotas": {"local": quota}})
    async with serving(config) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id="big", spec=trainer_pb2.RunSpec(lora_rank=8)))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "runs.tenant_quotas.local.max_lora_rank" in refused.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id="huge", spec=trainer_pb2.RunSpec(lora_rank=9)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lora.rank" in refused.value.details()
        for run_id in ("one", "two"):
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=trainer_pb2.RunSpec(lora_rank=2)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id="three", spec=trainer_pb2.RunSpec(lora_rank=2)))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "runs.tenant_quotas.local.max_runs" in refused.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(stub, 1, batch, run_id="one")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "runs.tenant_quotas.local.max_tokens_per_step" in refused.value.details()
        assert (await _run(stub, "one")).num_queued_batches == 0
        await stub.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="two"))
        await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id="three", spec=trainer_pb2.RunSpec(lora_rank=2)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id="one", spec=trainer_pb2.RunSpec(lora_rank=2)))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_a_trainer_of_one_run_refuses_run_ids(dense_dir: pathlib.Path, rl_batches) -> None:
    async with serving(trainer_config(dense_dir)) as stub:
        for call in (
            stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest(run_id="x")),
            push(stub, 1, rl_batches[0], run_id="x"),
            stub.CreateRun(trainer_pb2.CreateRunRequest(run_id="x", spec=trainer_pb2.RunSpec(lora_rank=2))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert (refused.value.code(), _reason(refused.value)) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "RUNS_DISABLED",
            )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("run-certs")
    authority = make_authority(directory)
    make_certificate(authority, directory, Holder("trainer", ("trainer",)), hosts=["127.0.0.1", "localhost"])
    for name in ("alice", "bob"):
        make_certificate(authority, directory, Holder(name, ("tenant", "orchestrator")))
    make_certificate(authority, directory, Holder("ops", ("operator",)))
    return directory


async def test_a_tenant_may_use_only_its_own_runs(dense_dir: pathlib.Path, rl_batches, certs: pathlib.Path) -> None:
    config = runs_config(dense_dir, tls=tls_of(certs, "trainer").model_dump())
    async with in_process_service(await build(config), config, client_tls=tls_of(certs, "ops")) as served:
        stubs = {}
        channels = []
        for name in ("alice", "bob", "ops"):
            channels.append(make_channel(served.address, tls=tls_of(certs, name), max_attempts=1))
            stubs[name] = trainer_pb2_grpc.TrainerServiceStub(channels[-1])
        alice, bob, ops = stubs["alice"], stubs["bob"], stubs["ops"]
        try:
            run = (await alice.CreateRun(trainer_pb2.CreateRunRequest(run_id="a1", spec=SPECS["alpha-run"]))).run
            assert run.owner == "alice"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await bob.CreateRun(trainer_pb2.CreateRunRequest(run_id="b1", spec=SPECS["alpha-run"], owner="alice"))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await push(alice, 1, rl_batches[0], run_id="a1")
            calls = {
                "GetRun": lambda s: s.GetRun(trainer_pb2.GetRunRequest(run_id="a1")),
                "PauseRun": lambda s: s.PauseRun(trainer_pb2.PauseRunRequest(run_id="a1")),
                "ResumeRun": lambda s: s.ResumeRun(trainer_pb2.ResumeRunRequest(run_id="a1")),
                "DeleteRun": lambda s: s.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="a1")),
                "GetBatchSpec": lambda s: s.GetBatchSpec(trainer_pb2.GetBatchSpecRequest(run_id="a1")),
                "PushBatch": lambda s: push(s, 2, rl_batches[1], run_id="a1"),
                "GetStatus": lambda s: s.GetStatus(trainer_pb2.GetStatusRequest(run_id="a1")),
                "WatchSteps": lambda s: watch(s, after_step=0, count=1, run_id="a1"),
                "SaveCheckpoint": lambda s: s.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="a1")),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(bob)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert "a1" in refused.value.details(), name
            assert (await bob.ListRuns(trainer_pb2.ListRunsRequest())).runs == []
            # The run is as alice left it: its step trained, nothing of bob's queued or changed.
            steps = await watch(alice, after_step=0, count=1, run_id="a1")
            assert [s.step for s in steps] == [1]
            mine = (await alice.GetRun(trainer_pb2.GetRunRequest(run_id="a1"))).run
            assert (mine.state, mine.step, mine.next_step) == (trainer_pb2.RUN_STATE_ACTIVE, 1, 2)
            # An operator sees and steers every run.
            assert [r.run_id for r in (await ops.ListRuns(trainer_pb2.ListRunsRequest())).runs] == ["a1"]
            await ops.PauseRun(trainer_pb2.PauseRunRequest(run_id="a1"))
            await alice.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="a1"))
        finally:
            for channel in channels:
                await channel.close()


async def test_each_run_publishes_its_adapter_and_a_deleted_runs_adapter_leaves(
    dense_dir: pathlib.Path, batches
) -> None:
    """A real weight broadcaster gets each run's adapter, named by the run id, at the run's own
    steps (version 0 when it is created: replicas start without it); DeleteRun removes it."""
    async with broadcaster_process() as broadcaster, make_channel(broadcaster.address, max_attempts=1) as channel:
        adapters = wb_pb2_grpc.WeightBroadcasterServiceStub(channel)

        async def published() -> dict[str, int]:
            return dict((await adapters.GetStatus(wb_pb2.GetStatusRequest())).latest_adapter_versions)

        publish = {"weight_broadcaster": broadcaster.address, "kind": "adapter", "check_interval_s": 0.2}
        async with serving(runs_config(dense_dir, publish=publish)) as stub:
            for run_id in ("alpha-run", "beta-run"):
                await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=SPECS[run_id]))
            await eventually(lambda: _equal(published(), {"alpha-run": 0, "beta-run": 0}), what="both at version 0")
            await _push_all(stub, "alpha-run", batches["alpha-run"][:2])
            await _push_all(stub, "beta-run", batches["beta-run"][:1])
            await eventually(lambda: _equal(published(), {"alpha-run": 2, "beta-run": 1}), what="each at its step")
            assert (await _run(stub, "alpha-run")).published_policy_version == 2
            await stub.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="beta-run"))
            assert await published() == {"alpha-run": 2}


async def _equal(got, wanted) -> bool:
    return await got == wanted
