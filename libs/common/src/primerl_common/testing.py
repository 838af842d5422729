"""Helpers for tests that run real services: free ports and service
processes started, awaited until SERVING, and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Sequence

from primerl_common.client import wait_for_serving

__all__ = ["ServiceProcess", "eventually", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
