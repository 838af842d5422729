"""The trainer's WeightPublisher striping a publish over several connections to a real
broadcaster: the version stored is the one a single stream stores, bit for bit; a stripe that
breaks fails the whole publish with nothing stored."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.testing import in_process_service
from primerl_trainer.publish import PublishError, WeightPublisher, publish_requests
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def broadcaster():
    config = WeightBroadcasterConfig(server={"host": "127.0.0.1", "port": 0}, publish={"stripe_join_timeout_s": 5})
    async with in_process_service(await build(config), config) as served:
        yield served.address, weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel)


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 48, generator=generator) for i in range(9)}
    tensors["model.embed_tokens.weight"] = torch.randn(300, 64, generator=generator).to(torch.bfloat16)
    return tensors


def requests(policy_version: int, tensors: dict[str, torch.Tensor]):
    return publish_requests(
        tensors.items(),
        policy_version=policy_version,
        kind="full",
        num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        chunk_bytes=4096,
    )


async def send(address: str, streams: int, policy_version: int, tensors) -> pb2.PublishWeightsResponse:
    publisher = WeightPublisher(address, timeout_s=30, streams=streams)
    try:
        return await asyncio.to_thread(publisher.send, requests(policy_version, tensors))
    finally:
        publisher.close()


async def test_a_striped_publish_stores_what_a_single_stream_stores():
    async with broadcaster() as (address, stub):
        info = (await stub.GetServiceInfo(pb2.GetServiceInfoRequest())).info
        assert "publish.striped" in info.capabilities
        first = weights(1)
        assert (await send(address, 1, 1, first)).num_changed_tensors == len(first)
        reply = await send(address, 4, 2, first)
        # Every tensor as the single stream stored it: dtype, shape and bits.
        assert (reply.policy_version, reply.num_tensors, reply.num_changed_tensors) == (2, len(first), 0)
        second = {**first, "model.embed_tokens.weight": first["model.embed_tokens.weight"] * 2}
        assert (await send(address, 3, 3, second)).num_changed_tensors == 1
        assert (await send(address, 1, 4, second)).num_changed_tensors == 0


async def test_a_broken_stripe_fails_the_publish_and_stores_nothing():
    async with broadcaster() as (address, stub):
        await send(address, 1, 1, weights(1))
        tensors = weights(2)

        def broken():
            """The stream breaks at the 5th tensor (the producer's failure ends the stripes' calls)."""
            for number, request in enumerate(requests(2, tensors)):
                if (
                    request.chunk.HasField("header")
                    and number > 0
                    and request.chunk.header.name.endswith("4.mlp.down_proj.weight")
                ):
                    raise RuntimeError("export failed")
                yield request

        publisher = WeightPublisher(address, timeout_s=30, streams=3)
        try:
            with pytest.raises(RuntimeError, match="export failed"):
                await asyncio.to_thread(publisher.send, broken())
        finally:
            publisher.close()

        async def latest() -> int:
            return (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version

        assert await latest() == 1
        # The cancelled stripes failed the session: the next attempt publishes the version whole.
        assert (await send(address, 3, 2, tensors)).num_changed_tensors == len(tensors)
        assert await latest() == 2
        with pytest.raises(PublishError) as error:
            await send(address, 3, 2, tensors)
        assert not error.value.retryable and "not newer" in str(error.value)


async def test_under_mtls_a_publish_goes_as_sealed_streams_to_the_broadcasters_sealed_port(tmp_path, monkeypatch):
    from primerl_common import security
    from primerl_common.sealed_streams import SealedStreamServicer
    from primerl_common.security import _credentials
    from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of

    authority = make_authority(tmp_path)
    for holder in ("weight_broadcaster", "trainer"):
        make_certificate(authority, tmp_path, Holder.parse(holder))
    monkeypatch.setattr(_credentials, "_process", None)  # the publisher's channels show the trainer's
    security.setup_process_tls(tls_of(tmp_path, "trainer"), export=False)
    sealed_calls = []
    stream = SealedStreamServicer.SealedStream

    async def counted(self, request_iterator, context):
        sealed_calls.append(1)
        return await stream(self, request_iterator, context)

    monkeypatch.setattr(SealedStreamServicer, "SealedStream", counted)
    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0, "sealed_port": 0}, tls=tls_of(tmp_path, "weight_broadcaster")
    )
    async with in_process_service(await build(config), config, client_tls=tls_of(tmp_path, "trainer")) as served:
        first = weights(1)
        assert (await send(served.address, 1, 1, first)).num_changed_tensors == len(first)
        assert len(sealed_calls) == 1
        # Striped over 3 sealed streams, the same bits: nothing changed.
        assert (await send(served.address, 3, 2, first)).num_changed_tensors == 0
        assert len(sealed_calls) == 4
        stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel)
        assert (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version == 2
