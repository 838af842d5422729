"""A trainer with runs on two ranks (torchrun, gloo on the CPU): rank 0 serves gRPC and tells rank 1
every operation on the runs (run_ops.py); runs of different ranks train as each trained alone, a
run's checkpoint is saved, a run is deleted, publishes (to a broadcaster that is down) gather on
both ranks, and a restarted two-rank trainer has the runs back."""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port

from . import test_run_service
from .serving import push, start_on_two_ranks, watch
from .test_run_service import NUM_STEPS, SPECS, _push_all, runs_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# The runs' batches, and each run trained alone, as the one-rank tests have them.
batches = test_run_service.batches
alone = test_run_service.alone
RUN_IDS = ("alpha-run", "beta-run")
# What data parallelism changes in a loss (the sums of the ranks' micro-batches), as test_distributed_service.
TOLERANCE = {"rel": 1e-5, "abs": 1e-5}


async def _losses(stub, run_id: str, run_batches, *, first_step: int) -> list[float]:
    await _push_all(stub, run_id, run_batches, first_step=first_step)
    steps = await watch(stub, after_step=first_step - 1, count=len(run_batches), run_id=run_id)
    return [step.metrics["loss"] for step in steps]


def _check_stopped(process: ServiceProcess) -> None:
    output = process.output()
    process.close()
    assert "stopped trainer" in output and "rank 1 stopped" in output, output[-5000:]
    assert "ChildFailedError" not in output, output[-5000:]
    # No operation failed on rank 1 (run_ops.follow_runs logs each one that does).
    assert "(as on rank 0)" not in output, output[-5000:]


async def test_runs_on_two_ranks_train_as_alone_and_survive_a_restart(
    dense_dir: pathlib.Path, batches, alone, tmp_path: pathlib.Path
) -> None:
    half = NUM_STEPS // 2
    # Publishes go to a port nobody listens on: both ranks still gather for each, and retries.
    unreachable = {
        "weight_broadcaster": f"127.0.0.1:{free_port()}",
        "kind": "adapter",
        "initial_backoff_s": 0.05,
        "max_backoff_s": 0.2,
    }
    config = runs_config(
        dense_dir,
        server={"port": free_port()},
        observability={"log_level": "INFO"},
        checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2},
        publish=unreachable,
    )
    runs_dir = tmp_path / "ckpt" / "runs"
    losses: dict[str, list[float]] = {}
    process = await start_on_two_ranks(config, tmp_path)
    try:
        async with make_channel(process.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            served = await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())
            assert served.info.attributes["world_size"] == "2"
            for run_id in (*RUN_IDS, "gamma-run"):
                await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=SPECS[run_id]))
            # A run trained a step, then deleted: gone on both ranks, its folder too.
            await push(stub, 1, batches["gamma-run"][0], run_id="gamma-run")
            await watch(stub, after_step=0, count=1, run_id="gamma-run")
            await stub.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="gamma-run"))
            assert not (runs_dir / "gamma-run").exists()

            fed = await asyncio.gather(*(_losses(stub, r, batches[r][:half], first_step=1) for r in RUN_IDS))
            losses = dict(zip(RUN_IDS, fed, strict=True))
            saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="beta-run"))
            assert saved.step == half and (runs_dir / "beta-run" / f"step_{half:08d}").is_dir()
            listed = (await stub.ListRuns(trainer_pb2.ListRunsRequest())).runs
            assert {run.run_id: run.step for run in listed} == dict.fromkeys(RUN_IDS, half)
            await asyncio.sleep(0.5)  # a few publish retries
            assert "UNAVAILABLE" in (await stub.GetRun(trainer_pb2.GetRunRequest(run_id="alpha-run"))).run.error
    finally:
        await process.stop()
    _check_stopped(process)

    # Restarted: beta at the checkpoint asked for, alpha at the one its graceful stop saved.
    process = await start_on_two_ranks(config, tmp_path)
    try:
        async with make_channel(process.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            listed = (await stub.ListRuns(trainer_pb2.ListRunsRequest())).runs
            assert {run.run_id: (run.step, run.last_checkpoint_step) for run in listed} == dict.fromkeys(
                RUN_IDS, (half, half)
            )
            resumed = await asyncio.gather(*(_losses(stub, r, batches[r][half:], first_step=half + 1) for r in RUN_IDS))
            for run_id, more in zip(RUN_IDS, resumed, strict=True):
                losses[run_id] += more
    finally:
        await process.stop()
    _check_stopped(process)
    for run_id in RUN_IDS:
        assert losses[run_id] == pytest.approx(alone[run_id][0], **TOLERANCE), run_id


@pytest.fixture(autouse=True)
def _no_inherited_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name in os.environ:
            monkeypatch.delenv(name)
