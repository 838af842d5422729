"""The Generate path: pick a replica, stream its answer through, retry on
another replica when it fails before the first message.

Request and response bytes pass through unparsed (see request.py for the
routing fields read on the way). Responses are forwarded message by message as
the replica sends them, so the client's StreamOptions (one message per N
tokens or per interval, or one final message) set how often the router works.
"Streamed" means the first response message reached the client: from then on
a failure goes to the client as it is, since a retry would repeat tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc

from primerl_common import security
from primerl_router import metrics
from primerl_router.config import RoutingConfig
from primerl_router.disaggregation import Disaggregation
from primerl_router.fleet import Fleet
from primerl_router.replica import Replica
from primerl_router.request import RouteRequest, parse_route_request

__all__ = ["Forwarder"]

logger = logging.getLogger(__name__)

_Code = grpc.StatusCode
# Failures before the first message that another replica may not have: the replica is down,
# full, restarting, or behind the version the router thought it served.
_RETRYABLE = frozenset(
    {
        _Code.UNAVAILABLE,
        _Code.RESOURCE_EXHAUSTED,
        _Code.FAILED_PRECONDITION,
        _Code.ABORTED,
        _Code.INTERNAL,
        _Code.UNKNOWN,
    }
)
# Failures that say the replica itself is broken: they count toward its circuit.
_REPLICA_FAULTS = frozenset({_Code.UNAVAILABLE, _Code.INTERNAL, _Code.UNKNOWN, _Code.DATA_LOSS})
_TRACE_CONTEXT_KEYS = frozenset({"traceparent", "tracestate"})


class Forwarder:
    def __init__(self, fleet: Fleet, config: RoutingConfig) -> None:
        self._fleet = fleet
        self._max_attempts = config.max_attempts
        self._wait_s = config.no_replica_wait_s
        self._disaggregation = Disaggregation(self._generate_half) if config.disaggregate else None

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        """A client's Generate: refused unless the caller may use the adapter it names."""
        route = parse_route_request(request, context.invocation_metadata())
        if route.lora_adapter:
            self._fleet.pool.check_adapter_owner(route, security.caller_of(context))
        if not route.role and self._disaggregation is not None:
            return await self._disaggregation.generate(request, context)
        await self._route(request, route, context)

    async def _generate_half(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        """One half of a disaggregated request (its role set; the whole was checked by generate)."""
        await self._route(request, parse_route_request(request, context.invocation_metadata()), context)

    async def _route(self, request: bytes, route: RouteRequest, context: grpc.aio.ServicerContext) -> None:
        metadata = _trace_context(context.invocation_metadata())
        tried: list[Replica] = []
        failure: grpc.aio.AioRpcError | None = None
        while len(tried) < self._max_attempts:
            if failure is None:
                replica = await self._fleet.pool.pick(route, wait_s=_bounded(self._wait_s, context))
            else:
                # A retry takes what is there now: waiting would only delay the error.
                replica = self._fleet.pool.try_pick(route, tried)
                if replica is None:
                    break
                metrics.retries.inc()
                logger.debug(
                    "retrying request %s on %s after %s from %s",
                    route.request_id.decode(errors="replace"),
                    replica.replica_id,
                    failure.code().name,
                    tried[-1].replica_id,
                )
            tried.append(replica)
            failure = await self._forward(replica, request, metadata, context)
            if failure is None:
                return
        assert failure is not None
        await context.abort(failure.code(), failure.details() or "", _pairs(failure.trailing_metadata()))

    async def _forward(
        self, replica: Replica, request: bytes, metadata: tuple[tuple[str, str], ...], context: grpc.aio.ServicerContext
    ) -> grpc.aio.AioRpcError | None:
        """Streams one attempt through. Returns the replica's error when it
        failed before its first message with a code another replica may not
        have; any other failure ends the client's call here."""
        started = time.perf_counter()
        call = self._fleet.upstream(replica).generate(request, timeout=context.time_remaining(), metadata=metadata)
        replica.on_request_start()
        streamed = False
        try:
            response = await call.read()
            replica.metrics.first_message.observe(time.perf_counter() - started)
            while response is not grpc.aio.EOF:
                await context.write(response)
                streamed = True
                response = await call.read()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            replica.on_request_end(error=code.name, replica_fault=code in _REPLICA_FAULTS)
            if not streamed and code in _RETRYABLE:
                return exc
            await context.abort(code, exc.details() or "", _pairs(exc.trailing_metadata()))
        except BaseException:
            # The client went away (cancelled, deadline): stop the replica's work too.
            call.cancel()
            replica.on_request_end(error=_Code.CANCELLED.name)
            raise
        replica.on_request_end()
        replica.metrics.latency.observe(time.perf_counter() - started)
        return None


def _pairs(metadata: grpc.aio.Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
    """A replica's trailing metadata as context.abort takes it (a tuple of pairs, not grpc.aio.Metadata)."""
    return tuple(metadata or ())


def _trace_context(metadata: Sequence[tuple[str, str | bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's W3C trace context, for the replica's call: the router adds no span of
    its own on this path (see server.py), so the replica's spans and logs join the
    caller's trace directly."""
    return tuple(item for item in metadata if item[0] in _TRACE_CONTEXT_KEYS)


def _bounded(wait_s: float, context: grpc.aio.ServicerContext) -> float:
    remaining = context.time_remaining()
    return wait_s if remaining is None else max(0.0, min(wait_s, remaining))
