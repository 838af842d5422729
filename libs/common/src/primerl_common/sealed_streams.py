"""Sealed streams served and called (protocol: primerl_common.security.sealed; contract:
primerl.common.v1.SealedStreamService).

Serving: a ServiceDefinition lists the client-streaming methods it takes sealed
(`sealed_methods`); with `server.sealed_port` set (and mutual TLS), GrpcService serves the
SealedStreamService on its mTLS port and the same server on the sealed port, plaintext. On the
sealed port every other method is refused (no client certificate: UNAUTHENTICATED); a sealed
stream authenticates by its session key, and its method's handler runs as the caller the
session was opened for.

Calling: `SealedCaller` opens the sessions over the caller's mTLS channel and makes the calls on
the target's sealed port, falling back to the mTLS call itself where the target serves none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from primerl.common.v1 import sealed_pb2, sealed_pb2_grpc
from primerl_common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, draining_on_error
from primerl_common.security import AuthorizationInterceptor, Caller, Unauthenticated, acting_as, caller_of
from primerl_common.security.sealed import (
    REQUEST,
    RESPONSE,
    SEALED_SESSION_METADATA,
    SealBroken,
    StreamKey,
    open_frames,
    seal_frames_sync,
)

__all__ = [
    "OPEN_METHOD",
    "SEALED_CAPABILITY",
    "SEALED_SERVICE_NAME",
    "STREAM_METHOD",
    "SealedCaller",
    "SealedCallerSync",
    "SealedStreamServicer",
    "add_sealed_stream_service",
    "sealed_handlers",
]

logger = logging.getLogger(__name__)

SEALED_CAPABILITY = "sealed.streams"
_SERVICE = sealed_pb2.DESCRIPTOR.services_by_name["SealedStreamService"]
SEALED_SERVICE_NAME = _SERVICE.full_name
OPEN_METHOD = f"/{_SERVICE.full_name}/OpenSealedStreams"
STREAM_METHOD = f"/{_SERVICE.full_name}/SealedStream"
MAX_STREAMS = 64
# Sessions opened and not yet used, per server: a caller opening and never using them is
# answered RESOURCE_EXHAUSTED past this, rather than the server holding keys without bound.
MAX_PENDING_SESSIONS = 1024
SESSION_TTL_S = 60.0
# A caller told that a service takes no sealed streams asks again this much later.
RECHECK_S = 300.0


@dataclass(frozen=True)
class _Method:
    behavior: Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], Any]
    request_deserializer: Callable[[bytes], Any] | None  # None: the handler takes bytes
    response_serializer: Callable[[Any], bytes] | None  # None: the handler answers bytes


class _Registrations:
    """Stands in for a grpc.aio.Server while a definition's add_to_server functions register their
    handlers, to find each method's handler as the server serves it (a later registration of a
    method replaces an earlier one, as on the server)."""

    def __init__(self) -> None:
        self.registered: dict[str, grpc.RpcMethodHandler] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self.registered.update({f"/{service}/{name}": handler for name, handler in handlers.items()})

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def handler(self, method: str) -> grpc.RpcMethodHandler | None:
        if method in self.registered:
            return self.registered[method]
        details = _CallDetails(method, ())
        return next((h for g in self.generic if (h := g.service(details)) is not None), None)


@dataclass(frozen=True)
class _CallDetails(grpc.HandlerCallDetails):
    method: str
    invocation_metadata: tuple


def sealed_handlers(servicers: Sequence[tuple[Any, Any, Any]], methods: Iterable[str]) -> dict[str, _Method]:
    """The handler of each full method name in `methods` as a definition's servicers
    (add_to_server, servicer, descriptor) register it: a client-streaming one, one answer."""
    registrations = _Registrations()
    for add_to_server, servicer, _ in servicers:
        add_to_server(servicer, registrations)
    found: dict[str, _Method] = {}
    for method in methods:
        handler = registrations.handler(method)
        if handler is None:
            raise ValueError(f"sealed method {method} is not served")
        if handler.stream_unary is None:
            raise ValueError(f"{method} cannot be sealed: a sealed stream is client-streaming, one answer")
        found[method] = _Method(handler.stream_unary, handler.request_deserializer, handler.response_serializer)
    return found


@dataclass
class _Session:
    key: StreamKey
    caller: Caller
    expires_at: float


class SealedStreamServicer(sealed_pb2_grpc.SealedStreamServiceServicer):
    """Hands out sessions over mTLS and serves the sealed streams that use them."""

    def __init__(
        self, methods: Mapping[str, _Method], authorization: AuthorizationInterceptor, port: Callable[[], int | None]
    ) -> None:
        self._methods = dict(methods)
        self._authorization = authorization
        self._port = port
        self._sessions: dict[str, _Session] = {}

    def _lapse(self) -> None:
        now = time.monotonic()
        for session_id in [s for s, session in self._sessions.items() if session.expires_at <= now]:
            del self._sessions[session_id]

    async def OpenSealedStreams(self, request, context):
        port = self._port()
        if not port:
            raise FailedPrecondition("this service serves no sealed port (server.sealed_port is unset)")
        if request.method not in self._methods:
            taken = ", ".join(sorted(self._methods)) or "none"
            raise InvalidArgument(f"{request.method!r} is not taken sealed here (taken: {taken})", field="method")
        if not 1 <= request.streams <= MAX_STREAMS:
            raise InvalidArgument(f"streams must be 1 to {MAX_STREAMS}, got {request.streams}", field="streams")
        caller = caller_of(context)
        self._authorization.check(request.method, caller)  # the method's own roles
        self._lapse()
        if len(self._sessions) + request.streams > MAX_PENDING_SESSIONS:
            raise ResourceExhausted(
                f"{len(self._sessions)} sealed sessions are open and unused (at most {MAX_PENDING_SESSIONS})",
                retry_after_s=SESSION_TTL_S / 4,
            )
        response = sealed_pb2.OpenSealedStreamsResponse(port=port, expires_in_s=SESSION_TTL_S)
        expires_at = time.monotonic() + SESSION_TTL_S
        for _ in range(request.streams):
            session_id, key = secrets.token_hex(16), secrets.token_bytes(32)
            self._sessions[session_id] = _Session(StreamKey(session_id, key, request.method), caller, expires_at)
            response.sessions.add(session_id=session_id, key=key)
        return response

    async def SealedStream(self, request_iterator, context):
        frames = aiter(request_iterator)
        # A refusal (an unknown session, a frame that does not open, the handler's) goes out after
        # the rest of the stream is read: see draining_on_error.
        return await draining_on_error(frames, self._sealed_call(frames, context))

    async def _sealed_call(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        session_id = dict(context.invocation_metadata()).get(SEALED_SESSION_METADATA, "")
        self._lapse()
        session = self._sessions.pop(session_id, None)  # used once
        if session is None:
            raise Unauthenticated(
                "no open sealed session by that id (unknown, used already or lapsed): open one with OpenSealedStreams",
                reason="UNKNOWN_SEALED_SESSION",
            )
        key, method = session.key, self._methods[session.key.method]

        async def requests() -> AsyncIterator[Any]:
            try:
                async for message in open_frames(key, frames, REQUEST, method.request_deserializer):
                    yield message
            except SealBroken as exc:
                logger.warning("sealed stream of %s by %s refused: %s", key.method, session.caller.describe(), exc)
                raise Unauthenticated(f"sealed stream refused: {exc}", reason="SEAL_BROKEN") from exc

        with acting_as(session.caller):
            response = await method.behavior(requests(), context)
        serialized = response if method.response_serializer is None else method.response_serializer(response)
        return key.seal_frame(RESPONSE, 0, serialized, final=True)  # an answer is small: sealed here


def add_sealed_stream_service(servicer: SealedStreamServicer, server: grpc.aio.Server) -> None:
    """Serves `servicer`: OpenSealedStreams as generated; SealedStream on raw frames (each
    request's bytes are a serialized SealedStreamRequest, read and written without a copy)."""
    handlers = {
        "OpenSealedStreams": grpc.unary_unary_rpc_method_handler(
            servicer.OpenSealedStreams,
            request_deserializer=sealed_pb2.OpenSealedStreamsRequest.FromString,
            response_serializer=sealed_pb2.OpenSealedStreamsResponse.SerializeToString,
        ),
        "SealedStream": grpc.stream_unary_rpc_method_handler(servicer.SealedStream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))


class _SessionOpener:
    """What both callers share: asking for sessions, and remembering a service that takes no
    sealed streams (asked again RECHECK_S later: it may restart with a sealed port)."""

    def __init__(self, control: Any, host: str) -> None:
        self._open = control.unary_unary(
            OPEN_METHOD,
            request_serializer=sealed_pb2.OpenSealedStreamsRequest.SerializeToString,
            response_deserializer=sealed_pb2.OpenSealedStreamsResponse.FromString,
        )
        self._host = host
        self.unavailable: str | None = None  # why the service takes no sealed streams
        self._asked_at = 0.0

    def _skip(self) -> bool:
        if self.unavailable is not None and time.monotonic() - self._asked_at < RECHECK_S:
            return True
        self._asked_at = time.monotonic()
        return False

    def _refused(self, exc: grpc.RpcError) -> None:
        """Raises `exc` unless it says the service takes no sealed streams (then remembered)."""
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        if code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
            raise exc
        if self.unavailable is None:
            logger.info("%s takes no sealed streams (%s): calls go over mTLS", self._host, details)
        self.unavailable = f"{code.name}: {details}"

    def _opened(self, response: sealed_pb2.OpenSealedStreamsResponse, method: str) -> tuple[int, list[StreamKey]]:
        self.unavailable = None
        return response.port, [StreamKey(s.session_id, s.key, method) for s in response.sessions]


class SealedCaller(_SessionOpener):
    """Makes client-streaming calls to one service as sealed streams, from asyncio: sessions
    opened over `control` (an mTLS channel), calls on plaintext channels to the sealed port of
    `host`, one per stream index (a TCP connection each). Where the service serves no sealed
    port, `open` answers None and the caller makes the call over mTLS itself.

    The calls themselves go through gRPC's threaded API (`_ThreadedCalls`): gRPC copies
    each frame it is given on the thread that writes it, and in grpc.aio that is the event
    loop's, which every stream of a push shares. A 4 MiB frame sealed by a pool thread is
    read there from another core's cache: the loop bounded a push at ~2.6 GiB/s on the
    16-core device host, whatever the number of streams. On a thread of its own per call,
    the copies run side by side; the requests are still read on the event loop."""

    def __init__(self, control: grpc.aio.Channel, host: str, *, options: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__(control, host)
        self._calls = _ThreadedCalls(host, options)

    async def open(self, method: str, streams: int, *, timeout_s: float) -> tuple[int, list[StreamKey]] | None:
        """(the sealed port, one key per stream), or None when the service serves no sealed port."""
        if self._skip():
            return None
        request = sealed_pb2.OpenSealedStreamsRequest(method=method, streams=streams)
        try:
            return self._opened(await self._open(request, timeout=timeout_s), method)
        except grpc.aio.AioRpcError as exc:
            self._refused(exc)
            return None

    async def call(
        self,
        port: int,
        key: StreamKey,
        index: int,
        requests: Iterable[bytes] | AsyncIterable[bytes],
        response_type: type,
        *,
        timeout_s: float,
    ) -> Any:
        """One sealed call of `key`'s method: `requests` are serialized requests (read on the
        event loop). Fails as a grpc.aio call does (AioRpcError), or with the requests' own
        error where reading them failed."""
        source = _LoopSource(requests, asyncio.get_running_loop())
        call = self._calls.call(port, key, index, source, response_type, timeout_s=timeout_s)
        try:
            return await _completed(call)
        except grpc.RpcError as exc:
            if source.error is not None:
                raise source.error from None
            raise _as_aio_error(exc) from None
        finally:
            source.stop()

    async def close(self) -> None:
        self._calls.close()


async def _as_async(requests: Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(requests, AsyncIterable):
        async for request in requests:
            yield request
    else:
        for request in requests:
            yield request


class _LoopSource:
    """A blocking iterator, for gRPC's request-consuming thread, over `requests` (sync or
    async) read on the event loop `loop`, as the rest of the caller's state is. Keeps the
    requests' own error; stop() ends it (the call ended or was cancelled)."""

    def __init__(self, requests: Iterable[bytes] | AsyncIterable[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._source, self._loop = _as_async(requests), loop
        self.error: BaseException | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def __iter__(self) -> Iterator[bytes]:
        while not self._stopped.is_set():
            pending = asyncio.run_coroutine_threadsafe(anext(self._source), self._loop)
            while True:
                try:
                    yield pending.result(timeout=_POLL_S)
                    break
                except futures.TimeoutError:
                    if self._stopped.is_set():
                        pending.cancel()
                        return
                except StopAsyncIteration:
                    return
                except BaseException as exc:
                    self.error = exc
                    raise


# How often a request-consuming thread waiting on the event loop checks that its call is on.
_POLL_S = 0.5


async def _completed(call: SealedFuture) -> Any:
    """The answer of a threaded sealed call, awaited without a thread; cancelled with the task."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    call.add_done_callback(wake)
    try:
        await done
    except asyncio.CancelledError:
        call.cancel()
        raise
    return call.result()


def _as_aio_error(exc: grpc.RpcError) -> grpc.aio.AioRpcError:
    """A threaded call's error as grpc.aio's, trailers (and so rich error details) kept."""
    call: Any = exc
    return grpc.aio.AioRpcError(
        call.code(),
        grpc.aio.Metadata(*(call.initial_metadata() or ())),
        grpc.aio.Metadata(*(call.trailing_metadata() or ())),
        call.details(),
        call.debug_error_string(),
    )


class _ThreadedCalls:
    """Sealed calls through gRPC's threaded API, on plaintext channels to the sealed port of
    `host`, one per stream index (a TCP connection each)."""

    def __init__(self, host: str, options: Sequence[tuple[str, Any]]) -> None:
        self._host = host
        self._options = list(options)
        self._channels: dict[tuple[int, int], grpc.Channel] = {}

    def _target(self, port: int, index: int) -> tuple[str, list[tuple[str, Any]]]:
        """Address and options of stream `index`'s channel: a TCP connection of its own. Plaintext
        on purpose: every frame is sealed with a key handed out over mTLS."""
        options = [*self._options, ("grpc.use_local_subchannel_pool", 1), ("primerl.sealed_stream", index)]
        return f"{self._host}:{port}", options

    def call(
        self,
        port: int,
        key: StreamKey,
        index: int,
        requests: Iterable[Any],
        response_type: type,
        *,
        timeout_s: float,
        serialize: Callable[[Any], bytes] | None = None,
    ) -> SealedFuture:
        """One sealed call of `key`'s method, started: `requests` (`serialize`d if not bytes)."""
        if (port, index) not in self._channels:
            self._channels[(port, index)] = grpc.insecure_channel(*self._target(port, index))
        stream = self._channels[(port, index)].stream_unary(
            STREAM_METHOD, request_serializer=None, response_deserializer=None
        )
        future = stream.future(
            seal_frames_sync(key, requests, serialize, REQUEST),
            timeout=timeout_s,
            metadata=((SEALED_SESSION_METADATA, key.session_id),),
            wait_for_ready=False,
        )
        return SealedFuture(future, key, response_type)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class SealedCallerSync(_SessionOpener, _ThreadedCalls):
    """SealedCaller for gRPC's threaded API (the trainer's publisher): `control` is an mTLS
    grpc.Channel; `call` answers a future of the call's (opened) answer."""

    def __init__(self, control: grpc.Channel, host: str, *, options: Sequence[tuple[str, Any]] = ()) -> None:
        _SessionOpener.__init__(self, control, host)
        _ThreadedCalls.__init__(self, host, options)

    def open(self, method: str, streams: int, *, timeout_s: float) -> tuple[int, list[StreamKey]] | None:
        """As SealedCaller.open."""
        if self._skip():
            return None
        request = sealed_pb2.OpenSealedStreamsRequest(method=method, streams=streams)
        try:
            return self._opened(self._open(request, timeout=timeout_s), method)
        except grpc.RpcError as exc:
            self._refused(exc)
            return None


class SealedFuture:
    """A threaded sealed call: done() and cancel() as the gRPC future's; result() opens the answer."""

    def __init__(self, future: grpc.Future, key: StreamKey, response_type: type) -> None:
        self._future, self._key, self._response_type = future, key, response_type

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """As the gRPC future's (called at once if the call is done)."""
        self._future.add_done_callback(callback)

    def result(self) -> Any:
        return _answer(self._key, self._future.result(), self._response_type)


def _answer(key: StreamKey, frame: bytes, response_type: type) -> Any:
    """The answer of a sealed call, from its SealedStreamResponse's bytes; raises SealBroken."""
    message, final = key.open_frame(RESPONSE, 0, frame)
    if not final:
        raise SealBroken(f"the sealed answer of {key.method} is not a FINAL frame")
    return response_type.FromString(message)
