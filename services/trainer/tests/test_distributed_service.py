"""The trainer service on two ranks (torchrun, gloo on the CPU): rank 0 serves gRPC and hands
each pushed batch to rank 1 through torch.distributed; the steps equal one process's, and the
publishes' collective gathers keep both ranks in step when the broadcaster is down."""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import free_port
from primerl_trainer.batch import MicroBatch

from .serving import METRICS, push, serving, start_on_two_ranks, trainer_config, watch
from .tiny_training import load_tiny_model, make_samples, pack_into

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def batches(dense_dir: pathlib.Path) -> list[list[MicroBatch]]:
    """Three micro-batches per step: rank 0 trains two, rank 1 one and a loss-free filler."""
    model = load_tiny_model(dense_dir)
    return [pack_into(make_samples(model, seed=10 + seed, num_samples=5), 3) for seed in range(2)]


async def _train(stub: trainer_pb2_grpc.TrainerServiceStub, batches: list[list[MicroBatch]]):
    for step, batch in enumerate(batches, start=1):
        await push(stub, step, batch)
    return await watch(stub, after_step=0, count=len(batches))


async def test_two_ranks_train_pushed_batches_as_one_process(
    dense_dir: pathlib.Path, batches: list[list[MicroBatch]], tmp_path: pathlib.Path
) -> None:
    port = free_port()
    # Publishes go to a port nobody listens on: both ranks still gather for each (and for each
    # retry rank 0 orders), and training goes on.
    unreachable = {"weight_broadcaster": f"127.0.0.1:{free_port()}", "initial_backoff_s": 0.05, "max_backoff_s": 0.2}
    config = trainer_config(dense_dir, server={"port": port}, observability={"log_level": "INFO"}, publish=unreachable)
    process = await start_on_two_ranks(config, tmp_path)
    try:
        async with make_channel(process.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            info = (await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())).info
            assert info.attributes["world_size"] == "2"
            distributed = await _train(stub, batches)
            await asyncio.sleep(0.5)  # a few publish retries
            status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
            assert status.step == 2 and "UNAVAILABLE" in status.last_publish_error
    finally:
        await process.stop()
    output = process.output()
    process.close()
    assert "stopped trainer" in output and "rank 1 stopped" in output, output[-5000:]
    assert "ChildFailedError" not in output, output[-5000:]

    async with serving(config.model_copy(update={"server": config.server.model_copy(update={"port": 0})})) as stub:
        single = await _train(stub, batches)
    for got, wanted in zip(distributed, single, strict=True):
        # The second step's loss also checks the weights the first step left on both ranks.
        for key in METRICS:
            assert got.metrics[key] == pytest.approx(wanted.metrics[key], rel=1e-5, abs=1e-5), key


@pytest.fixture(autouse=True)
def _no_inherited_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name in os.environ:
            monkeypatch.delenv(name)
