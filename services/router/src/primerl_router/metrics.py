"""The router's Prometheus metrics (served on observability.metrics_port).

Per-replica children are bound once when a replica joins, so the request path
touches prebuilt objects only, and are removed when it leaves.

Per-group metrics (label `role`: prefill, decode, both) sum the replicas' load reports by
the role each replica reports: queue depth and running requests (gauges), and prompt tokens
served, prompt tokens computed, tokens generated, prefix-cache and KV-pool hit tokens
(counters; their rate() is the group's token rate, and pool hits / prompt tokens its pool hit
rate). A prefill group whose queue grows while the decode group idles wants more prefill
replicas, and the other way round (services/router/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from primerl.common.v1 import generation_pb2

__all__ = ["GROUP_ROLES", "ReplicaMetrics", "requests_without_replica", "retries"]

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

_GROUP = ("role",)
GROUP_ROLES = {
    generation_pb2.REPLICA_ROLE_UNSPECIFIED: "both",
    generation_pb2.REPLICA_ROLE_BOTH: "both",
    generation_pb2.REPLICA_ROLE_PREFILL: "prefill",
    generation_pb2.REPLICA_ROLE_DECODE: "decode",
}
_group_replicas = Gauge("primerl_router_group_replicas", "Replicas of the role that report their load.", _GROUP)
_group_queue_depth = Gauge(
    "primerl_router_group_queue_depth", "Requests waiting on the role's replicas (their last reports).", _GROUP
)
_group_running = Gauge("primerl_router_group_running", "Requests running on the role's replicas.", _GROUP)
_group_prompt_tokens = Counter(
    "primerl_router_group_prompt_tokens", "Prompt tokens the role's replicas served (computed or cached).", _GROUP
)
_group_computed_prompt_tokens = Counter(
    "primerl_router_group_computed_prompt_tokens", "Prompt tokens the role's replicas computed (no cache hit).", _GROUP
)
_group_generated_tokens = Counter(
    "primerl_router_group_generated_tokens", "Tokens the role's replicas generated.", _GROUP
)
_group_prefix_cache_hit_tokens = Counter(
    "primerl_router_group_prefix_cache_hit_tokens",
    "Prompt tokens whose KV the role's replicas had cached (own prefix cache or KV pool).",
    _GROUP,
)
_group_kv_pool_hit_tokens = Counter(
    "primerl_router_group_kv_pool_hit_tokens",
    "Prompt tokens whose KV the role's replicas loaded from the KV pool.",
    _GROUP,
)


@dataclass
class _Reported:
    """A replica's last load report, as far as its group's metrics go."""

    role: str
    num_waiting: int
    num_running: int


# By replica id: what each replica's group gauges last took from it, and its last totals (kept
# when it leaves: the same process registered again goes on counting from them).
_reported: dict[str, _Reported] = {}
_last_totals: dict[str, generation_pb2.LoadReport] = {}


def _set_group_gauges(role: str) -> None:
    members = [r for r in _reported.values() if r.role == role]
    _group_replicas.labels(role).set(len(members))
    _group_queue_depth.labels(role).set(sum(r.num_waiting for r in members))
    _group_running.labels(role).set(sum(r.num_running for r in members))


def _counted(total: int, last: int) -> int:
    """Growth of a replica's monotonic total since its last report; a smaller total is a
    restarted replica, counting from zero."""
    return total - last if total >= last else total


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
        self._apply_to_group(load)

    def _apply_to_group(self, load: generation_pb2.LoadReport) -> None:
        role = GROUP_ROLES.get(load.role, "both")
        before = _reported.get(self._replica_id)
        _reported[self._replica_id] = _Reported(role, load.num_waiting, load.num_running)
        for changed in {role, before.role if before else role}:
            _set_group_gauges(changed)
        last = _last_totals.get(self._replica_id, generation_pb2.LoadReport())
        prompt = _counted(load.num_prompt_tokens_total, last.num_prompt_tokens_total)
        cached = _counted(load.num_prefix_cache_hit_tokens_total, last.num_prefix_cache_hit_tokens_total)
        _group_prompt_tokens.labels(role).inc(prompt)
        _group_computed_prompt_tokens.labels(role).inc(max(prompt - cached, 0))
        _group_prefix_cache_hit_tokens.labels(role).inc(cached)
        _group_generated_tokens.labels(role).inc(
            _counted(load.num_generated_tokens_total, last.num_generated_tokens_total)
        )
        _group_kv_pool_hit_tokens.labels(role).inc(
            _counted(load.num_kv_pool_hit_tokens_total, last.num_kv_pool_hit_tokens_total)
        )
        _last_totals[self._replica_id] = load

    def forget_load(self) -> None:
        """The replica's reports stopped: its group's gauges no longer count it."""
        before = _reported.pop(self._replica_id, None)
        if before is not None:
            _set_group_gauges(before.role)

    def remove(self) -> None:
        self.forget_load()
        for metric in _PER_REPLICA:
            metric.remove(self._replica_id)
        for code_name in self._error_codes:
            _errors.remove(self._replica_id, code_name)
