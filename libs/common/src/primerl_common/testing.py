"""Helpers for tests that run real services: services served in this process on port 0, bare
servers for stand-ins of a peer, waiting on a condition, and this process's RSS (overload tests
bound its growth). (Service processes and free ports: primerl_common.processes.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from primerl_common.client import make_channel
from primerl_common.config import ServiceConfig, TlsConfig
from primerl_common.server import GrpcService, ServiceDefinition, server_options

__all__ = ["InProcessService", "bare_server", "eventually", "in_process_service", "rss_bytes"]


@dataclasses.dataclass
class InProcessService:
    service: GrpcService
    address: str
    channel: grpc.aio.Channel  # make_channel's, to `address`


@contextlib.asynccontextmanager
async def in_process_service(
    definition: ServiceDefinition,
    config: ServiceConfig,
    *,
    grace_s: float = 0.0,
    max_attempts: int = 5,
    client_tls: TlsConfig | None = None,
) -> AsyncIterator[InProcessService]:
    """`definition` served in this process as its binary serves it (its config's `tls`), on
    the config's port (0: a free one), which must listen on 127.0.0.1 (the default 0.0.0.0
    does); a channel to it, showing `client_tls` (default: the process's identity). Stopped
    with `grace_s` on exit."""
    service = GrpcService(definition, config)
    address = f"127.0.0.1:{await service.start()}"
    try:
        async with make_channel(address, max_attempts=max_attempts, tls=client_tls) as channel:
            yield InProcessService(service, address, channel)
    finally:
        await service.stop(grace_s=grace_s)


@contextlib.asynccontextmanager
async def bare_server(
    *register: Callable[[grpc.aio.Server], object],
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> AsyncIterator[str]:
    """A plain gRPC server with primerl's server options on 127.0.0.1:`port` (0: a free one),
    serving what each `register(server)` adds (say `functools.partial(add_XServicer_to_server,
    fake)`): a stand-in for a peer. Its address; stopped at once on exit."""
    server = grpc.aio.server(interceptors=interceptors, options=server_options(64 * 1024 * 1024))
    for add in register:
        add(server)
    address = f"127.0.0.1:{server.add_insecure_port(f'127.0.0.1:{port}')}"
    await server.start()
    try:
        yield address
    finally:
        await server.stop(0)


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    *,
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    what: str = "the condition held",
) -> None:
    """Polls `check` (a plain or an async function) until it returns true; fails naming
    `what` once `timeout_s` has passed. For state another thread or process changes."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() >= give_up_at:
            raise AssertionError(f"gave up after {timeout_s:g} s waiting until {what}")
        await asyncio.sleep(interval_s)


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS): the memory of the services a test serves in
    it, whose growth under overload the overload tests bound."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")
