"""The watch over a process environment's program (real subprocesses): a program that keeps
dying is restarted at most max_restarts times, its episodes abandoned each time, then the run
fails naming it; one that exits 0 (the run is over) is not restarted; the address a program
reaches the orchestrator at."""

from __future__ import annotations

import json
import sys

import pytest

from primerl_common import security
from primerl_common.config import ConfigError, ServerConfig
from primerl_common.security import _credentials
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.testing import eventually
from primerl_orchestrator.environments import ProcessEnvironment, Task
from primerl_orchestrator.environments.processes import EnvironmentProcess, local_address


class Program(ProcessEnvironment):
    """Runs `code` with this Python (no kind: never registered)."""

    code = "import sys; sys.exit(3)"

    def task(self, index: int) -> Task:
        return Task(task_id=str(index))

    def command(self, *, name: str, orchestrator: str) -> list[str]:
        return [sys.executable, "-c", self.code]


def watched(code: str, **options) -> tuple[EnvironmentProcess, list[str], list[str]]:
    environment = Program(Program.Options(restart_backoff_s=0.05, **options), seed=0)
    environment.code = code
    abandoned: list[str] = []
    failed: list[str] = []

    def abandon(reason: str) -> int:
        abandoned.append(reason)
        return 0

    process = EnvironmentProcess("prog", environment, orchestrator="127.0.0.1:1", abandon=abandon, fail=failed.append)
    return process, abandoned, failed


async def test_a_program_that_keeps_dying_is_restarted_max_restarts_times_then_the_run_fails():
    process, abandoned, failed = watched("import sys; print('boom'); sys.exit(3)", max_restarts=2)
    process.start()
    try:
        await eventually(lambda: failed, timeout_s=30, what="the run failed")
    finally:
        await process.stop()
    assert process.num_restarts == 2 and process.done
    assert abandoned == ["its environment process exited with code 3"] * 3
    assert failed == ["environment prog's process exited with code 3 after 2 restarts (max_restarts 2)"]


async def test_a_program_that_exits_0_is_not_restarted():
    process, abandoned, failed = watched("pass")
    process.start()
    try:
        await eventually(lambda: abandoned, timeout_s=30, what="the program exited")
        await eventually(lambda: process.done, timeout_s=5, what="the watch ended")
    finally:
        await process.stop()
    assert process.num_restarts == 0 and failed == []


async def test_stop_ends_a_running_program_without_a_restart():
    process, abandoned, failed = watched("import time; time.sleep(60)")
    process.start()
    await eventually(lambda: process.process is not None and process.process.pid, timeout_s=10, what="started")
    await process.stop(grace_s=5)
    assert process.process.returncode is not None
    assert (process.num_restarts, abandoned, failed) == (0, [], [])


def test_the_address_a_program_reaches_the_orchestrator_at():
    assert local_address(ServerConfig(host="0.0.0.0", port=50051)) == "127.0.0.1:50051"
    assert local_address(ServerConfig(host="10.1.2.3", port=7)) == "10.1.2.3:7"
    with pytest.raises(ValueError, match=r"server\.port"):
        local_address(ServerConfig(host="127.0.0.1", port=0))


async def test_under_mtls_the_program_shows_its_environment_certificate_not_the_orchestrators(tmp_path, monkeypatch):
    authority = make_authority(tmp_path)
    for holder in ("orchestrator", "environment:environment"):
        make_certificate(authority, tmp_path, Holder.parse(holder))
    for name in ("MODE", "CERT", "KEY", "CA"):
        monkeypatch.setenv(security.ENV_PREFIX + name, "")  # restored after the test
    monkeypatch.setattr(_credentials, "_process", None)
    security.setup_process_tls(tls_of(tmp_path, "orchestrator"))
    with pytest.raises(ConfigError, match=r"environments\[prog\]\.options\.tls_cert"):
        watched("pass")
    out = tmp_path / "identity.json"
    code = (
        "import json, pathlib; from primerl_common import security; tls = security.process_tls(); "
        "identity = security.certificate_identity(pathlib.Path(tls.cert).read_bytes()); "
        f"pathlib.Path({str(out)!r}).write_text(json.dumps([tls.mode, str(tls.key), str(tls.ca), identity[0], "
        "sorted(identity[1])]))"
    )
    process, abandoned, failed = watched(
        code, tls_cert=tmp_path / "environment.pem", tls_key=tmp_path / "environment-key.pem"
    )
    process.start()
    try:
        await eventually(lambda: abandoned, timeout_s=30, what="the program exited")
    finally:
        await process.stop()
    assert failed == [] and process.process.returncode == 0
    assert json.loads(out.read_text()) == [
        "mtls",
        str((tmp_path / "environment-key.pem").resolve()),
        str((tmp_path / "ca.pem").resolve()),
        "environment",
        ["environment"],
    ]
