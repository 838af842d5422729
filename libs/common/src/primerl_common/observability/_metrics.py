"""The gRPC server metrics (primerl_grpc_server_*) of a registry, and their HTTP endpoint."""

from __future__ import annotations

import dataclasses
import threading
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ServerMetrics:
    handled: Counter
    handling_seconds: Histogram
    in_flight: Gauge


# Streams (generation, weight pushes) last far longer than the default buckets reach.
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_metrics_by_registry: dict[CollectorRegistry, ServerMetrics] = {}
_metrics_servers: dict[tuple[str, int, CollectorRegistry], WSGIServer] = {}


def server_metrics(registry: CollectorRegistry) -> ServerMetrics:
    # A registry refuses a second metric of the same name, so each registry gets its set once.
    with _lock:
        if registry not in _metrics_by_registry:
            labels = ("service", "method")  # service is the gRPC one, e.g. primerl.router.v1.RouterService
            _metrics_by_registry[registry] = ServerMetrics(
                handled=Counter("primerl_grpc_server_handled", "Completed RPCs.", (*labels, "code"), registry=registry),
                handling_seconds=Histogram(
                    "primerl_grpc_server_handling_seconds",
                    "RPC start to end (of the stream, for streams).",
                    labels,
                    buckets=_SECONDS_BUCKETS,
                    registry=registry,
                ),
                in_flight=Gauge("primerl_grpc_server_in_flight", "RPCs not yet completed.", labels, registry=registry),
            )
        return _metrics_by_registry[registry]


def start_metrics_server(port: int, host: str = "127.0.0.1", *, registry: CollectorRegistry = REGISTRY) -> int:
    """Serve Prometheus metrics over HTTP on `host` (the address bound: loopback unless a service's
    config names another, observability.metrics_host) from a daemon thread; return the bound port
    (port 0 picks one).

    Calling again with the same host, port and registry returns the running server's port.
    """
    with _lock:
        key = (host, port, registry)
        if key not in _metrics_servers:
            server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
            _metrics_servers[key] = server
        return _metrics_servers[key].server_port


def stop_metrics_server(port: int) -> None:
    with _lock:
        for key, server in list(_metrics_servers.items()):
            if server.server_port == port:
                server.shutdown()
                server.server_close()
                del _metrics_servers[key]
