"""Publishing: the PublishWeights stream a trained, FSDP-sharded model produces, assembled back
with TensorAssembler (no broadcaster exists yet: the stream is consumed directly), and a publish
that fails: the step stays, the stream is consumed to its end, the error is reported. Removing
an adapter, against a stand-in broadcaster."""

from __future__ import annotations

import asyncio
import functools
import pathlib

import grpc
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from primerl.trainer.v1 import trainer_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.errors import ErrorInterceptor, InvalidArgument, NotFound
from primerl_common.processes import free_port
from primerl_common.tensors import TensorAssembler
from primerl_common.testing import bare_server
from primerl_trainer.batch import MicroBatch
from primerl_trainer.export import exported_tensors, gather_state_dict
from primerl_trainer.lora import merge_lora
from primerl_trainer.models import export_hf_state_dict, load_model
from primerl_trainer.publish import AdapterInfo, PublishError, WeightPublisher, publish_requests
from primerl_trainer.runtime import TrainingRuntime, build_runtime, shutdown_runtime

from .serving import push, serving, trainer_config, watch

CHUNK_BYTES = 64 * 1024


def _assemble(requests) -> tuple[weight_broadcaster_pb2.PublishBegin, dict[str, torch.Tensor], int]:
    """The begin message, the tensors and the largest chunk of a PublishWeights stream."""
    requests = iter(requests)
    first = next(requests)
    assert first.WhichOneof("item") == "begin"
    assembler, tensors, largest = TensorAssembler(), {}, 0
    for request in requests:
        assert request.WhichOneof("item") == "chunk"
        largest = max(largest, len(request.chunk.data))
        if (item := assembler.feed(request.chunk)) is not None:
            name, tensor = item
            assert name not in tensors
            tensors[name] = tensor
    assembler.finish()
    return first.begin, tensors, largest


def _stream(runtime: TrainingRuntime, *, adapter: AdapterInfo | None = None):
    model = runtime.trainer.model
    source = gather_state_dict(model, kind=runtime.publish_kind, is_destination=True)
    tensors = exported_tensors(
        model, source, kind=runtime.publish_kind, dtype=runtime.publish_dtype, lora_scale=runtime.lora_scale
    )
    return publish_requests(
        tensors,
        policy_version=runtime.trainer.step,
        kind=runtime.publish_kind,
        num_tensors=runtime.num_published_tensors,
        num_bytes=runtime.num_published_bytes,
        adapter=adapter,
        chunk_bytes=CHUNK_BYTES,
    )


def _full_state_dict(runtime: TrainingRuntime) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(runtime.trainer.model, options=options)


def test_the_stream_carries_the_trained_weights_under_hf_names(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]]
) -> None:
    runtime = build_runtime(trainer_config(dense_dir, publish={"dtype": "bfloat16"}))
    try:
        runtime.trainer.train_step(rl_batches[0])
        begin, tensors, largest = _assemble(_stream(runtime))
        wanted = {name: t.bfloat16() for name, t in export_hf_state_dict(load_model(dense_dir)).items()}
        trained = export_hf_state_dict(load_model(dense_dir), _full_state_dict(runtime))
    finally:
        shutdown_runtime(runtime)
    assert (begin.policy_version, begin.trainer_step, begin.kind) == (1, 1, weight_broadcaster_pb2.PUBLISH_KIND_FULL)
    assert tensors.keys() == wanted.keys()
    assert begin.num_tensors == len(tensors)
    assert begin.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert largest == CHUNK_BYTES  # the embedding spans several chunks
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == wanted[name].shape, name
        assert torch.equal(tensor, trained[name].bfloat16()), name
    # The step moved the weights: the stream is not the initial checkpoint.
    assert not torch.equal(
        tensors["model.layers.0.self_attn.q_proj.weight"], wanted["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.parametrize("kind", ["full", "adapter"])
def test_lora_streams_merged_weights_or_the_adapter(
    kind: str, moe_dir: pathlib.Path, rl_batches: list[list[MicroBatch]]
) -> None:
    lora = {"enabled": True, "rank": 2, "alpha": 4.0, "target_modules": ["q", "experts"]}
    config = trainer_config(moe_dir, lora=lora, publish={"kind": kind, "adapter_name": "policy"})
    runtime = build_runtime(config)
    try:
        runtime.trainer.train_step(rl_batches[0])
        adapter = AdapterInfo("policy", 2, 4.0, owner="alice") if kind == "adapter" else None
        begin, tensors, _ = _assemble(_stream(runtime, adapter=adapter))
        state = _full_state_dict(runtime)
    finally:
        shutdown_runtime(runtime)
    assert begin.num_tensors == len(tensors)
    assert begin.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    if kind == "adapter":
        assert begin.kind == weight_broadcaster_pb2.PUBLISH_KIND_ADAPTER
        assert (begin.adapter_name, begin.adapter_rank, begin.adapter_alpha) == ("policy", 2, 4.0)
        assert begin.adapter_owner == "alice"
        assert all(name.startswith("base_model.model.model.layers.") for name in tensors)
        name = "base_model.model.model.layers.2.mlp.experts.5.up_proj.lora_B.weight"
        assert torch.equal(tensors[name], state["layers.2.moe.experts.parametrizations.w13.0.up_lora_B"][5])
        return
    merged = dict(merge_lora(state.items(), scale=2.0))
    wanted = export_hf_state_dict(load_model(moe_dir), merged)
    assert tensors.keys() == wanted.keys()
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, wanted[name], rtol=0, atol=0, msg=name)


def test_a_failed_publish_consumes_the_stream_and_is_retryable() -> None:
    publisher = WeightPublisher(f"127.0.0.1:{free_port()}", timeout_s=10)
    consumed = []

    def tensors():
        for i in range(20):
            consumed.append(i)
            yield f"t{i}", torch.full((1000,), float(i))

    with pytest.raises(PublishError) as error:
        publisher.send(publish_requests(tensors(), policy_version=3, kind="full", num_tensors=20, num_bytes=80_000))
    publisher.close()
    assert error.value.retryable
    assert "UNAVAILABLE" in str(error.value)
    # Every tensor was still produced: the other ranks' gathers would otherwise wait forever.
    assert consumed == list(range(20))


async def test_training_goes_on_while_the_broadcaster_is_unreachable(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]]
) -> None:
    address = f"127.0.0.1:{free_port()}"
    config = trainer_config(
        dense_dir, publish={"weight_broadcaster": address, "initial_backoff_s": 0.05, "max_backoff_s": 0.1}
    )
    async with serving(config) as stub:
        info = (await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())).info
        assert "trainer.publish.full" in info.capabilities
        for step, batch in enumerate(rl_batches[:2], start=1):
            await push(stub, step, batch)
        steps = await watch(stub, after_step=0, count=2)
        assert [s.metrics["published"] for s in steps] == [0.0, 0.0]
        status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
        assert (status.step, status.published_policy_version) == (2, -1)
        assert address in status.last_publish_error and "UNAVAILABLE" in status.last_publish_error
        # Retries keep failing in the background; the trainer still takes batches.
        await push(stub, 3, rl_batches[2])
        assert [s.step for s in await watch(stub, after_step=2, count=1)] == [3]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_transformers_models_stream_their_checkpoint_names(
    kind: str, dense_dir: pathlib.Path, moe_dir: pathlib.Path, rl_batches: list[list[MicroBatch]]
) -> None:
    model_dir = dense_dir if kind == "dense" else moe_dir
    runtime = build_runtime(trainer_config(model_dir, model={"impl": "hf"}))
    try:
        runtime.trainer.train_step(rl_batches[0])
        begin, tensors, _ = _assemble(_stream(runtime))
    finally:
        shutdown_runtime(runtime)
    wanted = export_hf_state_dict(load_model(model_dir, impl="hf"))
    assert tensors.keys() == wanted.keys() and begin.num_tensors == len(wanted)
    assert all(tensors[name].shape == tensor.shape for name, tensor in wanted.items())


class AdapterHolder(weight_broadcaster_pb2_grpc.WeightBroadcasterServiceServicer):
    """A broadcaster stand-in that holds adapters and removes them as the real one does."""

    def __init__(self, adapters: dict[str, int]) -> None:
        self.adapters = adapters
        self.available = True

    async def RemoveAdapter(self, request, context):
        if not self.available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        if not request.adapter_name:
            raise InvalidArgument("must be set", field="adapter_name")
        if request.adapter_name not in self.adapters:
            raise NotFound(f"the weight broadcaster holds no adapter {request.adapter_name!r}")
        return weight_broadcaster_pb2.RemoveAdapterResponse(policy_version=self.adapters.pop(request.adapter_name))


async def test_removing_an_adapter_returns_its_version_or_minus_one_when_it_is_gone() -> None:
    holder = AdapterHolder({"math": 7})
    register = functools.partial(weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, holder)
    async with bare_server(register, interceptors=[ErrorInterceptor()]) as address:
        publisher = WeightPublisher(address, timeout_s=10)
        try:
            assert await asyncio.to_thread(publisher.remove_adapter, "math") == 7
            assert holder.adapters == {}
            assert await asyncio.to_thread(publisher.remove_adapter, "math") == -1  # nothing left to remove
            with pytest.raises(PublishError) as error:
                await asyncio.to_thread(publisher.remove_adapter, "")
            assert not error.value.retryable and "INVALID_ARGUMENT" in str(error.value)
            holder.available = False
            with pytest.raises(PublishError) as error:
                await asyncio.to_thread(publisher.remove_adapter, "code")
            assert error.value.retryable and "UNAVAILABLE" in str(error.value) and address in str(error.value)
        finally:
            publisher.close()
