"""Striped publishes: a version's tensors split over several PublishWeights streams, stored
only when every stripe arrived whole; a failing or missing stripe stores nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.tensors import iter_tensor_chunks

from .helpers import publish, running_broadcaster

pytestmark = pytest.mark.asyncio


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(16, 8 + i, generator=generator) for i in range(7)}


def begin(policy_version: int, tensors: dict[str, torch.Tensor], session: str, num_stripes: int, index: int):
    return pb2.PublishWeightsRequest(
        begin=pb2.PublishBegin(
            policy_version=policy_version,
            kind=pb2.PUBLISH_KIND_FULL,
            num_tensors=len(tensors),
            num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            stripe_session=session,
            num_stripes=num_stripes,
            stripe_index=index,
        )
    )


async def stripe(
    policy_version,
    tensors,
    part,
    session,
    num_stripes,
    index,
    *,
    fail_after_chunks=None,
    hang_after_chunks=None,
    sent=None,
    others=(),
):
    """One stripe's requests: its `begin`, then, once the `others` events are set, the chunks
    of `part` (a bogus chunk after `fail_after_chunks` of them, when set; nothing more after
    `hang_after_chunks`); sets `sent` when all are out. (A client still writing when the server
    ends its call sees INTERNAL from grpc.aio itself, whatever the server said: each stripe is
    done writing, or idle, when its call ends.)"""
    yield begin(policy_version, tensors, session, num_stripes, index)
    for event in others:
        await event.wait()
    for number, chunk in enumerate(iter_tensor_chunks(part.items(), chunk_bytes=128)):
        if number == fail_after_chunks:
            yield pb2.PublishWeightsRequest(chunk=tensor_pb2.TensorChunk(data=b"\0" * 4096))
            await asyncio.sleep(3600)  # until the call ends (the refusal), writing nothing more
        yield pb2.PublishWeightsRequest(chunk=chunk)
        if number + 1 == hang_after_chunks:
            await asyncio.sleep(3600)  # until the call ends (its refusal)
        await asyncio.sleep(0)
    if sent is not None:
        sent.set()


async def only_begin(request: pb2.PublishWeightsRequest):
    """`request`, then nothing until the call ends (its refusal)."""
    yield request
    await asyncio.sleep(3600)


def split(tensors: dict[str, torch.Tensor], num_stripes: int) -> list[dict[str, torch.Tensor]]:
    names = list(tensors)
    return [{name: tensors[name] for name in names[index::num_stripes]} for index in range(num_stripes)]


async def publish_striped(stub, policy_version, tensors, num_stripes, session="s", failing=None):
    """`failing`: (stripe index, chunks it sends, once the others sent theirs, before a bogus one)."""
    sent = [asyncio.Event() for _ in range(num_stripes)]
    calls = [
        stub.PublishWeights(
            stripe(
                policy_version,
                tensors,
                part,
                session,
                num_stripes,
                index,
                fail_after_chunks=failing[1] if failing and failing[0] == index else None,
                sent=sent[index],
                others=[event for other, event in enumerate(sent) if other != index]
                if failing and failing[0] == index
                else [],
            )
        )
        for index, part in enumerate(split(tensors, num_stripes))
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


async def latest(stub) -> int:
    return (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version


async def test_a_striped_publish_stores_the_tensors_of_a_single_stream_one():
    async with running_broadcaster() as stub:
        first = weights(1)
        await publish(stub, 1, first)
        # The same tensors striped: none differs from what the single stream stored (dtype, shape, bits).
        replies = await publish_striped(stub, 2, first, 3, session="a")
        assert all(isinstance(reply, pb2.PublishWeightsResponse) for reply in replies), replies
        assert {(r.policy_version, r.num_tensors, r.num_changed_tensors) for r in replies} == {(2, 7, 0)}
        changed = {**first, "layer.4.weight": first["layer.4.weight"] + 1}
        replies = await publish_striped(stub, 3, changed, 4, session="b")
        assert {(r.policy_version, r.num_changed_tensors) for r in replies} == {(3, 1)}
        # More stripes than tensors: the empty stripes count too.
        replies = await publish_striped(stub, 4, changed, 9, session="c")
        assert {(r.policy_version, r.num_changed_tensors) for r in replies} == {(4, 0)}
        assert await latest(stub) == 4


async def test_a_stripe_failing_midway_stores_nothing_and_the_next_publish_goes_through():
    async with running_broadcaster() as stub:
        await publish(stub, 1, weights(1))
        replies = await publish_striped(stub, 2, weights(2), 3, session="x", failing=(1, 2))
        codes = [reply.code() for reply in replies]
        assert codes[1] == grpc.StatusCode.INVALID_ARGUMENT, replies[1]
        assert codes[0] == codes[2] == grpc.StatusCode.ABORTED
        assert "nothing of it was applied" in replies[0].details()
        assert await latest(stub) == 1
        # A stripe of the failed session arriving late fails at once.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishWeights(stripe(2, weights(2), {}, "x", 3, 2))
        assert error.value.code() == grpc.StatusCode.ABORTED
        replies = await publish_striped(stub, 2, weights(2), 3, session="y")
        assert {r.num_changed_tensors for r in replies} == {7}


async def test_a_missing_stripe_or_a_tensor_missing_fails_the_publish():
    async with running_broadcaster(publish_limits={"stripe_join_timeout_s": 0.5}) as stub:
        tensors = weights(1)
        parts = split(tensors, 3)
        calls = [stub.PublishWeights(stripe(1, tensors, parts[index], "m", 3, index)) for index in (0, 2)]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        assert {reply.code() for reply in replies} == {grpc.StatusCode.ABORTED}
        assert "2 of its 3 stripes began within 0.5 s" in replies[0].details()
        # Every stripe came, but one tensor did not: the join counts against begin.
        short = [dict(part) for part in parts]
        short[1].pop(next(iter(short[1])))
        calls = [stub.PublishWeights(stripe(1, tensors, part, "n", 3, index)) for index, part in enumerate(short)]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        assert {reply.code() for reply in replies} == {grpc.StatusCode.INVALID_ARGUMENT}
        assert "6 tensors arrived, begin announced 7" in replies[0].details()
        assert await latest(stub) == -1


async def test_stripes_must_agree_and_stay_within_the_limits():
    async with running_broadcaster(publish_limits={"max_stripes": 4}) as stub:
        tensors = weights(1)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishWeights(only_begin(begin(1, tensors, "big", 5, 0)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "begin.num_stripes" in error.value.details() and "publish.max_stripes" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishWeights(only_begin(begin(1, tensors, "", 2, 0)))
        assert "begin.stripe_session" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishWeights(only_begin(begin(1, tensors, "i", 2, 2)))
        assert "begin.stripe_index" in error.value.details()

        # Two stripes with different begins: the second is refused, the first fails with it.
        sent = asyncio.Event()
        first = asyncio.ensure_future(
            stub.PublishWeights(stripe(1, tensors, split(tensors, 2)[0], "d", 2, 0, sent=sent))
        )
        await sent.wait()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishWeights(only_begin(begin(2, tensors, "d", 2, 1)))
        assert (
            error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "differs from the begin" in error.value.details()
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await first
        assert error.value.code() == grpc.StatusCode.ABORTED
        # A tensor sent on two stripes.
        sent = asyncio.Event()
        calls = [
            stub.PublishWeights(stripe(1, tensors, tensors, "twice", 2, 0, sent=sent)),
            stub.PublishWeights(stripe(1, tensors, tensors, "twice", 2, 1, hang_after_chunks=1, others=[sent])),
        ]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        assert sorted(reply.code().name for reply in replies) == ["ABORTED", "INVALID_ARGUMENT"]
        assert any("sent twice" in reply.details() for reply in replies), replies
        assert await latest(stub) == -1
