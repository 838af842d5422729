"""The service processes of a run, by name: started from the launcher's main thread (each in
its own session: a Ctrl-C reaches only the launcher, which then stops them in order), awaited
until SERVING, watched, restarted when one dies while the run goes on (same command: same
address, config and state folders; a bounded number of times, with a growing wait), and
stopped group by group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from primerl_common.processes import ServiceDied, ServiceProcess, describe_exit

__all__ = ["RestartPolicy", "RestartsExhausted", "ServiceGroup"]


@dataclass(frozen=True)
class RestartPolicy:
    """`max_restarts` per service over the run; the k-th restart of a service waits
    backoff_s * 2**(k-1), at most max_backoff_s."""

    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s} and {self.max_backoff_s}")

    def delay_s(self, restart: int) -> float:
        return min(self.backoff_s * 2.0 ** (restart - 1), self.max_backoff_s)


class RestartsExhausted(RuntimeError):
    """A service died once more after the restarts its policy allows."""

    def __init__(self, died: ServiceDied, max_restarts: int) -> None:
        self.name, self.returncode, self.max_restarts = died.name, died.returncode, max_restarts
        super().__init__(
            f"{died.name} died after {max_restarts} restart{'s' if max_restarts != 1 else ''}, "
            f"the most [launcher] max_restarts = {max_restarts} allows: {died}"
        )


class ServiceGroup:
    def __init__(self, *, log_tail_lines: int = 30) -> None:
        self.processes: dict[str, ServiceProcess] = {}
        self.log_tail_lines = log_tail_lines
        # Restarts so far, by name; the names being restarted now (dead, waiting or starting).
        self.restarts: dict[str, int] = {}
        self.restarting: set[str] = set()

    def add(self, process: ServiceProcess) -> ServiceProcess:
        self.processes[process.name] = process
        return process

    async def start(self, names: Iterable[str], *, timeout_s: float) -> None:
        """Starts the processes and waits until each is SERVING; ServiceDied as soon as any
        process of the group exits."""
        processes = [self.processes[name] for name in names]
        for process in processes:
            process.launch()
        waits = [
            asyncio.ensure_future(p.until_serving(timeout_s, num_tail_lines=self.log_tail_lines))
            for p in processes
            if p.address is not None
        ]
        watch = asyncio.ensure_future(self.watch())
        try:
            started = asyncio.gather(*waits)
            await asyncio.wait([started, watch], return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                watch.result()
            started.result()
        finally:
            for task in [*waits, watch]:
                task.cancel()
            await asyncio.gather(*waits, watch, return_exceptions=True)

    async def discard(self, name: str, *, grace_s: float) -> int | None:
        """Stops the process `name` and drops it from the group: it is no longer watched nor
        restarted (a restart already waiting for it gives up). Its exit code."""
        process = self.processes.pop(name)
        return await process.stop(grace_s)

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

    async def supervise(
        self,
        policy: RestartPolicy,
        *,
        start_timeout_s: float,
        say: Callable[[str], None],
        on_serving_again: Callable[[str], Awaitable[None]] | None = None,
        poll_s: float = 0.2,
    ) -> None:
        """Returns never: restarts each process that exits (with its command, log and
        environment), says so (`say`), and awaits `on_serving_again(name)` once it serves again.
        Raises RestartsExhausted when a process dies after its last allowed restart; an
        exception of `on_serving_again` is raised too."""
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for name, task in list(tasks.items()):
                    if task.done():
                        del tasks[name]
                        self.restarting.discard(name)
                        task.result()
                for name, process in self.processes.items():
                    if name in tasks or process.returncode is None:
                        continue
                    count = self.restarts.get(name, 0)
                    if count >= policy.max_restarts:
                        raise RestartsExhausted(process.died(self.log_tail_lines), policy.max_restarts)
                    self.restarts[name] = count + 1
                    self.restarting.add(name)
                    tasks[name] = asyncio.ensure_future(
                        self._restart(process, count + 1, policy, start_timeout_s, say, on_serving_again)
                    )
                await asyncio.sleep(poll_s)
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            self.restarting.clear()

    async def _restart(
        self,
        dead: ServiceProcess,
        restart: int,
        policy: RestartPolicy,
        start_timeout_s: float,
        say: Callable[[str], None],
        on_serving_again: Callable[[str], Awaitable[None]] | None,
    ) -> None:
        """One restart; a process that dies or never serves is left dead for `supervise` to see."""
        assert dead.returncode is not None
        name, delay_s = dead.name, policy.delay_s(restart)
        say(
            f"{name} {describe_exit(dead.returncode)}: restart {restart} of {policy.max_restarts} "
            f"in {delay_s:.1f}s (log: {dead.log_path})"
        )
        _kill_leftovers(dead)
        await asyncio.sleep(delay_s)
        if self.processes.get(name) is not dead:
            return  # discarded meanwhile
        process = ServiceProcess(dead.args, address=dead.address, name=name, log_path=dead.log_path, env=dead.env)
        dead.close()
        self.processes[name] = process
        process.launch()
        if process.address is None:
            return
        started_at = asyncio.get_running_loop().time()
        try:
            await process.until_serving(start_timeout_s, num_tail_lines=self.log_tail_lines)
        except ServiceDied:
            return
        except TimeoutError:
            say(f"{name} not SERVING {start_timeout_s:.0f}s after restart {restart}: killing it")
            process.kill()
            with contextlib.suppress(TimeoutError):
                await process.wait(10.0)
            return
        elapsed_s = asyncio.get_running_loop().time() - started_at
        say(f"{name} SERVING again at {process.address} (pid {process.pid}, started in {elapsed_s:.1f}s)")
        if on_serving_again is not None:
            await on_serving_again(name)

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


def _kill_leftovers(dead: ServiceProcess) -> None:
    """What the dead process started and left running (a child that does not watch its parent
    would hold its memory, or a port, into the restart): its session's process group, which it
    led (own session, pid = group id). vLLM's engine core process does exit on its own."""
    if dead.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(dead.pid, signal.SIGKILL)
