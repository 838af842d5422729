"""The grpc.aio server bootstrap every primerl service runs.

A service describes itself with a `ServiceDefinition` (its servicers, its
capabilities, start and stop hooks); `GrpcService` serves it with health,
reflection and the shared interceptors, and shuts down gracefully: on SIGTERM
health turns NOT_SERVING, new calls are refused, in-flight calls get
`server.grace_s` to finish, then the stop hooks run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import inspect
import logging
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import timestamp_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from primerl.common.v1 import service_info_pb2
from primerl_common import observability, security
from primerl_common.admission import AdmissionInterceptor
from primerl_common.config import ConfigError, ServiceConfig, parse_command_line
from primerl_common.errors import ErrorInterceptor, Unimplemented
from primerl_common.sealed_streams import (
    OPEN_METHOD,
    SEALED_CAPABILITY,
    SEALED_SERVICE_NAME,
    STREAM_METHOD,
    SealedStreamServicer,
    add_sealed_stream_service,
    sealed_handlers,
)

__all__ = [
    "KEEPALIVE",
    "GrpcService",
    "Keepalive",
    "ServiceDefinition",
    "channel_options",
    "prepare",
    "run_main",
    "server_options",
]

logger = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Keepalive:
    """Both sides ping an idle connection every `time_ms` to notice a dead peer, and close it
    when a ping is not answered within `timeout_ms`."""

    time_ms: int = 30_000
    timeout_ms: int = 20_000

    @property
    def min_ping_interval_ms(self) -> int:
        """The shortest gap between two pings a server admits. Keepalive pings come `time_ms`
        apart, less the delay of a late one (a busy process, timer slack), which is at most
        `timeout_ms` (by then its sender has given the connection up)."""
        return self.time_ms - self.timeout_ms


KEEPALIVE = Keepalive()


def _transport_options(max_message_bytes: int, keepalive: Keepalive) -> list[tuple[str, Any]]:
    # Message limits sized for tensor chunks and large flow-control windows (gRPC streams
    # reach about half of a raw socket only with both raised); keepalive pings also while
    # no call is open (a follower's stream may be the only one, and quiet for minutes).
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.lookahead_bytes", 16 * 1024 * 1024),
        ("grpc.keepalive_time_ms", keepalive.time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(max_message_bytes: int, *, keepalive: Keepalive = KEEPALIVE) -> list[tuple[str, Any]]:
    """Options of every channel to a primerl server (see server_options), the reconnect cap
    (security.MAX_RECONNECT_BACKOFF_MS) among them."""
    return [
        *_transport_options(max_message_bytes, keepalive),
        ("grpc.max_reconnect_backoff_ms", security.MAX_RECONNECT_BACKOFF_MS),
    ]


def server_options(max_message_bytes: int, *, keepalive: Keepalive = KEEPALIVE) -> list[tuple[str, Any]]:
    """Options of every primerl server. A gRPC server counts a ping that comes sooner than
    it admits after the previous one (5 min by default, 2 h on a connection without calls
    unless permitted) as a strike, and answers the third with GOAWAY "too_many_pings"
    (strikes are forgotten when it writes data): it admits the clients' keepalive pings
    (Keepalive.min_ping_interval_ms). gRPC ignores option names it does not know: the
    admitted interval is read from "grpc.http2.min_ping_interval_without_data_ms" (the
    value of GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)."""
    return [
        *_transport_options(max_message_bytes, keepalive),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive.min_ping_interval_ms),
    ]


@dataclass
class ServiceDefinition:
    """What one service serves. `servicers` pairs each generated
    `add_XServicer_to_server` function with its servicer instance and the
    service's descriptor (for health and reflection)."""

    name: str
    version: str
    servicers: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any, Any]]
    capabilities: Sequence[str] = ()
    attributes: dict[str, str] = field(default_factory=dict)
    on_start: Sequence[Hook] = ()
    # Run after the gRPC server stopped (in-flight calls are done): release engines, files, tasks.
    on_stop: Sequence[Hook] = ()
    # Run when draining starts, before the server stops accepting calls.
    on_drain: Sequence[Hook] = ()
    # Full method names ("/pkg.Service/Method") served without the shared per-call span and
    # primerl_grpc_server_* metrics (errors are still mapped): hot pass-through paths that
    # keep metrics of their own.
    unobserved_methods: Collection[str] = ()
    # Full method name -> the roles allowed to call it (security.method_roles of each servicer's
    # descriptor; security.ANY: any authenticated caller). Enforced under tls.mode mtls, where a
    # served method without an entry stops the start; health, reflection and GetServiceInfo are open.
    permissions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Client-streaming methods (full names) also taken as sealed streams on server.sealed_port
    # (primerl_common.sealed_streams): the weight pushes.
    sealed_methods: Collection[str] = ()
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: timestamp_pb2.Timestamp = field(default_factory=lambda: _now())
    # The health the server reports: a service whose backend fails (a dead engine) sets its
    # services (and "") NOT_SERVING here, SERVING once it recovers; draining overrides both.
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)

    @property
    def service_names(self) -> list[str]:
        return [descriptor.full_name for _, _, descriptor in self.servicers]

    def info(self) -> service_info_pb2.ServiceInfo:
        """The ServiceInfo each servicer's GetServiceInfo returns."""
        return service_info_pb2.ServiceInfo(
            service_name=self.name,
            package_version=self.version,
            api_versions=sorted({name.rsplit(".", 1)[0] for name in self.service_names}),
            capabilities=list(self.capabilities),
            attributes=self.attributes,
            instance_id=self.instance_id,
            started_at=self.started_at,
        )


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def _answer_unimplemented(servicer: Any, descriptor: Any, definition: ServiceDefinition) -> None:
    """Methods the servicer leaves to the generated base class (a sync method
    that raises NotImplementedError, which grpc logs as a crash) answer
    UNIMPLEMENTED through the error mapping instead."""
    for method in descriptor.methods:
        if inspect.iscoroutinefunction(getattr(servicer, method.name)):
            continue
        if inspect.isasyncgenfunction(getattr(servicer, method.name)):
            continue
        message = f"{descriptor.full_name}/{method.name} is not implemented by {definition.name} {definition.version}"

        async def unimplemented(request: Any, context: grpc.aio.ServicerContext, message: str = message) -> None:
            raise Unimplemented(message)

        setattr(servicer, method.name, unimplemented)


class _SharedInterceptors(grpc.aio.ServerInterceptor):
    """The shared interceptors as one: observers (span, metrics) around the authorization and
    the error mapping; for unobserved methods those two alone. Each interceptor's wrapping depends on
    the method alone (what a call needs it reads from the servicer context), so a method's
    handler is wrapped at its first call and kept, rather than wrapped again per call."""

    def __init__(
        self,
        observers: Sequence[grpc.aio.ServerInterceptor],
        authorization: security.AuthorizationInterceptor,
        admission: AdmissionInterceptor,
        errors: ErrorInterceptor,
        *,
        unobserved: Collection[str],
    ) -> None:
        # Admission after authorization: a caller refused there takes no slot, and admission
        # keys its per-caller limits on the identity authorization found.
        self._chain = [*observers, authorization, admission, errors]
        self._unobserved_chain = [authorization, admission, errors]
        self._unobserved = frozenset(unobserved)
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._handlers.get(method)
        if handler is None:
            chain = self._unobserved_chain if method in self._unobserved else self._chain
            for interceptor in reversed(chain):
                continuation = functools.partial(interceptor.intercept_service, continuation)
            handler = await continuation(details)
            if handler is not None:  # None: an unknown method, answered UNIMPLEMENTED by grpc
                self._handlers[method] = handler
        return handler


# Any caller with a certificate may ask for sessions (OpenSealedStreams then checks the roles of
# the method asked for); a sealed stream authenticates by its session's key.
SEALED_PERMISSIONS = {OPEN_METHOD: security.ANY, STREAM_METHOD: security.ANY}


class GrpcService:
    """Serves a ServiceDefinition. Use `await start()`, then `await stop()`
    (or `wait_for_termination()` with signal handlers installed by run_main)."""

    def __init__(self, definition: ServiceDefinition, config: ServiceConfig) -> None:
        self.definition = definition
        self.config = config
        self.health = definition.health
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None
        self.port = 0
        self.sealed_port: int | None = None  # bound when server.sealed_port is set
        # The admission limits in force once started (their counts; tests lower a limit of a
        # running service through it).
        self.admission: AdmissionInterceptor | None = None

    async def start(self) -> int:
        server_config = self.config.server
        tls = self.config.tls
        tls.check(server_config.host)
        if tls.mode == "mtls":
            _check_permissions(self.definition)
        sealed = bool(self.definition.sealed_methods)
        if server_config.sealed_port is not None and tls.mode != "mtls":
            raise ConfigError("server.sealed_port: sealed streams take their keys over mutual TLS (tls.mode = mtls)")
        if server_config.sealed_port is not None and not sealed:
            raise ConfigError(f"server.sealed_port: {self.definition.name} takes no sealed streams (leave it unset)")
        resolver = security.CallerResolver(mode=tls.mode, tokens=security.load_tokens(tls.tokens_file))
        authorization = security.AuthorizationInterceptor(
            resolver,
            {**self.definition.permissions, **(SEALED_PERMISSIONS if sealed else {})},
            service=self.definition.name,
            self_authenticated=(STREAM_METHOD,) if sealed else (),
        )
        self.admission = AdmissionInterceptor(self.config.admission)
        interceptor = _SharedInterceptors(
            observability.server_interceptors(),
            authorization,
            self.admission,
            ErrorInterceptor(),
            unobserved=self.definition.unobserved_methods,
        )
        self._server = grpc.aio.server(
            interceptors=[interceptor], options=server_options(server_config.max_message_bytes)
        )
        for add_to_server, servicer, descriptor in self.definition.servicers:
            _answer_unimplemented(servicer, descriptor, self.definition)
            add_to_server(servicer, self._server)
        sealed_names = []
        if sealed:
            handlers = sealed_handlers(self.definition.servicers, self.definition.sealed_methods)
            add_sealed_stream_service(
                SealedStreamServicer(handlers, authorization, lambda: self.sealed_port), self._server
            )
            sealed_names.append(SEALED_SERVICE_NAME)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            [*self.definition.service_names, *sealed_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        address = f"{server_config.host}:{server_config.port}"
        if tls.mode == "mtls":
            self.port = self._server.add_secure_port(address, security.server_credentials(tls))
        else:
            self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {server_config.host}:{server_config.port}")
        if sealed and server_config.sealed_port is not None:
            # Plaintext: a sealed stream's frames are sealed with a key handed out over mTLS, and
            # every other method is refused here (no client certificate).
            self.sealed_port = self._server.add_insecure_port(f"{server_config.host}:{server_config.sealed_port}")
            if self.sealed_port == 0:
                raise OSError(f"cannot bind server.sealed_port {server_config.host}:{server_config.sealed_port}")
            if SEALED_CAPABILITY not in self.definition.capabilities:  # a definition started again
                self.definition.capabilities = [*self.definition.capabilities, SEALED_CAPABILITY]
        for hook in self.definition.on_start:
            await hook()
        await self._server.start()
        for name in ["", *self.definition.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "serving %s %s on port %d (%s)",
            self.definition.name,
            self.definition.version,
            self.port,
            "mutual TLS" if tls.mode == "mtls" else "PLAINTEXT, loopback only: no identities, no permissions",
            extra={"port": self.port, "instance_id": self.definition.instance_id, "tls_mode": tls.mode},
        )
        return self.port

    def request_stop(self) -> None:
        """Starts a graceful stop from a signal handler (idempotent)."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self.stop())

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is None or self._stopped.is_set():
            return
        grace = self.config.server.grace_s if grace_s is None else grace_s
        logger.info("draining %s: NOT_SERVING, in-flight calls get %.1fs", self.definition.name, grace)
        await self.health.enter_graceful_shutdown()
        for hook in self.definition.on_drain:
            await hook()
        # Health checkers and routers see NOT_SERVING and move traffic away
        # before the server starts refusing new calls.
        await asyncio.sleep(self.config.server.drain_delay_s if grace_s is None else 0)
        await self._server.stop(grace)
        for hook in self.definition.on_stop:
            try:
                await hook()
            except Exception:
                logger.exception("stop hook of %s failed", self.definition.name)
        self._stopped.set()
        logger.info("stopped %s", self.definition.name)

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


def _check_permissions(definition: ServiceDefinition) -> None:
    """Every served method names its roles: a method left out would be refused to everyone."""
    missing = [
        f"/{descriptor.full_name}/{method.name}"
        for _, _, descriptor in definition.servicers
        for method in descriptor.methods
        if f"/{descriptor.full_name}/{method.name}" not in definition.permissions
    ]
    if missing:
        raise ValueError(f"{definition.name}: no roles for {', '.join(missing)} (ServiceDefinition.permissions)")


C = TypeVar("C", bound=ServiceConfig)


def freeze_startup_heap() -> None:
    """Moves every object made so far (imports, engines, models) out of the garbage
    collector's way, as vLLM's own server does once started. Otherwise an unlucky call now and
    then sets off a full collection that walks them all (with torch and vLLM loaded, some
    600k objects, 0.2-0.3 s of CPU) while the event loop and every call wait."""
    gc.collect()
    gc.freeze()


def _cancelled_is_no_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's exception handler, less the CancelledError of a task cancelled on purpose:
    grpc.aio's server cancels the RPC tasks still running when it stops, and a callback that
    reads such a task's exception gets the CancelledError itself (grpc/grpc#24716 is one case);
    logged with its traceback it reads as a crash of a clean stop."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug("cancelled: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


async def _serve(build: Callable[[C], Awaitable[ServiceDefinition]], config: C) -> None:
    definition = await build(config)
    freeze_startup_heap()
    service = GrpcService(definition, config)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_cancelled_is_no_error)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop)
    await service.start()
    await service.wait_for_termination()
    await _rpc_tasks_settle(timeout_s=2.0)


async def _rpc_tasks_settle(timeout_s: float) -> None:
    """Waits for grpc.aio's per-call tasks to end. The server's stop returns once gRPC core has
    finished every call, but a call's task can be a few loop turns from its end (the completion of
    its last send comes after core's shutdown notice); asyncio.run cancels such a task on exit and
    grpc logs that as an unhandled exception with two tracebacks, after a clean drain (a CI run
    saw it after a drained SaveCheckpoint). One server a process, so every such task is its."""
    pending = [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "") == "_schedule_rpc_coro"
    ]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)


def prepare(
    config_cls: type[C], *, version: str, argv: Sequence[str] | None = None, serve_metrics: bool = True
) -> C | int:
    """What every service process does first: the config from its command line, then
    logging, tracing and (unless `serve_metrics` is false) the metrics endpoint. An int is
    the exit code to return at once: 2 for an invalid config (said on stderr), 0 after
    `--check-config` found it valid (`--print-config`: and printed it as JSON on stdout)."""
    try:
        config, command_line = parse_command_line(config_cls, argv)
    except ConfigError as exc:
        print(f"{config_cls.service_name}: {exc}", file=sys.stderr)
        return 2
    try:
        config.tls.check(config.server.host)
    except ConfigError as exc:
        print(f"{config_cls.service_name}: {exc}", file=sys.stderr)
        return 2
    if command_line.check_config:
        print(f"{config_cls.service_name}: configuration is valid")
        return 0
    if command_line.print_config:
        print(config.model_dump_json())
        return 0
    security.setup_process_tls(config.tls)
    obs = config.observability
    observability.setup_observability(
        service=config_cls.service_name,
        version=version,
        log_level=obs.log_level,
        log_json=obs.log_json,
        trace_exporter=obs.trace_exporter,
        otlp_endpoint=obs.otlp_endpoint,
        metrics_port=obs.metrics_port if serve_metrics else None,
        metrics_host=obs.metrics_host or config.server.host,
    )
    return config


def run_main(
    config_cls: type[C],
    build: Callable[[C], Awaitable[ServiceDefinition]] | str,
    *,
    version: str,
    argv: Sequence[str] | None = None,
) -> int:
    """The whole `primerl-<service>` entry point: config -> observability -> serve.
    With `--check-config` it stops after the config: exit 0 when valid, else 2.

    `build` may be given as "module:function", imported only once the config is valid
    (and not at all by --check-config): a service whose server pulls in torch or
    transformers then validates its config in about a second."""
    config = prepare(config_cls, version=version, argv=argv)
    if isinstance(config, int):
        return config
    if isinstance(build, str):
        module, _, function = build.partition(":")
        build = getattr(importlib.import_module(module), function)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(build, config))
    return 0
