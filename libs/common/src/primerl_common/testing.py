"""Helpers for tests that run real services: free ports, services served in this process
on port 0 (and bare servers for stand-ins of a peer), and service processes started,
awaited until SERVING, and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from primerl_common.client import make_channel, wait_for_serving
from primerl_common.config import ServiceConfig
from primerl_common.server import GrpcService, ServiceDefinition, server_options

__all__ = ["InProcessService", "ServiceProcess", "bare_server", "eventually", "free_port", "in_process_service"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class InProcessService:
    service: GrpcService
    address: str
    channel: grpc.aio.Channel  # make_channel's, to `address`


@contextlib.asynccontextmanager
async def in_process_service(
    definition: ServiceDefinition, config: ServiceConfig, *, grace_s: float = 0.0, max_attempts: int = 5
) -> AsyncIterator[InProcessService]:
    """`definition` served in this process as its binary serves it, on the config's port (0: a
    free one), which must listen on 127.0.0.1 (the default 0.0.0.0 does); a channel to it.
    Stopped with `grace_s` on exit."""
    service = GrpcService(definition, config)
    address = f"127.0.0.1:{await service.start()}"
    try:
        async with make_channel(address, max_attempts=max_attempts) as channel:
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


class ServiceProcess:
    """A service binary in a subprocess listening on 127.0.0.1:`port`.
    `args` must make it listen there (e.g. `--server.port PORT`)."""

    def __init__(self, args: Sequence[str], *, port: int, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self._env = {**os.environ, **(env or {})}
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in __aexit__)
        self.process: subprocess.Popen[str] | None = None

    async def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        self.process = subprocess.Popen(  # noqa: ASYNC220 (Popen returns at once)
            self.args, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=self._env
        )
        serving = asyncio.ensure_future(wait_for_serving(self.address, timeout_s=timeout_s))
        while not serving.done():
            if self.process.poll() is not None:
                serving.cancel()
                raise RuntimeError(f"{self.args[0]} exited with {self.process.returncode}:\n{self.output()}")
            await asyncio.sleep(0.05)
        try:
            serving.result()
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.output()}") from None
        return self

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    async def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        return await asyncio.to_thread(self.process.wait, timeout_s)

    async def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after timeout_s. Returns the exit code."""
        if self.process is None:
            return 0
        self.terminate()
        try:
            return await self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return await self.wait(timeout_s)

    async def __aenter__(self) -> ServiceProcess:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        self._log.close()
