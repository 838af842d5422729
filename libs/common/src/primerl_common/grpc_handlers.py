"""Wrapping grpc.aio method handlers, once for all four RPC kinds, so each
server interceptor (errors, tracing, metrics) writes only what it adds."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

__all__ = ["CallWrapper", "wrap_method_handler"]

# Runs one call: gets the handler's original behaviour, the request (or request
# iterator), the context and whether the response is a stream; must return an
# awaitable of the response, or an async iterator of responses for streams.
CallWrapper = Callable[[Callable[..., Any], Any, grpc.aio.ServicerContext, bool], Any]


async def _as_async_iterator(result: Any) -> AsyncIterator[Any]:
    """A response-streaming behaviour is an async generator, or a coroutine that
    writes with context.write() and returns nothing."""
    if inspect.isawaitable(result):
        await result
        return
    async for item in result:
        yield item


def wrap_method_handler(handler: grpc.RpcMethodHandler, wrapper: CallWrapper) -> grpc.RpcMethodHandler:
    if handler.unary_unary is not None:
        behavior, factory, streaming = handler.unary_unary, grpc.unary_unary_rpc_method_handler, False
    elif handler.stream_unary is not None:
        behavior, factory, streaming = handler.stream_unary, grpc.stream_unary_rpc_method_handler, False
    elif handler.unary_stream is not None:
        behavior, factory, streaming = handler.unary_stream, grpc.unary_stream_rpc_method_handler, True
    else:
        behavior, factory, streaming = handler.stream_stream, grpc.stream_stream_rpc_method_handler, True

    if streaming:

        def original(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            return _as_async_iterator(behavior(request, context))

        async def wrapped_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in wrapper(original, request, context, True):
                yield item

        new_behavior: Callable[..., Any] = wrapped_stream
    else:
        # grpc.aio awaits a behaviour only when it is a coroutine function.
        async def wrapped_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await wrapper(behavior, request, context, False)

        new_behavior = wrapped_unary
    return factory(
        new_behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
