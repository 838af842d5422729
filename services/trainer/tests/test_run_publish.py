"""Publishing one run of a RunSet as its own adapter: the tensors a model built at the run's rank
would publish, named by the run id at the run's step; a real weight broadcaster (its binary, as
the trainer's tests import no other service) takes the runs' adapters side by side, each with its
own versions, and refuses a version that is not newer than its adapter's latest."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import pytest
import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.tensors import TensorAssembler
from primerl_trainer.batch import MicroBatch
from primerl_trainer.config import LoRAConfig
from primerl_trainer.export import exported_tensors, gather_state_dict, plan_export
from primerl_trainer.lora import apply_lora
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig
from primerl_trainer.publish import PublishError, WeightPublisher
from primerl_trainer.run_publish import run_adapter_tensors, run_publish_requests
from primerl_trainer.runs import RunConfig, RunSet

from .serving import broadcaster_process
from .tiny_training import batch_spec, load_tiny_model, lora_trainer_alone, make_samples, pack_into

CPU = torch.device("cpu")
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
MAX_RANK = 8
CHUNK_BYTES = 16 * 1024
# Adapter names: the run ids. Unclipped: a run's step is then bit for bit the one it takes alone
# (clipping's norm is reduced over the padded gradients, which can round the last bit otherwise).
UNCLIPPED = 1e9
CONFIGS = {
    "math-r2": RunConfig(
        rank=2,
        alpha=4.0,
        seed=1,
        optimizer=OptimizerConfig(lr=2e-3, max_grad_norm=UNCLIPPED),
        schedule=LRScheduleConfig(warmup_steps=2),
    ),
    "code-r4": RunConfig(
        rank=4, alpha=16.0, seed=2, optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=UNCLIPPED)
    ),
}
# Each run takes its own number of steps, so their versions differ.
NUM_STEPS = {"math-r2": 3, "code-r4": 2}


@pytest.fixture(scope="module")
def batches(dense_dir: pathlib.Path) -> dict[str, list[list[MicroBatch]]]:
    model = load_tiny_model(dense_dir)
    with torch.no_grad():
        return {
            run_id: [pack_into(make_samples(model, seed=10 * index + step, num_samples=3), 2) for step in range(3)]
            for index, run_id in enumerate(CONFIGS)
        }


def _run_set(dense_dir: pathlib.Path) -> RunSet:
    model = load_tiny_model(dense_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=MAX_RANK, alpha=1.0, target_modules=TARGETS))
    runs = RunSet(model, spec=batch_spec(model), device=CPU)
    for run_id, config in CONFIGS.items():
        runs.add_run(run_id, config)
    return runs


def _trained_run_set(dense_dir: pathlib.Path, batches: dict[str, list[list[MicroBatch]]]) -> RunSet:
    """Every run trained its NUM_STEPS, interleaved."""
    runs = _run_set(dense_dir)
    for step in range(max(NUM_STEPS.values())):
        for run_id in CONFIGS:
            if step < NUM_STEPS[run_id]:
                runs.train_step(run_id, batches[run_id][step])
    return runs


def _solo_export(
    dense_dir: pathlib.Path, config: RunConfig, run_batches: list[list[MicroBatch]], *, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What the single-run trainer publishes after the same steps: apply_lora at the run's rank
    and seed, one Trainer, exported_tensors(kind="adapter")."""
    trainer = lora_trainer_alone(dense_dir, config)
    model = trainer.model
    for batch in run_batches:
        trainer.train_step(batch)
    source = gather_state_dict(model, kind="adapter", is_destination=True)
    return dict(exported_tensors(model, source, kind="adapter", dtype=dtype, lora_scale=None))


def _assemble(requests) -> tuple[pb2.PublishBegin, dict[str, torch.Tensor]]:
    requests = iter(requests)
    begin = next(requests).begin
    assembler, tensors = TensorAssembler(), {}
    for request in requests:
        if (item := assembler.feed(request.chunk)) is not None:
            tensors[item[0]] = item[1]
    assembler.finish()
    return begin, tensors


def test_a_runs_publish_is_what_the_run_trained_alone_publishes(dense_dir: pathlib.Path, batches) -> None:
    runs = _trained_run_set(dense_dir, batches)
    for run_id, config in CONFIGS.items():
        solo = _solo_export(dense_dir, config, batches[run_id][: NUM_STEPS[run_id]], dtype=torch.float32)
        published = list(run_adapter_tensors(runs, run_id, dtype=torch.float32))
        assert [name for name, _ in published] == list(solo), run_id  # the same names, in the same order
        for name, tensor in published:
            assert tensor.shape == solo[name].shape, name
            assert torch.equal(tensor, solo[name]), f"{run_id} {name}"
        assert any(tensor.abs().sum() > 0 for name, tensor in published if "lora_B" in name), run_id

        # The stream: the same tensors in the published dtype, announced at the run's own rank.
        wanted = dict(run_adapter_tensors(runs, run_id, dtype=torch.bfloat16))
        begin, streamed = _assemble(
            run_publish_requests(
                runs, run_id, dtype=torch.bfloat16, model_type="qwen3", chunk_bytes=CHUNK_BYTES, owner=f"{run_id}-owner"
            )
        )
        assert (begin.policy_version, begin.trainer_step, begin.kind) == (
            NUM_STEPS[run_id],
            NUM_STEPS[run_id],
            pb2.PUBLISH_KIND_ADAPTER,
        )
        assert (begin.adapter_name, begin.adapter_rank, begin.adapter_alpha) == (run_id, config.rank, config.alpha)
        assert begin.adapter_owner == f"{run_id}-owner"
        assert begin.model_type == "qwen3"
        assert list(streamed) == list(wanted)
        for name, tensor in streamed.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, wanted[name]), name
        assert begin.num_tensors == len(streamed)
        assert begin.num_bytes == sum(t.numel() * t.element_size() for t in streamed.values())
        # The model's own plan counts its LoRA modules' rank, the largest any run may have.
        _, model_bytes = plan_export(runs.model, kind="adapter", dtype=torch.bfloat16, lora_scale=None)
        assert begin.num_bytes * MAX_RANK == model_bytes * config.rank


async def _latest_adapter_versions(stub: weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub) -> dict[str, int]:
    return dict((await stub.GetStatus(pb2.GetStatusRequest())).latest_adapter_versions)


async def test_the_broadcaster_keeps_each_runs_adapter_at_its_own_version(dense_dir: pathlib.Path, batches) -> None:
    runs = _trained_run_set(dense_dir, batches)
    broadcaster = broadcaster_process()
    async with broadcaster, make_channel(broadcaster.address, max_attempts=1) as channel:
        stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
        publisher = WeightPublisher(broadcaster.address, timeout_s=30)

        def publish(run_id: str) -> pb2.PublishWeightsResponse:
            requests = run_publish_requests(runs, run_id, dtype=torch.bfloat16, model_type="qwen3")
            return publisher.send(requests)

        try:
            for run_id in CONFIGS:
                reply = await asyncio.to_thread(publish, run_id)
                assert reply.policy_version == NUM_STEPS[run_id]
                assert reply.num_tensors == 2 * 7 * 4  # A and B of the 7 targets of 4 layers
            assert await _latest_adapter_versions(stub) == {"math-r2": 3, "code-r4": 2}

            # Its version again (no step since): refused, and nothing changes.
            with pytest.raises(PublishError) as refused:
                await asyncio.to_thread(publish, "math-r2")
            assert not refused.value.retryable and refused.value.holds(3)
            assert refused.value.metadata["adapter_name"] == "math-r2"
            # Versions count per adapter: code-r4's next one is not above math-r2's latest.
            before = copy.deepcopy(runs.state_dict("code-r4"))
            runs.train_step("code-r4", batches["code-r4"][NUM_STEPS["code-r4"]])
            assert (await asyncio.to_thread(publish, "code-r4")).policy_version == 3
            assert await _latest_adapter_versions(stub) == {"math-r2": 3, "code-r4": 3}
            # A run back at an older step (restored from its checkpoint) publishes below its latest.
            runs.load_state_dict("code-r4", before)
            with pytest.raises(PublishError) as older:
                await asyncio.to_thread(publish, "code-r4")
            assert (
                older.value.reason == "POLICY_VERSION_NOT_NEWER"
                and older.value.metadata["latest_policy_version"] == "3"
            )
            assert await _latest_adapter_versions(stub) == {"math-r2": 3, "code-r4": 3}
        finally:
            publisher.close()
