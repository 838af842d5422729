"""The programs that play process environments: each started with the service, watched,
restarted when it dies (bounded, with backoff), stopped with the service. The program reaches
the orchestrator through its gRPC API only, so its crash costs the episodes it was playing
(dropped at once, so their groups end and the run goes on) and nothing else; once it has died
more than max_restarts times the run fails, saying why.

Under mutual TLS the program shows a certificate of its own (options.tls_cert/tls_key, role
`environment`: it may call the environment API and nothing else), never the orchestrator's:
an environment is often someone else's code, and with the orchestrator's key it could push
batches to the trainer. It gets it, with the orchestrator's CA, as its process identity
(PRIMERL_TLS_*, primerl_common.security). Run it as another user where its code is not trusted
to leave the orchestrator's key file alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import time
from collections.abc import Callable

from primerl_common import security
from primerl_common.config import ConfigError, ServerConfig
from primerl_common.processes import ServiceProcess, describe_exit
from primerl_orchestrator.environments.base import ProcessEnvironment

__all__ = ["EnvironmentProcess", "identity_env", "local_address"]

logger = logging.getLogger(__name__)

# A process that lived this long before dying starts the backoff over.
_HEALTHY_AFTER_S = 60.0
_LOG_TAIL_LINES = 30
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def local_address(server: ServerConfig) -> str:
    """Where a process on this machine reaches the orchestrator."""
    if server.port == 0:
        raise ValueError(
            "a process environment reaches the orchestrator at server.port: set one (not 0, which picks a free "
            "port at start)"
        )
    host = "127.0.0.1" if server.host in _WILDCARD_HOSTS else server.host
    return f"{host}:{server.port}"


def identity_env(name: str, options: ProcessEnvironment.Options) -> dict[str, str]:
    """The environment variables that give environment `name`'s program its identity: its own
    certificate under this process's mtls, nothing in plaintext. Raises ConfigError when mtls
    and options.tls_cert/tls_key are not set."""
    tls = security.process_tls()
    if tls is None or tls.mode != "mtls":
        return {}
    if options.tls_cert is None or options.tls_key is None:
        raise ConfigError(
            f"invalid configuration:\n  environments[{name}].options.tls_cert, tls_key: required under tls.mode mtls "
            "(the certificate its process shows: role environment, e.g. primerl-certs DIR --services "
            "environment:environment)"
        )
    prefix = security.ENV_PREFIX
    return {
        prefix + "MODE": "mtls",
        prefix + "CERT": str(options.tls_cert.resolve()),
        prefix + "KEY": str(options.tls_key.resolve()),
        prefix + "CA": str(pathlib.Path(str(tls.ca)).resolve()),
    }


class EnvironmentProcess:
    """The program of environment `name`. `abandon(reason)` drops the episodes it was playing
    when it died (returns how many); `fail(error)` fails the run once it may not restart."""

    def __init__(
        self,
        name: str,
        environment: ProcessEnvironment,
        *,
        orchestrator: str,
        abandon: Callable[[str], int],
        fail: Callable[[str], None],
    ) -> None:
        self.name = name
        self.options = environment.options
        self.command = environment.command(name=name, orchestrator=orchestrator)
        self.env = identity_env(name, environment.options)
        self._abandon = abandon
        self._fail = fail
        self.process: ServiceProcess | None = None
        self.num_restarts = 0
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        assert self._watcher is None, f"environment {self.name}'s process was started already"
        self._watcher = asyncio.create_task(self._watch(), name=f"environment-process-{self.name}")

    @property
    def done(self) -> bool:
        """True once it will not start the program again (finished, given up on, or stopped)."""
        return self._watcher is not None and self._watcher.done()

    async def stop(self, grace_s: float = 5.0) -> None:
        """No more restarts; the program gets SIGTERM, then SIGKILL after `grace_s`."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.process is not None:
            await self.process.stop(grace_s)
            self.process.close()

    async def _watch(self) -> None:
        backoff_s = self.options.restart_backoff_s
        while True:
            self.process = ServiceProcess(
                self.command, name=f"environment {self.name}", log_path=self.options.log_file, env=self.env
            )
            self.process.launch()
            started = time.monotonic()
            logger.info(
                "started environment %s's process (pid %d)",
                self.name,
                self.process.pid,
                extra={"environment": self.name},
            )
            code = await self.process.wait()
            lived_s = time.monotonic() - started
            abandoned = self._abandon(f"its environment process {describe_exit(code)}")
            if code == 0:
                logger.info("environment %s's process finished: the run is over", self.name)
                return
            tail = self.process.log_tail(_LOG_TAIL_LINES)
            self.process.close()
            if self.num_restarts >= self.options.max_restarts:
                error = (
                    f"environment {self.name}'s process {describe_exit(code)} after {self.num_restarts} restarts "
                    f"(max_restarts {self.options.max_restarts})"
                )
                logger.error("%s; last lines:\n%s", error, tail, extra={"environment": self.name})
                self._fail(error)
                return
            if lived_s >= _HEALTHY_AFTER_S:
                backoff_s = self.options.restart_backoff_s
            self.num_restarts += 1
            logger.warning(
                "environment %s's process %s after %.1fs; %d episodes it was playing are dropped; restart %d of "
                "at most %d in %.1fs; last lines:\n%s",
                self.name,
                describe_exit(code),
                lived_s,
                abandoned,
                self.num_restarts,
                self.options.max_restarts,
                backoff_s,
                tail,
                extra={"environment": self.name},
            )
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, self.options.max_restart_backoff_s)
