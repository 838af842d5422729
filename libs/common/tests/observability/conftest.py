"""Fixtures of the observability tests: a real grpc.aio server on 127.0.0.1:0 with the
server interceptors, a real channel with the client interceptors, their own tracer
provider and metrics registry."""

from __future__ import annotations

import functools
import logging

import grpc.aio
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from primerl_common.observability import client_interceptors, server_interceptors
from primerl_common.testing import bare_server

from .observed_rpcs import ObservedServicer


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(spans: InMemorySpanExporter) -> TracerProvider:
    # Our own provider: OTel's global one can be set once per process, and setup_tracing owns it.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def servicer() -> ObservedServicer:
    return ObservedServicer()


@pytest_asyncio.fixture
async def channel(tracer_provider, registry, servicer):
    async with (
        bare_server(
            lambda server: server.add_generic_rpc_handlers([servicer.generic_handler()]),
            functools.partial(health_pb2_grpc.add_HealthServicer_to_server, health_aio.HealthServicer()),
            interceptors=server_interceptors(tracer_provider=tracer_provider, registry=registry),
        ) as address,
        grpc.aio.insecure_channel(address, interceptors=client_interceptors()) as channel,
    ):
        yield channel


@pytest.fixture
def root_logger():
    """Leaves the root logger as it found it (pytest's own capture handlers included)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)
