"""Client helpers: channels with the shared options, deadlines, retries on
UNAVAILABLE only (never on errors a retry cannot fix), and readiness waits."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from primerl_common import observability, security
from primerl_common.config import TlsConfig
from primerl_common.server import channel_options

__all__ = ["DEFAULT_TIMEOUT_S", "call_with_retry", "make_channel", "wait_for_serving"]

DEFAULT_TIMEOUT_S = 30.0
T = TypeVar("T")


def _retry_service_config(max_attempts: int) -> str:
    # gRPC retries transparently while no response byte has arrived; limited to
    # UNAVAILABLE, the one code that means "this request never ran".
    policy = {
        "maxAttempts": max_attempts,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps({"methodConfig": [{"name": [{}], "retryPolicy": policy}]})


def make_channel(
    address: str,
    *,
    max_message_bytes: int = 64 * 1024 * 1024,
    max_attempts: int = 5,
    tls: TlsConfig | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to `host:port` with trace propagation, showing `tls` (default: the
    process's identity, see primerl_common.security; plaintext where that says plaintext)."""
    options = [
        *channel_options(max_message_bytes),
        ("grpc.enable_retries", 1 if max_attempts > 1 else 0),
        ("grpc.service_config", _retry_service_config(max(max_attempts, 2))),
        *extra_options,
    ]
    return security.secure_aio_channel(
        address, options=options, interceptors=observability.client_interceptors(), tls=tls
    )


async def call_with_retry(
    call: Callable[[], Awaitable[T]],
    *,
    deadline_s: float = DEFAULT_TIMEOUT_S,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 2.0,
) -> T:
    """Runs `call` until it succeeds, retrying UNAVAILABLE with jittered
    exponential backoff until `deadline_s` has passed; other errors at once.
    For calls gRPC cannot retry itself (streams, or across a server restart)."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + deadline_s
    backoff = initial_backoff_s
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + backoff > give_up_at:
                raise
        await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
        backoff = min(backoff * 2, max_backoff_s)


async def wait_for_serving(
    address: str, *, service: str = "", timeout_s: float = 60.0, tls: TlsConfig | None = None
) -> None:
    """Waits until `address` reports SERVING on grpc.health.v1 (TimeoutError otherwise)."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    async with security.secure_aio_channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        last_error = "no answer"
        while loop.time() < give_up_at:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s ({last_error})")
