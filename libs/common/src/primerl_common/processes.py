"""Service processes, for the launcher and for tests that run real services: free ports, and a
service binary in a subprocess, logged to a file, awaited until SERVING, watched, and stopped
with SIGTERM, then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from primerl_common.client import wait_for_serving

__all__ = ["ServiceDied", "ServiceProcess", "describe_exit", "free_port", "free_ports"]

# How much of the end of a log a failure quotes.
_TAIL_BYTES = 64 * 1024
DEFAULT_TAIL_LINES = 60


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (held together while chosen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


# Linux: each service runs through this small program, which asks the kernel to send it
# SIGTERM when its parent dies (a launcher or a test run SIGKILLed before it could stop its
# services), then execs the service in its place (same pid). A preexec_fn would do the same but
# forces a plain fork(), whose gRPC fork handlers complain about the parent's channels.
_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM)); "  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit('the parent is gone'); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def _with_parent_death_signal(args: Sequence[str]) -> list[str]:
    if sys.platform != "linux":
        return list(args)
    return [sys.executable, "-c", _WITH_PARENT_DEATH_SIGNAL, str(os.getpid()), *args]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _log_note(log_path: pathlib.Path | None) -> str:
    return f" (log: {log_path})" if log_path is not None else ""


def _indent(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.splitlines())


class ServiceDied(RuntimeError):
    def __init__(self, name: str, returncode: int, log_path: pathlib.Path | None, tail: str) -> None:
        self.name, self.returncode, self.log_path = name, returncode, log_path
        super().__init__(
            f"{name} {describe_exit(returncode)}{_log_note(log_path)}"
            + (f"; last lines:\n{_indent(tail)}" if tail else "; its log is empty")
        )


class ServiceProcess:
    """A service binary in a subprocess, in its own session (a Ctrl-C reaches only its parent,
    which stops it; on Linux it gets SIGTERM when its parent dies). `args` must make it serve
    gRPC health at `address` (or at 127.0.0.1:`port`); with neither it is a job that serves
    nothing. Its output goes to `log_path` (appended) or, without one, to an anonymous
    temporary file; `env` is laid over this process's environment."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int | None = None,
        address: str | None = None,
        name: str | None = None,
        log_path: pathlib.Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if port is not None and address is not None:
            raise ValueError("give a port or an address, not both")
        self.args = list(args)
        self.port = port
        self.address = f"127.0.0.1:{port}" if port is not None else address
        self.name = name or pathlib.Path(self.args[0]).name
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen[bytes] | None = None
        self._log = None if log_path is not None else tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def launch(self) -> None:
        """Starts the process and returns at once. Call it from the thread that outlives the
        process (the main one): the parent-death signal follows the thread that forked."""
        assert self.popen is None, f"{self.name} was launched already"
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("ab")
        else:
            assert self._log is not None, f"{self.name}'s log was closed"
            log = self._log
        try:
            self.popen = subprocess.Popen(
                _with_parent_death_signal(self.args),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        finally:
            if log is not self._log:
                log.close()

    async def until_serving(self, timeout_s: float, *, num_tail_lines: int = DEFAULT_TAIL_LINES) -> None:
        """Waits until the process reports SERVING; ServiceDied if it exits first, TimeoutError
        (quoting its log) after timeout_s."""
        assert self.address is not None, f"{self.name} serves nothing to wait for"
        serving = asyncio.ensure_future(wait_for_serving(self.address, timeout_s=timeout_s))
        try:
            while not serving.done():
                if self.returncode is not None:
                    raise self.died(num_tail_lines)
                await asyncio.wait({serving}, timeout=0.05)
            try:
                serving.result()
            except TimeoutError:
                raise TimeoutError(
                    f"{self.name} not SERVING at {self.address} after {timeout_s:.0f}s"
                    f"{_log_note(self.log_path)}:\n{_indent(self.log_tail(num_tail_lines))}"
                ) from None
        finally:
            serving.cancel()

    async def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        """Launched and SERVING (see until_serving)."""
        self.launch()
        await self.until_serving(timeout_s)
        return self

    def _log_bytes(self, max_bytes: int | None = None) -> bytes:
        if self._log is not None:
            if self._log.closed:
                return b""
            fd = self._log.fileno()
            size = os.fstat(fd).st_size
            start = 0 if max_bytes is None else max(0, size - max_bytes)
            return os.pread(fd, size - start, start)
        assert self.log_path is not None
        try:
            with self.log_path.open("rb") as log:
                if max_bytes is not None:
                    log.seek(0, os.SEEK_END)
                    log.seek(max(0, log.tell() - max_bytes))
                return log.read()
        except OSError:
            return b""

    def output(self) -> str:
        """Everything it wrote so far (stdout and stderr)."""
        return self._log_bytes().decode(errors="replace")

    def log_tail(self, num_lines: int) -> str:
        lines = self._log_bytes(_TAIL_BYTES).decode(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def died(self, num_tail_lines: int = DEFAULT_TAIL_LINES) -> ServiceDied:
        assert self.popen is not None and self.popen.returncode is not None
        return ServiceDied(self.name, self.popen.returncode, self.log_path, self.log_tail(num_tail_lines))

    def signal(self, sig: signal.Signals) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self, *, with_children: bool = False) -> None:
        """SIGKILL, as a crash. `with_children`: every process it started too (they share its
        session's process group), as when a whole container or node goes."""
        if not with_children:
            self.signal(signal.SIGKILL)
        elif self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)

    async def wait(self, timeout_s: float | None = None, *, poll_s: float = 0.05) -> int:
        """Its exit code, once it has exited; TimeoutError after timeout_s."""
        assert self.popen is not None, f"{self.name} was never launched"
        async with asyncio.timeout(timeout_s):
            while (code := self.popen.poll()) is None:  # noqa: ASYNC110 (Popen has no awaitable exit)
                await asyncio.sleep(poll_s)
        return code

    async def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after grace_s. Its exit code (None if never launched)."""
        if self.popen is None:
            return None
        self.terminate()
        try:
            return await self.wait(grace_s)
        except TimeoutError:
            self.kill()
            return await self.wait()

    def close(self) -> None:
        """Drops the temporary log (output() is empty after)."""
        if self._log is not None:
            self._log.close()

    async def __aenter__(self) -> ServiceProcess:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop()
        finally:
            self.close()
