"""ServiceProcess on small Python programs: a service that dies before SERVING or never serves is
named with the end of its log; SIGTERM ignored ends in SIGKILL; a crash with its children takes
them too. (A real service SERVING and draining: test_server.py.)"""

import os
import pathlib
import signal
import sys

import pytest

from primerl_common.processes import ServiceDied, ServiceProcess, free_port, free_ports
from primerl_common.testing import eventually

SLEEPER = "import time; print('loading', flush=True); time.sleep(60)"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_free_ports_are_distinct():
    assert len(set(free_ports(8))) == 8


async def test_a_service_that_exits_before_serving_is_named_with_its_log(tmp_path: pathlib.Path):
    log = tmp_path / "router.log"
    process = ServiceProcess(
        python("print('bad flag: --x'); raise SystemExit(3)"), port=free_port(), name="router", log_path=log
    )
    with pytest.raises(
        ServiceDied, match=r"^router exited with code 3 \(log: .*router\.log\); last lines:\n    \| bad flag"
    ):
        await process.start(timeout_s=30)
    assert process.returncode == 3 and log.read_text() == "bad flag: --x\n"


async def test_not_serving_in_time_is_a_timeout_quoting_its_output():
    process = ServiceProcess(python(SLEEPER), port=free_port())
    try:
        with pytest.raises(TimeoutError, match=r"not SERVING at 127\.0\.0\.1:\d+ after 1s:\n    \| loading"):
            await process.start(timeout_s=1)
    finally:
        assert await process.stop(grace_s=5) == -signal.SIGTERM
        process.close()


async def test_sigterm_ignored_ends_in_sigkill_after_the_grace():
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER
    process = ServiceProcess(python(code))
    process.launch()
    try:
        await eventually(lambda: "loading" in process.output(), what="the program started")
        assert await process.stop(grace_s=0.5) == -signal.SIGKILL
    finally:
        process.close()


async def test_a_crash_with_children_takes_the_children(tmp_path: pathlib.Path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import pathlib, subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid)); time.sleep(60)"
    )
    process = ServiceProcess(python(code))
    process.launch()
    try:
        await eventually(lambda: pid_file.is_file() and pid_file.read_text() != "", what="the child started")
        child = int(pid_file.read_text())
        process.kill(with_children=True)
        assert await process.wait(10) == -signal.SIGKILL
        await eventually(lambda: not _running(child), what=f"the child {child} was gone")
    finally:
        await process.stop(grace_s=1)
        process.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
