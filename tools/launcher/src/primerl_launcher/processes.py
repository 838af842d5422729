"""The service processes of a run: started from the launcher's main thread, each in its
own session (a Ctrl-C reaches only the launcher, which then stops them in order), logged
to a file, awaited until SERVING, watched, and stopped with SIGTERM, then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence

from primerl_common.client import wait_for_serving

__all__ = ["Fleet", "ServiceDied", "ServiceProcess", "describe_exit", "log_tail"]

# Linux: each service runs through this small program, which asks the kernel to send it
# SIGTERM when its parent (the launcher) dies, e.g. SIGKILLed before it could stop the
# services, and then execs the service in its place. (A preexec_fn would do the same, but
# forces a plain fork(), whose gRPC fork handlers complain about the launcher's channels.)
_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM)); "  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit('the launcher is gone'); "
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


def log_tail(path: pathlib.Path, num_lines: int) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


class ServiceDied(RuntimeError):
    def __init__(self, name: str, returncode: int, log_path: pathlib.Path, tail: str) -> None:
        self.name, self.returncode, self.log_path = name, returncode, log_path
        super().__init__(
            f"{name} {describe_exit(returncode)} (log: {log_path})"
            + (f"; last lines:\n{_indent(tail)}" if tail else "; its log is empty")
        )


def _indent(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.splitlines())


class ServiceProcess:
    """One process; `address` is None for a job that serves nothing to wait for."""

    def __init__(
        self, name: str, args: Sequence[str], *, log_path: pathlib.Path, address: str | None, env: dict[str, str]
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        self.address = address
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def start(self) -> None:
        # From the main thread: the parent-death signal follows the thread that forked.
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                _with_parent_death_signal(self.args),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def died(self, num_lines: int) -> ServiceDied:
        assert self.popen is not None and self.popen.returncode is not None
        return ServiceDied(self.name, self.popen.returncode, self.log_path, log_tail(self.log_path, num_lines))

    async def wait_exit(self, poll_s: float = 0.1) -> int:
        while (code := self.returncode) is None:  # noqa: ASYNC110 (Popen has no awaitable exit)
            await asyncio.sleep(poll_s)
        return code

    def signal(self, sig: signal.Signals) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM, then SIGKILL after grace_s. Returns the exit code."""
        if self.popen is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait_exit(), grace_s)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            return await self.wait_exit()


class Fleet:
    """The processes of a run, by name."""

    def __init__(self, *, log_tail_lines: int = 30) -> None:
        self.processes: dict[str, ServiceProcess] = {}
        self.log_tail_lines = log_tail_lines

    def add(self, process: ServiceProcess) -> ServiceProcess:
        self.processes[process.name] = process
        return process

    async def start(self, names: Iterable[str], *, timeout_s: float) -> None:
        """Starts the processes and waits until each is SERVING; ServiceDied if one exits first."""
        processes = [self.processes[name] for name in names]
        for process in processes:
            process.start()
        waits = {
            asyncio.ensure_future(wait_for_serving(p.address, timeout_s=timeout_s)): p for p in processes if p.address
        }
        try:
            while waits:
                done, _ = await asyncio.wait(waits, timeout=0.2)
                for task in done:
                    process = waits.pop(task)
                    try:
                        task.result()
                    except TimeoutError:
                        tail = log_tail(process.log_path, self.log_tail_lines)
                        raise TimeoutError(
                            f"{process.name} not SERVING at {process.address} after {timeout_s:.0f}s "
                            f"(log: {process.log_path}):\n{_indent(tail)}"
                        ) from None
                self.check()
        finally:
            for task in waits:
                task.cancel()

    def check(self) -> None:
        """Raises ServiceDied for the first process that has exited."""
        for process in self.processes.values():
            if process.returncode is not None:
                raise process.died(self.log_tail_lines)

    async def watch(self, poll_s: float = 0.2) -> None:
        """Returns never; raises ServiceDied once a process exits."""
        while True:
            self.check()
            await asyncio.sleep(poll_s)

    async def stop(self, order: Sequence[Sequence[str]], *, grace_s: float) -> dict[str, int | None]:
        """Stops the processes group by group (each group at once), then any left."""
        codes: dict[str, int | None] = {}
        named = {name for group in order for name in group}
        groups = [*order, [name for name in self.processes if name not in named]]
        for group in groups:
            live = [self.processes[name] for name in group if name in self.processes]
            results = await asyncio.gather(*(p.stop(grace_s) for p in live))
            codes.update({p.name: code for p, code in zip(live, results, strict=True)})
        return codes

    def kill(self) -> None:
        for process in self.processes.values():
            process.signal(signal.SIGKILL)
