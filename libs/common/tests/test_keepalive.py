"""A client and a server built with the shared options idle past the keepalive time: the
server admits the client's keepalive pings (no GOAWAY "too_many_pings"), so the connection
stays READY and the next call needs no reconnect. The times are the production ones scaled
down 30 times; a server that admitted pings only 5 minutes apart (gRPC's default, also what an
unknown option name leaves) sends GOAWAY at the third ping, within about 3 keepalive times."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl_common.processes import free_port
from primerl_common.security import MAX_RECONNECT_BACKOFF_MS, secure_aio_channel
from primerl_common.server import KEEPALIVE, Keepalive, channel_options, server_options

SCALED = Keepalive(time_ms=KEEPALIVE.time_ms // 30, timeout_ms=KEEPALIVE.timeout_ms // 30)
IDLE_S = 5 * SCALED.time_ms / 1000


async def connectivity(channel: grpc.aio.Channel, states: list[grpc.ChannelConnectivity]) -> None:
    """Appends each state the channel goes through."""
    state = channel.get_state()
    while True:
        states.append(state)
        await channel.wait_for_state_change(state)
        state = channel.get_state()


@pytest.mark.parametrize("quiet_stream", [False, True], ids=["no call open", "a quiet stream open"])
async def test_an_idle_connection_past_the_keepalive_time_is_not_sent_goaway(quiet_stream):
    server = grpc.aio.server(options=server_options(1 << 20, keepalive=SCALED))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(1 << 20, keepalive=SCALED))
    stub = health_pb2_grpc.HealthStub(channel)
    states: list[grpc.ChannelConnectivity] = []
    watcher = None
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        watcher = asyncio.create_task(connectivity(channel, states))
        stream = stub.Watch(health_pb2.HealthCheckRequest()) if quiet_stream else None
        if stream is not None:
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(IDLE_S)
        if stream is not None:
            assert not stream.done(), await stream.details()
            stream.cancel()
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        # One connection all along: READY from the first call to the last.
        assert states == [grpc.ChannelConnectivity.READY], [state.name for state in states]
    finally:
        if watcher is not None:
            watcher.cancel()
        await channel.close()
        await server.stop(None)


@pytest.mark.slow
async def test_a_server_back_after_a_long_absence_is_reached_within_the_reconnect_cap():
    """A client calling a server that is down for 20 s, then up: with gRPC's own backoff its
    channel would next try about 26 s in (attempts 1, 1.6, 2.6, 4.1, 6.6, 10.5 s apart), and
    every call until then fails without trying. Every channel primerl opens caps the wait between
    tries, one opened without options too (client.wait_for_serving's: the launcher waiting for a
    restarted service)."""
    port = free_port()
    channel = secure_aio_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    server = None
    try:
        loop = asyncio.get_running_loop()
        back_at = loop.time() + 20
        while loop.time() < back_at:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.5)
        server = grpc.aio.server(options=server_options(1 << 20))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        give_up_at = loop.time() + 60
        while True:
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                break
            except grpc.aio.AioRpcError:
                assert loop.time() < give_up_at, "the server was never reached"
                await asyncio.sleep(0.1)
        assert loop.time() - back_at < MAX_RECONNECT_BACKOFF_MS / 1000 + 3
    finally:
        await channel.close()
        if server is not None:
            await server.stop(None)
