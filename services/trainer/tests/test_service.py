"""The trainer service through its real stub, in-process on port 0: batches train in order and
as Trainer.train_step trains them, the queue is bounded and loses nothing, bad batches and
wrong steps are refused without a step being taken, and the service keeps going after each."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib
import threading
from collections.abc import Awaitable, Callable

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from primerl.trainer.v1 import trainer_pb2
from primerl_common.errors import error_details, field_violations
from primerl_trainer.batch import MicroBatch
from primerl_trainer.train import Trainer

from .serving import (
    assert_metrics_equal,
    micro_batch_to_proto,
    push,
    push_requests,
    reference_metrics,
    serving,
    trainer_config,
    watch,
)
from .tiny_training import load_tiny_model, make_samples, pack_into

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def expected(dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]]) -> list[dict[str, float]]:
    return reference_metrics(dense_dir, rl_batches)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def status(stub) -> trainer_pb2.GetStatusResponse:
    return await stub.GetStatus(trainer_pb2.GetStatusRequest())


async def test_pushed_batches_train_in_order_and_are_reported(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], expected: list[dict[str, float]]
) -> None:
    steps_before = _sample("primerl_trainer_steps_total")
    async with serving(trainer_config(dense_dir)) as stub:
        spec = await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
        assert (spec.seq_len, spec.vocab_size, spec.next_step, spec.max_queued_batches) == (128, 320, 1, 4)
        assert (spec.router_replay, spec.num_moe_layers, spec.num_hidden_layers) == (False, 0, 4)
        assert spec.mode == trainer_pb2.TRAINING_MODE_RL
        initial = await status(stub)
        assert (initial.step, initial.published_policy_version, initial.last_checkpoint_step) == (0, -1, -1)
        assert not initial.HasField("last_step")

        # A watcher from the start sees every step as it finishes.
        watcher = asyncio.ensure_future(watch(stub, after_step=-1, count=3))
        for step, batch in enumerate(rl_batches[:3], start=1):
            reply = await push(
                stub, step, batch, num_samples=4, min_policy_version=step - 1, max_policy_version=step - 1
            )
            assert (reply.step, reply.num_micro_batches) == (step, 2)
        steps = await watcher
        assert [s.step for s in steps] == [1, 2, 3]
        assert [s.policy_version for s in steps] == [1, 2, 3]
        for got, wanted in zip(steps, expected, strict=False):
            assert_metrics_equal(got, wanted)
        assert steps[2].metrics["num_samples"] == 4 and steps[2].metrics["off_policy_steps_max"] == 1
        assert steps[0].finished_at.seconds > 0

        after = await status(stub)
        assert (after.step, after.num_queued_batches, after.training) == (3, 0, False)
        assert after.last_step.step == 3 and after.last_step.metrics["loss"] == steps[2].metrics["loss"]
        assert (await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())).next_step == 4
        # A late watcher gets the remembered steps after the one it names.
        assert [s.step for s in await watch(stub, after_step=1, count=2)] == [2, 3]
    assert _sample("primerl_trainer_steps_total") == steps_before + 3
    assert _sample("primerl_trainer_step") == 3


@pytest.fixture
def gated_training(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Train steps wait until the returned event is set: the queue fills deterministically."""
    gate = threading.Event()
    original = Trainer.train_step

    def gated(self: Trainer, *args, **kwargs):
        assert gate.wait(60), "gate never opened"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", gated)
    return gate


async def _wait_until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not await predicate():  # noqa: ASYNC110 (polls the server: no local event to wait on)
            await asyncio.sleep(0.02)


async def test_a_full_queue_refuses_with_resource_exhausted_and_loses_nothing(
    dense_dir: pathlib.Path,
    rl_batches: list[list[MicroBatch]],
    expected: list[dict[str, float]],
    gated_training: threading.Event,
) -> None:
    async with serving(trainer_config(dense_dir, max_queued_batches=1)) as stub:
        await push(stub, 1, rl_batches[0])

        async def step_1_started() -> bool:
            current = await status(stub)
            return current.num_queued_batches == 0 and current.training

        await _wait_until(step_1_started)
        assert (await push(stub, 2, rl_batches[1])).num_queued_batches == 1
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(stub, 3, rl_batches[2])
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_batches" in error.value.details()
        current = await status(stub)
        assert (current.step, current.num_queued_batches) == (0, 1)
        assert (await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())).next_step == 3

        gated_training.set()
        await watch(stub, after_step=0, count=2)
        # The refused batch, pushed again, trains as step 3: nothing was lost or trained twice.
        await push(stub, 3, rl_batches[2])
        steps = await watch(stub, after_step=0, count=3)
        for got, wanted in zip(steps, expected, strict=False):
            assert_metrics_equal(got, wanted)


def _bad(field: str, index: int, value: float | int) -> Callable[[MicroBatch], MicroBatch]:
    def corrupt(micro_batch: MicroBatch) -> MicroBatch:
        tensor = getattr(micro_batch, field).clone()
        tensor[index] = value
        return dataclasses.replace(micro_batch, **{field: tensor})

    return corrupt


BAD_BATCHES: dict[str, tuple[Callable[[MicroBatch], MicroBatch], str]] = {
    "advantages one token short": (
        lambda mb: dataclasses.replace(mb, advantages=mb.advantages[:-1]),
        "micro_batch.advantages",
    ),
    "token id outside the vocabulary": (_bad("input_ids", 3, 320), "micro_batch.input_ids"),
    "negative token id": (_bad("input_ids", 3, -1), "micro_batch.input_ids"),
    "NaN advantage": (_bad("advantages", 5, float("nan")), "micro_batch.advantages"),
    "infinite inference logprob": (_bad("inference_logprobs", 5, float("-inf")), "micro_batch.inference_logprobs"),
    "missing advantages": (lambda mb: dataclasses.replace(mb, advantages=None), "micro_batch.advantages"),
}


async def test_bad_batches_are_refused_naming_the_field_and_the_next_good_one_trains(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], expected: list[dict[str, float]]
) -> None:
    refused_before = _sample("primerl_trainer_refused_batches_total", code="INVALID_ARGUMENT")
    async with serving(trainer_config(dense_dir)) as stub:
        for name, (corrupt, field) in BAD_BATCHES.items():
            # The bad micro-batch is the second: the first, good one is not queued either.
            bad_batch = [rl_batches[0][0], corrupt(rl_batches[0][1])]
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await push(stub, 1, bad_batch, num_loss_tokens=0)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert field in field_violations(error.value), (name, error.value.details())
            assert "micro-batch 1" in error.value.details(), name
            current = await status(stub)
            assert (current.step, current.num_queued_batches) == (0, 0), name

        stream_errors = {
            "more micro-batches than announced": (push_requests(1, rl_batches[0], num_micro_batches=1), "begin"),
            "fewer micro-batches than announced": (push_requests(1, rl_batches[0], num_micro_batches=3), "begin"),
            "wrong loss-token count": (push_requests(1, rl_batches[0], num_loss_tokens=1), "begin.num_loss_tokens"),
            "wrong sample count": (push_requests(1, rl_batches[0], num_samples=5), "begin.num_samples"),
            "no begin": (
                iter([trainer_pb2.PushBatchRequest(micro_batch=micro_batch_to_proto(rl_batches[0][0]))]),
                "begin",
            ),
        }
        for name, (requests, field) in stream_errors.items():
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.PushBatch(requests)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert any(f.startswith(field) for f in field_violations(error.value)), (name, error.value.details())

        assert (await status(stub)).step == 0
        refused = _sample("primerl_trainer_refused_batches_total", code="INVALID_ARGUMENT") - refused_before
        assert refused == len(BAD_BATCHES) + len(stream_errors)
        await push(stub, 1, rl_batches[0])
        (step,) = await watch(stub, after_step=0, count=1)
        assert_metrics_equal(step, expected[0])


def _reason(error: grpc.aio.AioRpcError) -> str:
    return next(detail.reason for detail in error_details(error) if hasattr(detail, "reason"))


async def test_steps_out_of_order_and_pushed_twice_are_refused_with_failed_precondition(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], gated_training: threading.Event
) -> None:
    async with serving(trainer_config(dense_dir)) as stub:
        for step in (0, 2):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await push(stub, step, rl_batches[0])
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _reason(error.value) == "STEP_OUT_OF_ORDER"
        assert "expected the batch of step 1" in error.value.details()

        await push(stub, 1, rl_batches[0])
        await push(stub, 2, rl_batches[1])
        # Step 1 is in progress (held at the gate), step 2 queued: both are refused again.
        for step in (1, 2):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await push(stub, step, rl_batches[step - 1])
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert _reason(error.value) == "STEP_ALREADY_QUEUED"
        gated_training.set()
        await watch(stub, after_step=0, count=2)
        # A restarted orchestrator re-sending a trained step cannot train it twice.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(stub, 2, rl_batches[1])
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _reason(error.value) == "STEP_ALREADY_TRAINED"
        assert "trained" in error.value.details()
        assert (await status(stub)).step == 2


async def test_save_checkpoint_on_request(dense_dir: pathlib.Path, rl_batches, tmp_path: pathlib.Path) -> None:
    async with serving(trainer_config(dense_dir)) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "checkpoint.dir" in error.value.details()

    config = trainer_config(dense_dir, checkpoint={"dir": str(tmp_path), "save_on_stop": False})
    async with serving(config) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no optimizer step" in error.value.details()
        await push(stub, 1, rl_batches[0])
        await watch(stub, after_step=0, count=1)
        reply = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
        assert reply.step == 1 and reply.path == str(tmp_path / "step_00000001")
        assert (await status(stub)).last_checkpoint_step == 1
        # Still training afterwards.
        await push(stub, 2, rl_batches[1])
        assert [s.step for s in await watch(stub, after_step=1, count=1)] == [2]


async def test_router_replay_takes_all_layers_routing_and_refuses_a_wrong_shape(moe_dir: pathlib.Path) -> None:
    model = load_tiny_model(moe_dir)
    with torch.no_grad():
        (micro_batch,) = pack_into(make_samples(model, seed=3, num_samples=3), 1)
        routing = model(micro_batch.input_ids[None], micro_batch.position_ids[None]).routed_experts.to(torch.uint8)
    replayed = dataclasses.replace(micro_batch, routed_experts=routing)
    async with serving(trainer_config(moe_dir, router_replay=True)) as stub:
        spec = await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
        assert spec.router_replay
        assert (spec.num_hidden_layers, spec.num_moe_layers, spec.num_experts_per_token, spec.num_experts) == (
            4,
            4,
            2,
            8,
        )
        info = (await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())).info
        assert "trainer.router_replay" in info.capabilities
        for bad in (None, routing[:, :3], routing[:-1], routing.long()):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await push(stub, 1, [dataclasses.replace(micro_batch, routed_experts=bad)])
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "micro_batch.routed_experts" in field_violations(error.value)
        await push(stub, 1, [replayed])
        (step,) = await watch(stub, after_step=0, count=1)
        assert math.isfinite(step.metrics["loss"]) and step.metrics["update_skipped"] == 0
