"""The trainer service publishing over a collective group (publish.transport = "collective", gloo
on CPU) through a real broadcaster to two real inference replicas: each replica serves every
new version with the logprobs of the trainer's own model at that version; a replica killed in
the middle of a broadcast neither hangs the trainer nor keeps the other replica off the version,
and comes back on it once restarted."""

from __future__ import annotations

import asyncio
import pathlib
import time

import pytest
import torch

from primerl.trainer.v1 import trainer_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.processes import free_port
from primerl_common.testing import eventually
from primerl_common.weights import collective
from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer import publish
from services.trainer.tests.serving import push, reference_trainer, serving, trainer_config, watch
from services.trainer.tests.tiny_training import load_tiny_model, make_samples, pack_into, reference_logprobs
from services.weight_broadcaster.tests.helpers import wait_for

from .replicas import PROMPTS, START_TIMEOUT_S, TOLERANCE, logprobs, replica, served_version
from .test_collective_replicas import COLLECTIVE, _answered, broadcaster, register

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

NUM_STEPS = 3


def _batches(model_dir: pathlib.Path):
    model = load_tiny_model(model_dir)
    with torch.no_grad():
        return [pack_into(make_samples(model, seed=20 + step, num_samples=4), 2) for step in range(NUM_STEPS)]


def _reference(model_dir: pathlib.Path, batches) -> list[list[float]]:
    """The prompt logprobs of PROMPTS at each version 0..NUM_STEPS, by a plain Trainer (no
    service) trained on the same batches with the same config."""
    trainer = reference_trainer(model_dir)

    def scored() -> list[float]:
        model = trainer.model
        return [x for prompt in PROMPTS for x in reference_logprobs(model, torch.tensor(prompt), 1.0)[1:].tolist()]

    versions = [scored()]
    for batch in batches:
        trainer.train_step(batch)
        versions.append(scored())
    return versions


async def _published(trainer, policy_version: int) -> bool:
    status = await trainer.GetStatus(trainer_pb2.GetStatusRequest())
    return (status.published_policy_version, status.last_publish_error) == (policy_version, "")


def _difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_the_trainer_publishes_over_a_collective_and_survives_a_replica_killed_mid_broadcast(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    model_dir = make_tiny_model(tmp_path / "tiny-dense", kind="dense", dtype="float32")
    batches = _batches(model_dir)
    reference = await asyncio.to_thread(_reference, model_dir, batches)
    a, b = replica(model_dir, free_port()), replica(model_dir, free_port())
    started = [a, b]
    try:
        await asyncio.gather(a.start(START_TIMEOUT_S), b.start(START_TIMEOUT_S))
        # A probe that times out on a busy machine would take a replica out of the next group.
        async with broadcaster(push={"probe_timeout_s": 30.0}) as (stub, address):
            await register(stub, "a", a.address, pb2.TRANSPORT_NCCL)
            await register(stub, "b", b.address, pb2.TRANSPORT_NCCL)
            await eventually(lambda: _answered(stub, "a", "b"))
            config = trainer_config(
                model_dir,
                publish={
                    "weight_broadcaster": address,
                    "transport": "collective",
                    "initial_backoff_s": 0.2,
                    "check_interval_s": 0.2,
                },
            )
            async with serving(config) as trainer:
                # Versions 1 and 2 go to both replicas over the group alone: the broadcaster gets no data.
                for step in (1, 2):
                    await push(trainer, step, batches[step - 1])
                    await watch(trainer, after_step=step - 1, count=1)
                    status = await trainer.GetStatus(trainer_pb2.GetStatusRequest())
                    assert (status.published_policy_version, status.last_publish_error) == (step, "")
                    await wait_for(stub, step, 2, timeout_s=120)
                    for process in (a, b):
                        served = await logprobs(process, completion=False)
                        assert _difference(served, reference[step]) <= TOLERANCE
                        assert _difference(served, reference[step - 1]) > 10 * TOLERANCE
                broadcaster_status = await stub.GetStatus(pb2.GetStatusRequest())
                assert all(r.num_bytes_sent_total == 0 for r in broadcaster_status.replicas)

                # b dies (its service and engine processes) while version 3 is broadcast to it: once
                # the first bucket went out, before the second goes.
                killed = []

                def kill_b_after_the_first_bucket(group, spec, specs, named_tensors):
                    second = collective.buckets(specs, spec.bucket_bytes)[1][0][0]

                    def source():
                        for index, item in enumerate(named_tensors):
                            if index == second and not killed:
                                # A replica dying whole: the service and vLLM's engine process.
                                b.kill(with_children=True)
                                assert b.popen is not None
                                b.popen.wait()
                                killed.append(time.monotonic())
                            yield item

                    return collective.send_tensors(group, spec, specs, source())

                monkeypatch.setattr(publish, "send_tensors", kill_b_after_the_first_bucket)
                await push(trainer, 3, batches[2])
                await watch(trainer, after_step=2, count=1)
                # The step ended at once: the broadcast failed on b's death, not on the group's timeout.
                assert killed and time.monotonic() - killed[0] < COLLECTIVE["timeout_s"] / 2
                # The trainer's retry sends the data to the broadcaster: a ends on version 3 (over the
                # group, or pushed over gRPC if the failure cut its receive short), and so does b
                # once restarted.
                await wait_for(stub, 3, 1, timeout_s=120)
                assert _difference(await logprobs(a, completion=False), reference[3]) <= TOLERANCE
                await eventually(lambda: _published(trainer, 3))

                b = replica(model_dir, b.port)
                started.append(b)
                await b.start(START_TIMEOUT_S)
                await wait_for(stub, 3, 2, timeout_s=120)
                assert await served_version(b) == 3
                assert _difference(await logprobs(b, completion=False), reference[3]) <= TOLERANCE
    finally:
        await asyncio.gather(*(process.stop() for process in started))
