"""The one mapping from domain errors to gRPC status codes.

Services raise `ServiceError` subclasses; `ErrorInterceptor` turns them into a
gRPC status whose `google.rpc.Status` details say what went wrong (the field of
a bad request, the violated precondition, when to retry). Any other exception
becomes INTERNAL with a generic message: a stack trace never reaches a client,
it goes to the server's log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from primerl_common.grpc_handlers import wrap_method_handler

__all__ = [
    "AlreadyExists",
    "ErrorInterceptor",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "ServiceError",
    "Unavailable",
    "Unimplemented",
    "draining_on_error",
    "error_details",
    "field_violations",
]

logger = logging.getLogger(__name__)
DOMAIN = "primerl"
T = TypeVar("T")


class ServiceError(Exception):
    """An error meant for the client. `reason` is a stable UPPER_SNAKE name."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, reason: str | None = None, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.code.name
        self.metadata = dict(metadata or {})

    def details(self) -> list[Any]:
        return [error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)]

    def to_status(self) -> grpc.Status:
        packed = []
        for detail in self.details():
            item = any_pb2.Any()
            item.Pack(detail)
            packed.append(item)
        return rpc_status.to_status(status_pb2.Status(code=self.code.value[0], message=self.message, details=packed))


class InvalidArgument(ServiceError):
    """A request field is malformed; `field` is its path (e.g. "micro_batch.advantages")."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, field: str, **kwargs: Any) -> None:
        super().__init__(f"{field}: {message}", **kwargs)
        self.field = field
        self.description = message

    def details(self) -> list[Any]:
        violation = error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.description)
        return [*super().details(), error_details_pb2.BadRequest(field_violations=[violation])]


class FailedPrecondition(ServiceError):
    """The system is not in the state the request needs (e.g. a stale policy version)."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, message: str, *, subject: str = "", violation_type: str = "STATE", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.subject = subject
        self.violation_type = violation_type

    def details(self) -> list[Any]:
        violation = error_details_pb2.PreconditionFailure.Violation(
            type=self.violation_type, subject=self.subject, description=self.message
        )
        return [*super().details(), error_details_pb2.PreconditionFailure(violations=[violation])]


class _Retryable(ServiceError):
    def __init__(self, message: str, *, retry_after_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after_s = retry_after_s

    def details(self) -> list[Any]:
        details = super().details()
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        return details


class ResourceExhausted(_Retryable):
    """A bounded queue is full: nothing was taken, the client may retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(_Retryable):
    """The service is starting or draining; another replica or a retry may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unimplemented(ServiceError):
    """An RPC of the contract this server does not implement (yet)."""

    code = grpc.StatusCode.UNIMPLEMENTED


def _status_for(exc: BaseException, method: str) -> grpc.Status:
    if isinstance(exc, ServiceError):
        return exc.to_status()
    if isinstance(exc, NotImplementedError):
        return rpc_status.to_status(
            status_pb2.Status(code=code_pb2.UNIMPLEMENTED, message=f"{method} is not implemented by this server")
        )
    logger.error("unhandled error in %s", method, exc_info=exc)
    return rpc_status.to_status(
        status_pb2.Status(code=code_pb2.INTERNAL, message=f"internal error in {method}; see the server log")
    )


def _passes_through(exc: BaseException) -> bool:
    # An abort already carries its status; cancellation is the client going away.
    return isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit, KeyboardInterrupt))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def coroutine(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def mapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await context.abort_with_status(_status_for(exc, method))

            return mapped

        def async_generator(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def mapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await context.abort_with_status(_status_for(exc, method))

            return mapped

        return wrap_method_handler(handler, coroutine=coroutine, async_generator=async_generator)


def error_details(error: grpc.RpcError) -> list[Any]:
    """The unpacked `google.rpc.Status` details of a failed call (client side)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return []
    known = (
        error_details_pb2.ErrorInfo,
        error_details_pb2.BadRequest,
        error_details_pb2.PreconditionFailure,
        error_details_pb2.RetryInfo,
    )
    unpacked = []
    for item in status.details:
        for cls in known:
            if item.Is(cls.DESCRIPTOR):
                message = cls()
                item.Unpack(message)
                unpacked.append(message)
    return unpacked


def field_violations(error: grpc.RpcError) -> dict[str, str]:
    """Field path -> description of an INVALID_ARGUMENT error (client side)."""
    return {
        violation.field: violation.description
        for detail in error_details(error)
        if isinstance(detail, error_details_pb2.BadRequest)
        for violation in detail.field_violations
    }


async def draining_on_error(requests: AsyncIterator[Any], work: Awaitable[T]) -> T:
    """Runs `work`, which consumes `requests`; if it fails, reads the rest of the stream
    before the error goes out. An asyncio client still writing when the call ends reports
    INTERNAL instead of the status the server sent (grpc/grpc#36066)."""
    try:
        return await work
    except ServiceError:
        async for _ in requests:
            pass
        raise
