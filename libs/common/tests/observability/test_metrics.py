"""primerl_common.observability's metrics endpoint serves what the server interceptors count."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc.aio
import pytest

from primerl_common.observability import start_metrics_server
from primerl_common.observability._metrics import stop_metrics_server

from .observed_rpcs import SERVICE, call_kind, handled_count, recorded, rpc


@pytest.mark.asyncio
async def test_metrics_endpoint_serves_the_counters(channel, registry):
    await call_kind(channel, "unary_unary")
    with pytest.raises(grpc.aio.AioRpcError):
        await rpc(channel, "unary_unary", "Invalid")(b"")
    await recorded(lambda: handled_count(registry, "Invalid", "INVALID_ARGUMENT") == 1)
    port = start_metrics_server(0, host="127.0.0.1", registry=registry)
    assert port > 0
    assert start_metrics_server(0, host="127.0.0.1", registry=registry) == port
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    finally:
        stop_metrics_server(port)
    assert f'primerl_grpc_server_handled_total{{code="OK",method="Echo",service="{SERVICE}"}} 1.0' in body
    assert (
        f'primerl_grpc_server_handled_total{{code="INVALID_ARGUMENT",method="Invalid",service="{SERVICE}"}} 1.0' in body
    )
    assert f'primerl_grpc_server_in_flight{{method="Echo",service="{SERVICE}"}} 0.0' in body
    assert "primerl_grpc_server_handling_seconds_bucket" in body
