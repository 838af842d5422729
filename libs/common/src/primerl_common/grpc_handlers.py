"""Wrapping grpc.aio method handlers, written once for every server
interceptor (errors, tracing, metrics): each supplies how to wrap a coroutine
behaviour and how to wrap an async-generator behaviour."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["BehaviorWrapper", "wrap_method_handler"]

BehaviorWrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def wrap_method_handler(
    handler: grpc.RpcMethodHandler, *, coroutine: BehaviorWrapper, async_generator: BehaviorWrapper
) -> grpc.RpcMethodHandler:
    """`coroutine` wraps unary-response behaviours and streaming ones that write
    through context.write; `async_generator` wraps those that yield responses.
    The wrappers must keep the flavour they are given: grpc.aio inspects a
    behaviour to choose how to drive it."""

    def wrap(behavior: Callable[..., Any] | None) -> Callable[..., Any] | None:
        if inspect.isasyncgenfunction(behavior):
            return async_generator(behavior)
        if inspect.iscoroutinefunction(behavior):
            return coroutine(behavior)
        # None, or a sync behaviour grpc.aio runs in a thread (the generated
        # base servicer's UNIMPLEMENTED answers): left as it is.
        return behavior

    return handler._replace(**{kind: wrap(getattr(handler, kind)) for kind in _KINDS})
