"""Sealed streams: AES-256-GCM against the `cryptography` package's, frames that do not open
whatever is changed, and a real mTLS server taking a client-streaming call on its sealed port,
as the caller the session was opened for, refusing everything else there."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import grpc
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from primerl.common.v1 import sealed_pb2
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.config import ConfigError
from primerl_common.errors import error_details
from primerl_common.sealed_streams import SEALED_CAPABILITY, STREAM_METHOD, SealedCaller
from primerl_common.security.aead import SealBroken, open_sealed, seal
from primerl_common.security.certificates import tls_of
from primerl_common.security.sealed import SEALED_SESSION_METADATA, StreamKey, open_frames, seal_frames
from primerl_common.server import GrpcService
from primerl_common.testing import in_process_service

from .servers import ProbeConfig
from .test_security import PUSH, Recorder, certs, definition, mtls_config  # noqa: F401 (certs: a fixture)

PUSH_REQUESTS = [
    trainer_pb2.PushBatchRequest(begin=trainer_pb2.BatchBegin(step=step)).SerializeToString() for step in range(3)
]


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4095, 1 << 20])
def test_aes_gcm_equals_the_reference_and_refuses_any_change(size):
    key, nonce, aad, data = os.urandom(32), os.urandom(12), b"session\0method", os.urandom(size)
    reference = AESGCM(key).encrypt(nonce, data, aad)
    assert seal(key, nonce, data, aad) == reference
    assert seal(key, nonce, memoryview(bytearray(data)), aad, prefix=b"\x0a") == b"\x0a" + reference
    assert open_sealed(key, nonce, reference, aad) == data
    assert open_sealed(key, nonce, b"xy" + reference, aad, offset=2) == data
    flipped = bytearray(reference)
    flipped[len(flipped) // 2] ^= 0x01  # a ciphertext byte, or the tag's of an empty message
    for changed in (
        (key, nonce, bytes(flipped), aad),
        (os.urandom(32), nonce, reference, aad),
        (key, os.urandom(12), reference, aad),
        (key, nonce, reference, aad + b"x"),
        (key, nonce, reference[:-1], aad),
    ):
        with pytest.raises(SealBroken):
            open_sealed(*changed)


async def _frames(key: StreamKey, messages: list[bytes]) -> list[bytes]:
    async def source():
        for message in messages:
            yield message

    return [frame async for frame in seal_frames(key, source())]


async def _opened(key: StreamKey, frames: list[bytes]) -> list[bytes]:
    async def source():
        for frame in frames:
            yield frame

    return [bytes(message) async for message in open_frames(key, source())]


async def test_sealed_frames_open_in_order_and_refuse_reorder_replay_another_session_and_a_cut():
    key = StreamKey("s1", os.urandom(32), PUSH)
    messages = [os.urandom(n) for n in (10, 0, 3000, 1 << 16)]
    frames = await _frames(key, messages)
    assert len(frames) == len(messages) + 1  # the empty FINAL frame
    assert await _opened(key, frames) == messages
    other_session = StreamKey("s2", key.key, PUSH)  # same key, another session id
    other_method = StreamKey("s1", key.key, "/primerl.trainer.v1.TrainerService/Other")
    refused = {
        "reordered": [frames[1], frames[0], *frames[2:]],
        "replayed": [frames[0], frames[0], *frames[1:]],
        "dropped": [frames[0], *frames[2:]],
        "cut short": frames[:-1],
        "after FINAL": [*frames, frames[0]],
        "another stream's frame": [*frames[:2], (await _frames(StreamKey("s1", os.urandom(32), PUSH), [b"x"]))[0]],
    }
    for what, changed in refused.items():
        with pytest.raises(SealBroken):
            await _opened(key, changed)
            pytest.fail(f"{what} opened")
    for other in (other_session, other_method):
        with pytest.raises(SealBroken):
            await _opened(other, frames)


@pytest.fixture
async def sealed_service(certs):  # noqa: F811
    recorder = Recorder()
    served_definition = dataclasses.replace(definition(recorder), sealed_methods=[PUSH])
    config = mtls_config(certs, sealed_port=0)
    async with in_process_service(served_definition, config, client_tls=tls_of(certs, "orchestrator")) as served:
        yield served, recorder


def _code(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, set[str]]:
    return exc.code(), {getattr(detail, "reason", "") for detail in error_details(exc)}


async def test_a_push_as_a_sealed_stream_reaches_the_handler_as_the_sessions_caller(sealed_service):
    served, recorder = sealed_service
    caller = SealedCaller(served.channel, "127.0.0.1")
    try:
        port, keys = await caller.open(PUSH, 2, timeout_s=5)
        assert port == served.service.sealed_port and len(keys) == 2
        response = await caller.call(port, keys[0], 0, PUSH_REQUESTS, trainer_pb2.PushBatchResponse, timeout_s=10)
        assert response == trainer_pb2.PushBatchResponse()
        assert [(what, who.name) for what, who in recorder.calls] == [("PushBatch message", "orchestrator")] * 3
        assert SEALED_CAPABILITY in served.service.definition.info().capabilities
        # A session is used once.
        with pytest.raises(grpc.aio.AioRpcError) as used:
            await caller.call(port, keys[0], 0, PUSH_REQUESTS, trainer_pb2.PushBatchResponse, timeout_s=10)
        assert _code(used.value) == (grpc.StatusCode.UNAUTHENTICATED, {"UNKNOWN_SEALED_SESSION"})
    finally:
        await caller.close()
    assert len(recorder.calls) == 3


async def test_a_sealed_calls_own_request_error_and_its_cancellation_reach_the_caller(sealed_service):
    served, recorder = sealed_service
    caller = SealedCaller(served.channel, "127.0.0.1")

    def failing():
        yield PUSH_REQUESTS[0]
        raise ValueError("tensor 3 is gone")

    async def endless():  # enough messages for some to reach the handler past both ends' read-ahead
        for _ in range(12):
            yield PUSH_REQUESTS[0]
        await asyncio.Event().wait()

    try:
        port, (first, second, third) = await caller.open(PUSH, 3, timeout_s=5)
        with pytest.raises(ValueError, match="tensor 3 is gone"):  # not the CANCELLED gRPC makes of it
            await caller.call(port, first, 0, failing(), trainer_pb2.PushBatchResponse, timeout_s=10)
        call = asyncio.create_task(caller.call(port, second, 1, endless(), trainer_pb2.PushBatchResponse, timeout_s=60))
        while not recorder.calls:  # noqa: ASYNC110 (the endless stream's first messages arrived)
            await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        answer = await caller.call(port, third, 2, PUSH_REQUESTS, trainer_pb2.PushBatchResponse, timeout_s=10)
        assert answer == trainer_pb2.PushBatchResponse()  # the caller goes on
    finally:
        await caller.close()


async def test_the_sealed_port_refuses_other_calls_forged_keys_and_cut_streams(sealed_service):
    served, recorder = sealed_service
    plain = grpc.aio.insecure_channel(f"127.0.0.1:{served.service.sealed_port}")
    caller = SealedCaller(served.channel, "127.0.0.1")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as other:  # any method of the service, in plaintext
            await trainer_pb2_grpc.TrainerServiceStub(plain).GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
        assert other.value.code() == grpc.StatusCode.UNAUTHENTICATED
        port, (good, forged_on, cut_on) = await caller.open(PUSH, 3, timeout_s=5)
        forged = StreamKey(forged_on.session_id, os.urandom(32), PUSH)  # a session id seen, its key guessed
        with pytest.raises(grpc.aio.AioRpcError) as wrong_key:
            await caller.call(port, forged, 1, PUSH_REQUESTS, trainer_pb2.PushBatchResponse, timeout_s=10)
        assert _code(wrong_key.value) == (grpc.StatusCode.UNAUTHENTICATED, {"SEAL_BROKEN"})
        stream = plain.stream_unary(STREAM_METHOD, request_serializer=None, response_deserializer=None)
        frames = await _frames(cut_on, PUSH_REQUESTS)
        with pytest.raises(grpc.aio.AioRpcError) as cut:  # its FINAL frame dropped on the way
            await stream(iter(frames[:-1]), metadata=((SEALED_SESSION_METADATA, cut_on.session_id),), timeout=10)
        assert _code(cut.value) == (grpc.StatusCode.UNAUTHENTICATED, {"SEAL_BROKEN"})
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stream(iter(frames), metadata=((SEALED_SESSION_METADATA, "f" * 32),), timeout=10)
        assert _code(unknown.value) == (grpc.StatusCode.UNAUTHENTICATED, {"UNKNOWN_SEALED_SESSION"})
        assert [what for what, _ in recorder.calls] == ["PushBatch message"] * 3  # the cut stream's, then refused
        await caller.call(port, good, 2, PUSH_REQUESTS, trainer_pb2.PushBatchResponse, timeout_s=10)
        assert len(recorder.calls) == 6
    finally:
        await plain.close()
        await caller.close()


async def test_sessions_only_for_the_methods_roles_and_none_without_a_sealed_port(sealed_service, certs):  # noqa: F811
    served, _ = sealed_service
    open_sessions = served.channel.unary_unary(
        "/primerl.common.v1.SealedStreamService/OpenSealedStreams",
        request_serializer=sealed_pb2.OpenSealedStreamsRequest.SerializeToString,
        response_deserializer=sealed_pb2.OpenSealedStreamsResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as not_sealed:
        await open_sessions(sealed_pb2.OpenSealedStreamsRequest(method="/x.Y/Z", streams=1), timeout=5)
    assert not_sealed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "/x.Y/Z" in not_sealed.value.details()
    async with make_channel(served.address, tls=tls_of(certs, "gateway"), max_attempts=1) as gateway:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await SealedCaller(gateway, "127.0.0.1").open(PUSH, 1, timeout_s=5)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and "orchestrator" in denied.value.details()
    unsealed = dataclasses.replace(definition(Recorder()), sealed_methods=[PUSH])
    async with in_process_service(unsealed, mtls_config(certs), client_tls=tls_of(certs, "orchestrator")) as plain:
        caller = SealedCaller(plain.channel, "127.0.0.1")
        assert await caller.open(PUSH, 1, timeout_s=5) is None  # the caller pushes over mTLS instead
        assert "server.sealed_port" in caller.unavailable


async def test_a_sealed_port_needs_mutual_tls_and_sealed_methods(certs):  # noqa: F811
    config = ProbeConfig(server={"host": "127.0.0.1", "port": 0, "sealed_port": 0})
    service = GrpcService(dataclasses.replace(definition(Recorder()), sealed_methods=[PUSH]), config)
    with pytest.raises(ConfigError, match=r"server\.sealed_port: .*mutual TLS"):
        await service.start()
    service = GrpcService(definition(Recorder()), mtls_config(certs, sealed_port=0))
    with pytest.raises(ConfigError, match=r"server\.sealed_port: probe takes no sealed streams"):
        await service.start()
