"""The service processes of a run, by name: started from the launcher's main thread (each in
its own session: a Ctrl-C reaches only the launcher, which then stops them in order), awaited
until SERVING, watched, and stopped group by group."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable, Sequence

from primerl_common.processes import ServiceProcess

__all__ = ["ServiceGroup"]


class ServiceGroup:
    def __init__(self, *, log_tail_lines: int = 30) -> None:
        self.processes: dict[str, ServiceProcess] = {}
        self.log_tail_lines = log_tail_lines

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
