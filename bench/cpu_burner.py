"""A lightly loaded machine, made on purpose: one process at nice 0, on any core, spinning for
half of each second and sleeping the other half. The overhead benches take `--burner` to run
beside it, so that a target is shown to hold with another job on the machine, not only on a
quiet one (issue 24).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["cpu_burner"]

_BURN = """
import os, time
os.sched_setaffinity(0, range(os.cpu_count()))
busy_s, period_s = {busy_s!r}, {period_s!r}
while True:
    started = time.monotonic()
    while time.monotonic() - started < busy_s:
        pass
    time.sleep(period_s - busy_s)
"""


@contextlib.contextmanager
def cpu_burner(enabled: bool = True, *, duty: float = 0.5, period_s: float = 1.0) -> Iterator[str]:
    """Runs the burner (when `enabled`) for the block; yields a line saying what runs beside."""
    if not enabled:
        yield "burner: none"
        return
    if not 0 < duty < 1:
        raise ValueError(f"duty must be in (0, 1), got {duty}")
    code = _BURN.format(busy_s=duty * period_s, period_s=period_s)
    burner = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ""})
    try:
        yield f"burner: one process (pid {burner.pid}, nice 0, any core) busy {duty:.0%} of every {period_s:g} s"
    finally:
        burner.kill()
        burner.wait()
