"""The router's Prometheus metrics (served on observability.metrics_port).

Per-replica children are bound once when a replica joins, so the request path
touches prebuilt objects only, and are removed when it leaves.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from primerl.common.v1 import generation_pb2

__all__ = ["ReplicaMetrics", "requests_without_replica", "retries"]

_LABELS = ("replica",)
# Forwarded streams last from milliseconds (an instant answer) to minutes (long rollouts).
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

_in_flight = Gauge("primerl_router_replica_in_flight", "Requests this router has in flight on the replica.", _LABELS)
_queue_depth = Gauge(
    "primerl_router_replica_queue_depth", "Requests waiting in the replica's queue (its last load report).", _LABELS
)
_running = Gauge("primerl_router_replica_running", "Requests running on the replica (its last load report).", _LABELS)
_kv_cache_usage = Gauge("primerl_router_replica_kv_cache_usage", "KV-cache fraction in use (last report).", _LABELS)
_policy_version = Gauge("primerl_router_replica_policy_version", "Policy version the replica serves.", _LABELS)
_updating = Gauge("primerl_router_replica_updating", "1 while the replica updates its weights.", _LABELS)
_healthy = Gauge("primerl_router_replica_healthy", "1 unless health checks marked the replica unhealthy.", _LABELS)
_circuit_open = Gauge(
    "primerl_router_replica_circuit_open", "1 while the replica's circuit is open or half open.", _LABELS
)
_requests = Counter("primerl_router_replica_requests", "Requests sent to the replica.", _LABELS)
_errors = Counter(
    "primerl_router_replica_errors", "Requests to the replica that ended in an error.", (*_LABELS, "code")
)
_latency = Histogram(
    "primerl_router_replica_latency_seconds",
    "Forwarded request, start to end of stream.",
    _LABELS,
    buckets=_SECONDS_BUCKETS,
)
_first_message = Histogram(
    "primerl_router_replica_first_message_seconds",
    "Forwarded request, start to its first streamed message.",
    _LABELS,
    buckets=_SECONDS_BUCKETS,
)

retries = Counter("primerl_router_retries", "Requests retried on another replica before their first token.")
requests_without_replica = Counter(
    "primerl_router_requests_without_replica", "Requests refused because no replica could take them.", ("reason",)
)

_PER_REPLICA = (
    _in_flight,
    _queue_depth,
    _running,
    _kv_cache_usage,
    _policy_version,
    _updating,
    _healthy,
    _circuit_open,
    _requests,
    _latency,
    _first_message,
)


class ReplicaMetrics:
    def __init__(self, replica_id: str) -> None:
        self._replica_id = replica_id
        self._error_codes: set[str] = set()
        self.in_flight = _in_flight.labels(replica_id)
        self.queue_depth = _queue_depth.labels(replica_id)
        self.running = _running.labels(replica_id)
        self.kv_cache_usage = _kv_cache_usage.labels(replica_id)
        self.policy_version = _policy_version.labels(replica_id)
        self.updating = _updating.labels(replica_id)
        self.healthy = _healthy.labels(replica_id)
        self.circuit_open = _circuit_open.labels(replica_id)
        self.requests = _requests.labels(replica_id)
        self.latency = _latency.labels(replica_id)
        self.first_message = _first_message.labels(replica_id)
        self.policy_version.set(-1)
        self.healthy.set(1)

    def error(self, code_name: str) -> None:
        self._error_codes.add(code_name)
        _errors.labels(self._replica_id, code_name).inc()

    def apply_load(self, load: generation_pb2.LoadReport) -> None:
        self.queue_depth.set(load.num_waiting)
        self.running.set(load.num_running)
        self.kv_cache_usage.set(load.kv_cache_usage)
        self.policy_version.set(load.policy_version)

    def remove(self) -> None:
        for metric in _PER_REPLICA:
            metric.remove(self._replica_id)
        for code_name in self._error_codes:
            _errors.remove(self._replica_id, code_name)
