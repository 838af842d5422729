"""Kill the trainer after a checkpoint, start it again: it resumes at the checkpoint's step and
the next steps' losses equal an uninterrupted run's. A graceful stop saves the last step."""

from __future__ import annotations

import pathlib
import sys

import pytest

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_trainer.batch import MicroBatch

from .serving import assert_metrics_equal, config_toml, push, reference_metrics, serving, trainer_config, watch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


async def test_killed_after_a_checkpoint_the_restarted_trainer_continues_as_if_uninterrupted(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], tmp_path: pathlib.Path
) -> None:
    expected = reference_metrics(dense_dir, rl_batches[:4])
    port = free_port()
    config_path = tmp_path / "trainer.toml"
    config_path.write_text(
        config_toml(
            trainer_config(
                dense_dir, server={"port": port}, checkpoint={"dir": str(tmp_path / "checkpoints"), "interval": 2}
            )
        )
    )
    args = [sys.executable, "-m", "primerl_trainer", "-c", str(config_path)]

    first = await ServiceProcess(args, port=port, env={"OMP_NUM_THREADS": "1"}).start()
    try:
        async with make_channel(first.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            for step, batch in enumerate(rl_batches[:3], start=1):
                await push(stub, step, batch)
            killed_steps = await watch(stub, after_step=0, count=3)
            assert (await stub.GetStatus(trainer_pb2.GetStatusRequest())).last_checkpoint_step == 2
        first.kill()  # no graceful stop: step 3 is lost with the process
        await first.wait()
    finally:
        await first.stop()

    second = await ServiceProcess(args, port=port, env={"OMP_NUM_THREADS": "1"}).start()
    try:
        async with make_channel(second.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            assert (await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())).next_step == 3
            status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
            assert (status.step, status.last_checkpoint_step) == (2, 2)
            await push(stub, 3, rl_batches[2])
            await push(stub, 4, rl_batches[3])
            resumed = await watch(stub, after_step=2, count=2)
    finally:
        await second.stop()
    assert [s.step for s in resumed] == [3, 4]
    # Bit for bit the step the killed process had taken, and the uninterrupted run's after it.
    assert resumed[0].metrics["loss"] == killed_steps[2].metrics["loss"]
    assert resumed[0].metrics["grad_norm"] == killed_steps[2].metrics["grad_norm"]
    for got, wanted in zip(resumed, expected[2:], strict=True):
        assert_metrics_equal(got, wanted)


async def test_a_graceful_stop_saves_the_last_step(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], tmp_path: pathlib.Path
) -> None:
    expected = reference_metrics(dense_dir, rl_batches[:4])
    config = trainer_config(dense_dir, checkpoint={"dir": str(tmp_path), "interval": 2})
    async with serving(config) as stub:
        for step, batch in enumerate(rl_batches[:3], start=1):
            await push(stub, step, batch)
        await watch(stub, after_step=0, count=3)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"

    async with serving(config) as stub:
        status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
        assert (status.step, status.last_checkpoint_step) == (3, 3)
        await push(stub, 4, rl_batches[3])
        (step,) = await watch(stub, after_step=3, count=1)
    assert_metrics_equal(step, expected[3])

    # resume = false starts over from the model folder.
    fresh = trainer_config(dense_dir, checkpoint={"dir": str(tmp_path), "resume": False})
    async with serving(fresh) as stub:
        assert (await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())).next_step == 1
