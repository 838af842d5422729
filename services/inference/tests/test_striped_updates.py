"""Striped weight updates: a version's tensors over several UpdateWeights streams end in exactly
the logprobs of one stream carrying them; a stripe that fails part-way, or a tensor missing
from the stripes, leaves the previous version serving bit for bit."""

import asyncio
import pathlib
import uuid

import grpc
import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.tensors import iter_tensor_chunks

from .serving import checkpoint, perturbed_model, policy_version, sample, update_stream

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = [list(range(40, 72)), [(3 * i) % 200 + 30 for i in range(24)]]


async def logprobs(stub) -> list[list[float]]:
    return await sample(stub, PROMPTS, num_tokens=4, seed=7)


async def stripe_requests(begin, part, *, index, fail_after_chunks=None, sent=None, others=()):
    """Stripe `index`'s stream: its begin, then (once the `others` events are set) `part`'s
    chunks, with a chunk of no tensor after `fail_after_chunks` of them. Sets `sent` once all
    are out. (The service reads a refused stream to its end before answering, so that
    grpc.aio clients see its status.)"""
    stripe_begin = inference_pb2.WeightUpdateBegin()
    stripe_begin.CopyFrom(begin)
    stripe_begin.stripe_index = index
    yield inference_pb2.UpdateWeightsRequest(begin=stripe_begin)
    for event in others:
        await event.wait()
    for number, chunk in enumerate(iter_tensor_chunks(part.items(), chunk_bytes=64 * 1024)):
        if number == fail_after_chunks:
            yield inference_pb2.UpdateWeightsRequest(chunk=tensor_pb2.TensorChunk(data=b"\0" * 1024))
        yield inference_pb2.UpdateWeightsRequest(chunk=chunk)
    if sent is not None:
        sent.set()


async def striped_update(stub, tensors: dict[str, torch.Tensor], num_stripes: int, *, failing=None, drop=None):
    """Each stripe's reply or error. `failing`: (stripe, chunks before its bogus one, sent once
    the others sent theirs); `drop`: a tensor no stripe sends (begin still counts it)."""
    version = await policy_version(stub) + 1
    begin = next(update_stream(tensors, version)).begin
    begin.stripe_session, begin.num_stripes = uuid.uuid4().hex, num_stripes
    names = [name for name in tensors if name != drop]
    parts = [{name: tensors[name] for name in names[index::num_stripes]} for index in range(num_stripes)]
    sent = [asyncio.Event() for _ in parts]
    calls = []
    for index, part in enumerate(parts):
        fails = failing is not None and failing[0] == index
        calls.append(
            stub.UpdateWeights(
                stripe_requests(
                    begin,
                    part,
                    index=index,
                    fail_after_chunks=failing[1] if fails else None,
                    sent=sent[index],
                    others=[event for other, event in enumerate(sent) if other != index] if fails else (),
                )
            )
        )
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_a_striped_update_ends_in_the_logprobs_of_a_single_stream(
    model_dir: pathlib.Path, served, tmp_path: pathlib.Path
) -> None:
    stub = served.stub
    original = checkpoint(model_dir)
    perturbed = perturbed_model(model_dir, tmp_path / "perturbed", seed=4)
    info = (await stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info
    assert "weights.striped" in info.capabilities
    before = await logprobs(stub)

    await stub.UpdateWeights(update_stream(perturbed, await policy_version(stub) + 1))
    single = await logprobs(stub)
    replies = await striped_update(stub, original, 3)
    assert all(isinstance(reply, inference_pb2.UpdateWeightsResponse) for reply in replies), replies
    assert {(reply.num_tensors, reply.num_bytes) for reply in replies} == {
        (len(original), sum(t.numel() * t.element_size() for t in original.values()))
    }
    assert await logprobs(stub) == before
    replies = await striped_update(stub, perturbed, 5)
    assert {reply.policy_version for reply in replies} == {await policy_version(stub)}
    assert single != before and await logprobs(stub) == single


async def test_a_stripe_failing_part_way_leaves_the_previous_version_serving(
    model_dir: pathlib.Path, served, tmp_path: pathlib.Path
) -> None:
    stub = served.stub
    perturbed = perturbed_model(model_dir, tmp_path / "perturbed", seed=5)
    version, before = await policy_version(stub), await logprobs(stub)

    replies = await striped_update(stub, perturbed, 3, failing=(1, 3))
    codes = [reply.code() for reply in replies]
    assert codes[1] == grpc.StatusCode.INVALID_ARGUMENT, replies[1]
    assert codes[0] == codes[2] == grpc.StatusCode.ABORTED, replies
    assert "nothing of it was applied" in replies[0].details()
    assert await policy_version(stub) == version and await logprobs(stub) == before

    # Every stripe ended, one tensor never came: checked as one update, refused whole.
    replies = await striped_update(stub, perturbed, 3, drop="model.layers.1.mlp.up_proj.weight")
    assert {reply.code() for reply in replies} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert "model.layers.1.mlp.up_proj.weight" in replies[0].details()
    assert await policy_version(stub) == version and await logprobs(stub) == before

    # Nothing is left held: the next update goes through.
    replies = await striped_update(stub, perturbed, 2)
    assert {reply.policy_version for reply in replies} == {version + 1}
    assert await logprobs(stub) != before
