"""Admission limits through a real grpc.aio server (the trainer.v1 contract, served by a test
servicer) with AdmissionInterceptor in front of the error mapping, and the real stub."""

import asyncio
import functools

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common import security
from primerl_common.admission import (
    RETRY_AFTER_METADATA,
    AdmissionConfig,
    AdmissionInterceptor,
    ConcurrencyLimit,
    LimitExceeded,
    Overloaded,
    caller_key,
    check_limit,
)
from primerl_common.client import make_channel
from primerl_common.errors import ErrorInterceptor, error_details
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.testing import bare_server, eventually


class Servicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Unary calls wait for `gate`; PushBatch holds `lock` while it reads its stream (what a
    trickling client would hold for ever without a deadline), pausing `pause_s` between reads."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.lock = asyncio.Lock()
        self.pause_s = 0.0
        self.peers: list[str] = []

    async def SaveCheckpoint(self, request, context):
        self.peers.append(caller_key(context))
        await self.gate.wait()
        return trainer_pb2.SaveCheckpointResponse(step=1)

    async def PushBatch(self, request_iterator, context):
        num = 0
        async with self.lock:
            async for _ in request_iterator:
                num += 1
                await asyncio.sleep(self.pause_s)
        return trainer_pb2.PushBatchResponse(num_micro_batches=num)

    async def WatchSteps(self, request, context):
        yield trainer_pb2.WatchStepsResponse(step=trainer_pb2.StepMetrics(step=0))
        await self.gate.wait()


def tenant(context: grpc.aio.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get("tenant", "none")


@pytest.fixture
def servicer():
    return Servicer()


async def serve(servicer, interceptor: AdmissionInterceptor):
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    interceptors = [interceptor, ErrorInterceptor()]
    return bare_server(
        functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer),
        functools.partial(health_pb2_grpc.add_HealthServicer_to_server, health_servicer),
        interceptors=interceptors,
    )


def pushes(num: int, gap_s: float = 0.0):
    async def requests():
        for _ in range(num):
            yield trainer_pb2.PushBatchRequest(begin=trainer_pb2.BatchBegin(step=1))
            await asyncio.sleep(gap_s)

    return requests()


async def test_unary_limit_refuses_at_once_with_a_retry_hint_and_serves_after(servicer):
    config = AdmissionConfig(max_concurrent_unary=2, retry_after_ms=1500)
    async with await serve(servicer, AdmissionInterceptor(config)) as address, make_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        held = [asyncio.ensure_future(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())) for _ in range(2)]
        await eventually(lambda: len(servicer.peers) == 2, timeout_s=5, what="two calls run")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=5)
        assert loop.time() - started < 1.0  # refused, not queued
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "admission.max_concurrent_unary = 2" in error.value.details()
        assert dict(error.value.trailing_metadata())[RETRY_AFTER_METADATA] == "1500"
        retry = [d for d in error_details(error.value) if isinstance(d, error_details_pb2.RetryInfo)]
        assert retry[0].retry_delay.ToMilliseconds() == 1500
        info = next(d for d in error_details(error.value) if isinstance(d, error_details_pb2.ErrorInfo))
        assert info.reason == "OVERLOADED" and info.metadata["config_field"] == "admission.max_concurrent_unary"
        # Health checks are exempt: they answer while the limit is reached.
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Streams count apart from unary calls.
        reply = await stub.PushBatch(pushes(2), timeout=5)
        assert reply.num_micro_batches == 2

        servicer.gate.set()
        assert [r.step for r in await asyncio.gather(*held)] == [1, 1]
        assert (await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=5)).step == 1
        assert servicer.peers[0] == "127.0.0.1"


async def test_per_caller_limits_leave_other_callers_served(servicer):
    config = AdmissionConfig(max_concurrent_streams=3, max_concurrent_streams_per_caller=1)
    interceptor = AdmissionInterceptor(config, caller_of=tenant)
    async with await serve(servicer, interceptor) as address, make_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)

        async def watch(name: str):
            call = stub.WatchSteps(trainer_pb2.WatchStepsRequest(), metadata=(("tenant", name),), timeout=10)
            await call.read()  # admitted once its first message arrives
            return call

        a = await watch("a")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await watch("a")
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "admission.max_concurrent_streams_per_caller = 1" in error.value.details()
        assert "from a" in error.value.details()
        b, c = await watch("b"), await watch("c")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await watch("d")
        assert "admission.max_concurrent_streams = 3" in error.value.details()
        a.cancel()  # a slot is given back when its call ends, however it ends
        await eventually(
            lambda: interceptor.streams.num_held == 2, timeout_s=5, what="the cancelled call's slot is free"
        )
        d = await watch("d")
        servicer.gate.set()
        for call in (b, c):
            async for _ in call:
                pass
        async for _ in d:
            pass


async def test_trickling_stream_ends_deadline_exceeded_and_frees_what_it_held(servicer):
    config = AdmissionConfig(stream_idle_timeout_s=0.3)
    async with await serve(servicer, AdmissionInterceptor(config)) as address, make_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PushBatch(pushes(3, gap_s=2.0), timeout=10)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "admission.stream_idle_timeout_s" in error.value.details()
        info = next(d for d in error_details(error.value) if isinstance(d, error_details_pb2.ErrorInfo))
        assert info.reason == "STREAM_IDLE"
        assert not servicer.lock.locked()
        # The server's own time between reads is not the client's: a stream read slowly passes.
        servicer.pause_s = 0.5
        assert (await stub.PushBatch(pushes(2), timeout=10)).num_micro_batches == 2


async def test_a_stream_longer_than_its_total_deadline_ends(servicer):
    config = AdmissionConfig(stream_idle_timeout_s=0.5, stream_total_timeout_s=0.8)
    async with await serve(servicer, AdmissionInterceptor(config)) as address, make_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PushBatch(pushes(100, gap_s=0.1), timeout=10)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "admission.stream_total_timeout_s" in error.value.details()
        assert 0.7 < loop.time() - started < 3.0
        assert (await stub.PushBatch(pushes(3), timeout=10)).num_micro_batches == 3


def test_concurrency_limit_counts_per_caller_and_forgets_idle_callers():
    limit = ConcurrencyLimit(
        what="calls", limit=3, per_caller_limit=2, config_field="x.max", per_caller_config_field="x.per_caller"
    )
    with limit.hold("a"), limit.hold("a"):
        with pytest.raises(Overloaded, match=r"x\.per_caller = 2"):
            limit.acquire("a")
        with limit.hold("b"), pytest.raises(Overloaded, match=r"x\.max = 3"):
            limit.acquire("c")
        assert limit.num_held == 2 and limit.num_held_by("b") == 0
    assert limit.num_held == 0 and limit._by_caller == {}
    with pytest.raises(ValueError, match=r"x\.max"):
        ConcurrencyLimit(what="calls", limit=0, per_caller_limit=1, config_field="x.max", per_caller_config_field="y")


def test_check_limit_names_the_request_field_and_the_config_field():
    check_limit(10, 10, field="begin.num_tensors", config_field="publish.max_tensors", what="tensors")
    with pytest.raises(LimitExceeded) as error:
        check_limit(11, 10, field="begin.num_tensors", config_field="publish.max_tensors", what="tensors")
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.message.startswith("begin.num_tensors: 11 tensors")
    assert "publish.max_tensors = 10" in error.value.message
    assert error.value.retry_after_s is None  # the same request cannot succeed later


def test_config_refuses_non_positive_limits():
    with pytest.raises(ValueError, match="max_concurrent_unary"):
        AdmissionConfig(max_concurrent_unary=0)
    with pytest.raises(ValueError, match="stream_idle_timeout_s"):
        AdmissionConfig(stream_idle_timeout_s=0)


async def test_per_caller_limits_key_on_the_certificate_identity_under_mtls(servicer, tmp_path):
    authority = make_authority(tmp_path)
    for holder in ("probe:trainer", "env-a:environment", "env-b:environment"):
        make_certificate(authority, tmp_path, Holder.parse(holder))
    config = AdmissionConfig(max_concurrent_unary=8, max_concurrent_unary_per_caller=1)
    server = grpc.aio.server(interceptors=[AdmissionInterceptor(config), ErrorInterceptor()])
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", security.server_credentials(tls_of(tmp_path, "probe")))
    await server.start()
    try:
        async with (
            make_channel(f"127.0.0.1:{port}", tls=tls_of(tmp_path, "env-a")) as as_a,
            make_channel(f"127.0.0.1:{port}", tls=tls_of(tmp_path, "env-b")) as as_b,
        ):
            a, b = trainer_pb2_grpc.TrainerServiceStub(as_a), trainer_pb2_grpc.TrainerServiceStub(as_b)
            held = asyncio.ensure_future(a.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=10))
            await eventually(lambda: servicer.peers == ["env-a"], timeout_s=5, what="env-a's call runs")
            # Both callers come from 127.0.0.1: only their certificates tell them apart.
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await a.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=10)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "from env-a" in error.value.details()
            other = asyncio.ensure_future(b.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=10))
            await eventually(lambda: servicer.peers == ["env-a", "env-b"], timeout_s=5, what="env-b's call runs")
            servicer.gate.set()
            assert [(await held).step, (await other).step] == [1, 1]
    finally:
        await server.stop(0)
