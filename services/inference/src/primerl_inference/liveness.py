"""Whether the vLLM engine this service fronts is alive, and what a call gets when it is not.

AsyncLLM runs its engine core in a child process and notices that process's death within a
second (vLLM's own monitor thread); from then on every engine call raises `EngineDeadError`.
The service cannot do its work without the engine, and vLLM cannot start a new one in a
process whose engine died: calls get UNAVAILABLE naming the dead engine (clients go to another
replica), and the process is stopped to be restarted (server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from primerl_common.errors import Unavailable

__all__ = ["EngineLiveness"]

_POLL_S = 0.2


class EngineLiveness:
    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm

    @property
    def dead(self) -> bool:
        return self._llm.errored

    def reason(self) -> str:
        return f"the vLLM engine process died{_exit_note(self._llm)}: this replica serves nothing until restarted"

    def check(self) -> None:
        """UNAVAILABLE when the engine is dead."""
        if self.dead:
            raise Unavailable(self.reason(), reason="ENGINE_DEAD")

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        """Turns an engine call's failure into UNAVAILABLE when the engine died under it."""
        try:
            yield
        except EngineDeadError:
            raise Unavailable(self.reason(), reason="ENGINE_DEAD") from None
        except Exception:
            if self.dead:
                raise Unavailable(self.reason(), reason="ENGINE_DEAD") from None
            raise

    async def until_dead(self) -> str:
        """Returns (the reason) once the engine is dead."""
        while not self.dead:  # noqa: ASYNC110 (vLLM sets a flag from its monitor thread; nothing to await)
            await asyncio.sleep(_POLL_S)
        return self.reason()


def _exit_note(llm: AsyncLLM) -> str:
    """ " (pid 123, exit code -9)" where vLLM's process manager tells; "" otherwise."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    processes = getattr(manager, "processes", None) or []
    exited = [p for p in processes if p.exitcode is not None]
    if not exited:
        return ""
    return "".join(f" (pid {p.pid}, exit code {p.exitcode})" for p in exited)
