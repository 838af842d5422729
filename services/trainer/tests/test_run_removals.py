"""A deleted run's adapter leaves the weight broadcaster even when the broadcaster is down at
DeleteRun: the removal is retried until the broadcaster confirms it, across a trainer restart too
(checkpoint.dir keeps it); while it is pending, the trainer's status names it, ListRuns leaves the
run out, and CreateRun of the same id is refused UNAVAILABLE naming it, then creates a run whose
new adapter stays once the removal went through. The broadcaster is the real one, restarted on
its spill folder (so that it holds the deleted run's adapter again when it is back)."""

from __future__ import annotations

import pathlib
import sys

import grpc
import pytest

from primerl.trainer.v1 import trainer_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.testing import eventually

from .serving import serving, trainer_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def broadcaster_process(port: int, spill_folder: pathlib.Path) -> ServiceProcess:
    """The real weight broadcaster (its binary) on `port`, spilling to `spill_folder`: a new
    process for each `async with`, the same address and folder every time (its output appended
    to broadcaster.log beside the folder)."""
    flags = [
        f"--server.port={port}",
        "--server.host=127.0.0.1",
        "--server.drain_delay_s=0",
        f"--store.spill_folder={spill_folder}",
        "--observability.log_json=false",
    ]
    return ServiceProcess(
        [sys.executable, "-m", "primerl_weight_broadcaster", *flags],
        port=port,
        log_path=spill_folder.parent / "broadcaster.log",
    )


async def broadcaster_adapters(address: str) -> dict[str, int]:
    async with make_channel(address, max_attempts=1) as channel:
        status = await wb_pb2_grpc.WeightBroadcasterServiceStub(channel).GetStatus(wb_pb2.GetStatusRequest())
    return dict(status.latest_adapter_versions)


async def holds(address: str, wanted: dict[str, int]) -> bool:
    try:
        return await broadcaster_adapters(address) == wanted
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False  # (re)connecting: asked again


async def pending_note(stub) -> str:
    return (await stub.GetStatus(trainer_pb2.GetStatusRequest())).last_publish_error


async def run_ids(stub) -> list[str]:
    return [run.run_id for run in (await stub.ListRuns(trainer_pb2.ListRunsRequest())).runs]


SPECS = {
    "alpha-run": trainer_pb2.RunSpec(lora_rank=2, lora_alpha=4.0, seed=1),
    "beta-run": trainer_pb2.RunSpec(lora_rank=4, lora_alpha=16.0, seed=2),
}


def removals_config(dense_dir: pathlib.Path, tmp_path: pathlib.Path, port: int):
    publish = {
        "weight_broadcaster": f"127.0.0.1:{port}",
        "kind": "adapter",
        "check_interval_s": 0.2,
        "initial_backoff_s": 0.2,
        "max_backoff_s": 1.0,
        "timeout_s": 10.0,
    }
    return trainer_config(
        dense_dir,
        lora={"enabled": True, "rank": 8, "alpha": 16.0},
        runs={"max_concurrent_runs": 4},
        publish=publish,
        checkpoint={"dir": str(tmp_path / "checkpoints")},
    )


async def create(stub, run_id: str) -> None:
    await stub.CreateRun(trainer_pb2.CreateRunRequest(run_id=run_id, spec=SPECS[run_id]))


async def test_a_removal_that_failed_is_retried_until_the_broadcaster_is_back(
    dense_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    port, spill = free_port(), tmp_path / "spill"
    address = f"127.0.0.1:{port}"
    async with serving(removals_config(dense_dir, tmp_path, port)) as stub:
        async with broadcaster_process(port, spill):
            for run_id in ("alpha-run", "beta-run"):
                await create(stub, run_id)
            await eventually(lambda: holds(address, {"alpha-run": 0, "beta-run": 0}), what="both published")
        assert (spill / "adapters" / "alpha-run").is_dir()  # the broadcaster holds it again when it is back
        # The broadcaster is down: the run is deleted all the same, its adapter's removal pending.
        await stub.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="alpha-run"))
        assert await run_ids(stub) == ["beta-run"]
        assert "alpha-run" in await pending_note(stub)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await create(stub, "alpha-run")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "'alpha-run'" in refused.value.details() and "not removed" in refused.value.details()
        assert error_details(refused.value)[0].reason == "ADAPTER_REMOVAL_PENDING"
        assert await run_ids(stub) == ["beta-run"]

        # Back, holding both adapters again (its spill folder): the deleted run's goes.
        async with broadcaster_process(port, spill):
            await eventually(lambda: holds(address, {"beta-run": 0}), what="the deleted run's adapter removed")

            async def nothing_pending() -> bool:
                return await pending_note(stub) == ""

            await eventually(nothing_pending, what="no removal pending")
            # The id is free again: the new run's adapter is published, and stays.
            await create(stub, "alpha-run")
            await eventually(lambda: holds(address, {"alpha-run": 0, "beta-run": 0}), what="the new run published")
            await stub.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="beta-run"))
            assert await broadcaster_adapters(address) == {"alpha-run": 0}
            assert await run_ids(stub) == ["alpha-run"]


async def test_a_pending_removal_survives_a_trainer_restart(dense_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    port, spill = free_port(), tmp_path / "spill"
    address = f"127.0.0.1:{port}"
    config = removals_config(dense_dir, tmp_path, port)
    async with serving(config) as stub:
        async with broadcaster_process(port, spill):
            for run_id in ("alpha-run", "beta-run"):
                await create(stub, run_id)
            await eventually(lambda: holds(address, {"alpha-run": 0, "beta-run": 0}), what="both published")
        await stub.DeleteRun(trainer_pb2.DeleteRunRequest(run_id="alpha-run"))
        assert "alpha-run" in await pending_note(stub)
    assert (spill / "adapters" / "alpha-run").is_dir()

    # Both come back: the restarted trainer finishes the removal, and keeps the other run.
    async with broadcaster_process(port, spill), serving(config) as stub:
        assert await run_ids(stub) == ["beta-run"]
        await eventually(lambda: holds(address, {"beta-run": 0}), what="the deleted run's adapter removed")

        async def nothing_pending() -> bool:
            return await pending_note(stub) == ""

        await eventually(nothing_pending, what="no removal pending")

    # ... for good: a trainer started again has nothing left to remove.
    async with broadcaster_process(port, spill), serving(config) as stub:
        assert await pending_note(stub) == ""
        await eventually(lambda: holds(address, {"beta-run": 0}), what="the other run's adapter kept")
