"""Admission limits: how many calls a server runs at once, how long a client stream may take,
and how large a request may say it is.

`AdmissionInterceptor` counts the calls in flight, unary and streaming apart, for the whole
server and for each caller (`caller_key`), and refuses one past a limit at once with
RESOURCE_EXHAUSTED (nothing is queued): the message names the limit and its config field,
`google.rpc.RetryInfo` and the trailing metadata `retry-after-ms` say when to try again. It also
gives every client stream (request-streaming RPC) an idle deadline (the longest the server waits
for the next message) and a total one (from the call's start to the stream's end), past which
the call ends with DEADLINE_EXCEEDED: a client that trickles cannot hold a lock or a buffer for
ever. Time the server spends between reads does not count against the client.

Services use `ConcurrencyLimit` for limits of their own (e.g. the router's Generate calls) and
`check_limit` for sizes a request announces, before they hold anything of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field

from primerl_common.errors import ResourceExhausted, ServiceError
from primerl_common.grpc_handlers import wrap_method_handler

__all__ = [
    "RETRY_AFTER_METADATA",
    "AdmissionConfig",
    "AdmissionInterceptor",
    "ConcurrencyLimit",
    "LimitExceeded",
    "Overloaded",
    "StreamDeadlineExceeded",
    "caller_key",
    "check_limit",
    "peer_host",
]

logger = logging.getLogger(__name__)

RETRY_AFTER_METADATA = "retry-after-ms"
_HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


class AdmissionConfig(BaseModel):
    """Calls a server runs at once and deadlines of client streams (`admission.*`). Sized to bound
    memory, not to refuse real use: tighten them per deployment."""

    # A config Section (unknown keys refused), written out: primerl_common.config imports this module.
    model_config = ConfigDict(extra="forbid")

    max_concurrent_unary: int = Field(default=8192, gt=0, description="unary calls in flight on this server")
    max_concurrent_unary_per_caller: int = Field(
        default=2048, gt=0, description="unary calls in flight from one caller"
    )
    max_concurrent_streams: int = Field(
        default=16384, gt=0, description="streaming calls (either direction) in flight on this server"
    )
    max_concurrent_streams_per_caller: int = Field(
        default=8192, gt=0, description="streaming calls in flight from one caller"
    )
    stream_idle_timeout_s: float = Field(
        default=120.0, gt=0, description="a client stream whose next message takes longer ends DEADLINE_EXCEEDED"
    )
    stream_total_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="a client stream not ended this long after its call started ends DEADLINE_EXCEEDED "
        "(a 2 TB weight publish at 1 GB/s takes ~35 min)",
    )
    retry_after_ms: int = Field(default=1000, gt=0, description="retry hint of a refused call")
    exempt_methods: list[str] = Field(
        default=list(_HEALTH_METHODS),
        description="full method names never limited (health checks must answer under load)",
    )


def caller_key(context: grpc.aio.ServicerContext) -> str:
    """Who a call comes from, for per-caller limits: its identity under mTLS (the certificate's or
    the bearer token's name, security.caller_of), else the peer's host."""
    from primerl_common import security  # imported at use: security imports config, which imports this module

    try:
        caller = security.caller_of(context)
    except security.Unauthenticated:
        return peer_host(context)
    return peer_host(context) if caller.via == "plaintext" else caller.name


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The host of a call's peer ("ipv4:10.0.0.5:41234" -> "10.0.0.5"; a Unix socket peer as it is)."""
    peer = context.peer() or ""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0] or address
    if kind == "ipv6":
        host = address.rpartition(":")[0] or address
        return host.strip("[]")
    return peer


class Overloaded(ResourceExhausted):
    """A concurrency limit is reached: nothing was started; the client may retry after the hint."""

    def __init__(self, message: str, *, config_field: str, limit: int, retry_after_s: float) -> None:
        super().__init__(
            message,
            reason="OVERLOADED",
            retry_after_s=retry_after_s,
            metadata={"config_field": config_field, "limit": str(limit)},
        )

    def to_status(self) -> grpc.Status:
        status = super().to_status()
        hint = (RETRY_AFTER_METADATA, str(round(1000 * (self.retry_after_s or 0))))
        return _Status(status.code, status.details, (*status.trailing_metadata, hint))


class LimitExceeded(ResourceExhausted):
    """A request announces (or brings) more than a configured cap allows. Retrying the same request
    cannot succeed (no retry hint): reason LIMIT_EXCEEDED."""

    def __init__(self, message: str, *, field: str, config_field: str, limit: int) -> None:
        super().__init__(
            f"{field}: {message}",
            reason="LIMIT_EXCEEDED",
            metadata={"field": field, "config_field": config_field, "limit": str(limit)},
        )


class StreamDeadlineExceeded(ServiceError):
    """A client stream went idle, or ran, longer than the server allows."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


def check_limit(value: int, limit: int, *, field: str, config_field: str, what: str) -> None:
    """Raises LimitExceeded when a request's `field` (`value` of `what`) is over `limit`, the value
    of the config field `config_field`."""
    if value > limit:
        raise LimitExceeded(
            f"{value} {what} is more than this server takes ({config_field} = {limit})",
            field=field,
            config_field=config_field,
            limit=limit,
        )


class ConcurrencyLimit:
    """At most `limit` holders at once, and at most `per_caller_limit` with one caller key; past
    either, `acquire` raises Overloaded naming the config field. Holders are counted, not queued."""

    def __init__(
        self,
        *,
        what: str,
        limit: int,
        per_caller_limit: int,
        config_field: str,
        per_caller_config_field: str,
        retry_after_s: float = 1.0,
    ) -> None:
        if limit <= 0 or per_caller_limit <= 0:
            raise ValueError(f"{config_field} and {per_caller_config_field} must be positive")
        self.what = what
        self.limit = limit
        self.per_caller_limit = per_caller_limit
        self._config_field = config_field
        self._per_caller_config_field = per_caller_config_field
        self._retry_after_s = retry_after_s
        self.num_held = 0
        self._by_caller: dict[str, int] = {}

    def num_held_by(self, caller: str) -> int:
        return self._by_caller.get(caller, 0)

    def acquire(self, caller: str) -> None:
        held_by_caller = self._by_caller.get(caller, 0)
        if self.num_held >= self.limit:
            raise self._refusal(f"{self.num_held} {self.what} in flight", self.limit, self._config_field)
        if held_by_caller >= self.per_caller_limit:
            raise self._refusal(
                f"{held_by_caller} {self.what} in flight from {caller}",
                self.per_caller_limit,
                self._per_caller_config_field,
            )
        self.num_held += 1
        self._by_caller[caller] = held_by_caller + 1

    def release(self, caller: str) -> None:
        self.num_held -= 1
        left = self._by_caller[caller] - 1
        if left:
            self._by_caller[caller] = left
        else:
            del self._by_caller[caller]

    @contextlib.contextmanager
    def hold(self, caller: str) -> Iterator[None]:
        self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)

    def _refusal(self, in_flight: str, limit: int, config_field: str) -> Overloaded:
        return Overloaded(
            f"{in_flight}, the most this server admits ({config_field} = {limit}); nothing was started, "
            f"retry in {self._retry_after_s:g} s",
            config_field=config_field,
            limit=limit,
            retry_after_s=self._retry_after_s,
        )


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Enforces an AdmissionConfig on every method of a server but `exempt_methods`. Per call it
    reads only the servicer context, so a handler it wraps may be kept and reused."""

    def __init__(
        self, config: AdmissionConfig, *, caller_of: Callable[[grpc.aio.ServicerContext], str] = caller_key
    ) -> None:
        self.config = config
        self._caller_of = caller_of
        self._exempt = frozenset(config.exempt_methods)
        retry_after_s = config.retry_after_ms / 1000
        self.unary = ConcurrencyLimit(
            what="unary calls",
            limit=config.max_concurrent_unary,
            per_caller_limit=config.max_concurrent_unary_per_caller,
            config_field="admission.max_concurrent_unary",
            per_caller_config_field="admission.max_concurrent_unary_per_caller",
            retry_after_s=retry_after_s,
        )
        self.streams = ConcurrencyLimit(
            what="streaming calls",
            limit=config.max_concurrent_streams,
            per_caller_limit=config.max_concurrent_streams_per_caller,
            config_field="admission.max_concurrent_streams",
            per_caller_config_field="admission.max_concurrent_streams_per_caller",
            retry_after_s=retry_after_s,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self._exempt:
            return handler
        limit = self.streams if handler.request_streaming or handler.response_streaming else self.unary
        client_stream = handler.request_streaming

        def coroutine(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def admitted(request: Any, context: grpc.aio.ServicerContext) -> Any:
                caller = await self._admit(limit, context, method)
                try:
                    if client_stream:
                        request = self._with_deadlines(request, method)
                    return await behavior(request, context)
                except StreamDeadlineExceeded as exc:
                    await context.abort_with_status(exc.to_status())
                finally:
                    limit.release(caller)

            return admitted

        def async_generator(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def admitted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                caller = await self._admit(limit, context, method)
                try:
                    if client_stream:
                        request = self._with_deadlines(request, method)
                    async for response in behavior(request, context):
                        yield response
                except StreamDeadlineExceeded as exc:
                    await context.abort_with_status(exc.to_status())
                finally:
                    limit.release(caller)

            return admitted

        return wrap_method_handler(handler, coroutine=coroutine, async_generator=async_generator)

    async def _admit(self, limit: ConcurrencyLimit, context: grpc.aio.ServicerContext, method: str) -> str:
        caller = self._caller_of(context)
        try:
            limit.acquire(caller)
        except Overloaded as exc:
            logger.warning("refused %s from %s: %s", method, caller, exc.message, extra={"caller": caller})
            await context.abort_with_status(exc.to_status())
        return caller

    async def _with_deadlines(self, requests: AsyncIterable[Any], method: str) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        idle_s, total_s = self.config.stream_idle_timeout_s, self.config.stream_total_timeout_s
        give_up_at = loop.time() + total_s
        iterator = aiter(requests)
        while True:
            remaining_s = give_up_at - loop.time()
            try:
                async with asyncio.timeout(min(idle_s, remaining_s)):
                    message = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if remaining_s <= idle_s:
                    raise StreamDeadlineExceeded(
                        f"{method}: the request stream did not end within {total_s:g} s "
                        "(admission.stream_total_timeout_s)",
                        reason="STREAM_TOO_LONG",
                    ) from None
                raise StreamDeadlineExceeded(
                    f"{method}: no request message for {idle_s:g} s (admission.stream_idle_timeout_s)",
                    reason="STREAM_IDLE",
                ) from None
            yield message
