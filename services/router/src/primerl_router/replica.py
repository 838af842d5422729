"""One inference replica as the router sees it: identity, health, circuit,
load, policy version (and each LoRA adapter's) and update state, drain, and its
requests in flight.

Plain state and rules, no gRPC: the health checker, the load watcher and the
weight-broadcaster follower feed it, policies read it, and the forwarding path
counts requests on it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

from primerl.common.v1 import generation_pb2
from primerl_common.images import CAPABILITY_IMAGES
from primerl_router.circuit import CircuitBreaker, CircuitState
from primerl_router.config import CircuitBreakerConfig, HealthConfig
from primerl_router.metrics import ReplicaMetrics
from primerl_router.request import RouteRequest

__all__ = ["ROLE_BOTH", "UNKNOWN_VERSION", "Health", "HealthTracker", "Replica"]

logger = logging.getLogger(__name__)

UNKNOWN_VERSION = -1
ROLE_BOTH = generation_pb2.REPLICA_ROLE_BOTH
_DEFAULT_HEALTH = HealthConfig()
_DEFAULT_CIRCUIT = CircuitBreakerConfig()


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not checked yet: eligible, so a new replica takes traffic at once
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # failing checks, not yet past the threshold: still eligible
    UNHEALTHY = "unhealthy"


class HealthTracker:
    """Health from consecutive check outcomes, with hysteresis: one failed
    check degrades, `unhealthy_threshold` in a row make it unhealthy, and an
    unhealthy replica needs `healthy_threshold` passes in a row to come back."""

    def __init__(self, *, unhealthy_threshold: int, healthy_threshold: int) -> None:
        self._unhealthy_threshold = unhealthy_threshold
        self._healthy_threshold = healthy_threshold
        self.state = Health.UNKNOWN
        self.num_consecutive_failures = 0
        self._num_consecutive_passes = 0

    def record(self, passed: bool) -> bool:
        """Feeds one check's outcome; returns whether the state changed."""
        before = self.state
        if passed:
            self.num_consecutive_failures = 0
            self._num_consecutive_passes += 1
            if self.state is not Health.UNHEALTHY or self._num_consecutive_passes >= self._healthy_threshold:
                self.state = Health.HEALTHY
        else:
            self._num_consecutive_passes = 0
            self.num_consecutive_failures += 1
            if self.num_consecutive_failures >= self._unhealthy_threshold:
                self.state = Health.UNHEALTHY
            elif self.state is not Health.UNHEALTHY:
                self.state = Health.DEGRADED
        return self.state is not before


class Replica:
    def __init__(
        self,
        replica_id: str,
        address: str,
        *,
        role: int = ROLE_BOTH,
        labels: dict[str, str] | None = None,
        health: HealthConfig = _DEFAULT_HEALTH,
        circuit: CircuitBreakerConfig = _DEFAULT_CIRCUIT,
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self.role = role
        self.labels = dict(labels or {})
        self.health = HealthTracker(
            unhealthy_threshold=health.unhealthy_threshold, healthy_threshold=health.healthy_threshold
        )
        self.circuit = CircuitBreaker(failure_threshold=circuit.failure_threshold, open_s=circuit.open_s)
        self.metrics = ReplicaMetrics(replica_id)
        # Set through the router, not by the replica: no new requests, running ones finish.
        self.draining = False
        # Last load report, and how many requests this router sent since (the report lags).
        self.load: generation_pb2.LoadReport | None = None
        self.num_started_since_report = 0
        self.policy_version = UNKNOWN_VERSION
        # The version of each LoRA adapter it holds, by name (as the request carries it: bytes).
        # A request naming an adapter goes only where that adapter is, at its version.
        self.adapter_versions: dict[bytes, int] = {}
        # The owner of each adapter that has one, by name, from the load reports: the router
        # serves an owned adapter to its owner (or an operator) only (ReplicaPool.check_adapter_owner).
        self.adapter_owners: dict[bytes, str] = {}
        # Update state from the replica's own load report and from the weight broadcaster.
        self.load_updating = False
        self.broadcaster_updating = False
        self.num_in_flight = 0
        self.num_requests_total = 0
        self.num_errors_total = 0
        self.last_seen = 0.0  # wall-clock time of the last passed check or load report
        # What its GetServiceInfo lists (asked whenever its load stream connects: the process
        # behind the address may have been replaced by another build).
        self.capabilities: frozenset[str] = frozenset()
        self.capabilities_known = False
        self._idle: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"Replica({self.replica_id!r}, {self.address!r})"

    # ------------------------------------------------------------------ eligibility

    @property
    def updating(self) -> bool:
        return self.load_updating or self.broadcaster_updating

    @property
    def self_draining(self) -> bool:
        """The replica itself said it is draining (it is shutting down)."""
        return self.load is not None and self.load.draining

    @property
    def outstanding(self) -> int:
        """Estimated requests queued or running on the replica: the last
        report plus what this router sent since, and never less than what this
        router has in flight there (with no report, that is all it knows)."""
        if self.load is None:
            return self.num_in_flight
        reported = self.load.num_waiting + self.load.num_running + self.num_started_since_report
        return max(reported, self.num_in_flight)

    def accepts(self, request: RouteRequest) -> bool:
        """Whether a new request may be sent here now (updating is judged by the pool)."""
        return (
            not self.draining
            and self.role == (request.role or ROLE_BOTH)
            and self.health.state is not Health.UNHEALTHY
            and self.serves_version(request)
            and not self.self_draining
            and self.circuit.available()
            and (not request.num_images or CAPABILITY_IMAGES in self.capabilities)
        )

    def rejection(self, request: RouteRequest) -> str:
        """Why `accepts` said no, for error messages."""
        if self.draining or self.self_draining:
            return "draining"
        if self.role != (request.role or ROLE_BOTH):
            return f"role {generation_pb2.ReplicaRole.Name(self.role)}"
        if self.health.state is Health.UNHEALTHY:
            return "unhealthy"
        if request.lora_adapter and request.lora_adapter not in self.adapter_versions:
            return f"no adapter {request.lora_adapter.decode(errors='replace')!r}"
        if not self.serves_version(request):
            return f"policy version {self.version_for(request)}"
        if not self.circuit.available():
            return "circuit open"
        if request.num_images and CAPABILITY_IMAGES not in self.capabilities:
            return f"no capability {CAPABILITY_IMAGES}" if self.capabilities_known else "capabilities not known yet"
        return "eligible"

    def version_for(self, request: RouteRequest) -> int:
        """The version the replica would serve `request` at: its adapter's, if it names one."""
        if request.lora_adapter:
            return self.adapter_versions.get(request.lora_adapter, UNKNOWN_VERSION)
        return self.policy_version

    def serves_version(self, request: RouteRequest) -> bool:
        """Holds the request's adapter (if any) at `min_policy_version` or later."""
        if request.lora_adapter and request.lora_adapter not in self.adapter_versions:
            return False
        return request.min_policy_version <= 0 or self.version_for(request) >= request.min_policy_version

    # ------------------------------------------------------------------ requests

    def on_request_start(self) -> None:
        self.num_in_flight += 1
        self.num_started_since_report += 1
        self.num_requests_total += 1
        self.circuit.on_attempt()
        if self._idle is not None:
            self._idle.clear()
        self.metrics.in_flight.inc()
        self.metrics.requests.inc()

    def on_request_end(self, *, error: str | None = None, replica_fault: bool = False) -> None:
        """`error`: the gRPC code name the request ended with, if not OK;
        `replica_fault`: whether that error says the replica is broken (it
        counts toward the circuit; a client's cancel or bad argument does not)."""
        self.num_in_flight -= 1
        circuit_before = self.circuit.state
        if error is not None:
            self.num_errors_total += 1
            self.metrics.error(error)
        if replica_fault:
            self.circuit.on_failure()
        elif error is not None:
            self.circuit.on_neutral()
        else:
            self.circuit.on_success()
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()
        self.metrics.in_flight.dec()
        if self.circuit.state is not circuit_before:
            self.metrics.circuit_open.set(self.circuit.state is not CircuitState.CLOSED)
            log = logger.warning if self.circuit.state is CircuitState.OPEN else logger.info
            log(
                "replica %s: circuit %s (last error %s)",
                self.replica_id,
                self.circuit.state.value,
                error or "none",
                extra={"replica_id": self.replica_id},
            )

    async def wait_idle(self) -> None:
        """Returns once no request of this router is in flight here."""
        if self.num_in_flight == 0:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        await self._idle.wait()

    # ------------------------------------------------------------------ reports

    def record_health_check(self, passed: bool) -> bool:
        changed = self.health.record(passed)
        if passed:
            self.last_seen = time.time()
        self.metrics.healthy.set(self.health.state is not Health.UNHEALTHY)
        return changed

    def apply_load(self, load: generation_pb2.LoadReport) -> None:
        self.load = load
        self.num_started_since_report = 0
        self.policy_version = load.policy_version
        self.adapter_versions = {name.encode(): version for name, version in load.adapter_versions.items()}
        # The report speaks for the adapters it lists; an owner it does not mention stays known
        # (one forgotten while the broadcaster says the adapter is there would open it to anyone).
        kept = {
            name: owner for name, owner in self.adapter_owners.items() if name.decode() not in load.adapter_versions
        }
        self.adapter_owners = kept | {name.encode(): owner for name, owner in load.adapter_owners.items() if owner}
        self.load_updating = load.updating_weights or load.paused
        self.last_seen = time.time()
        self.metrics.apply_load(load)
        self.metrics.updating.set(self.updating)

    def set_capabilities(self, capabilities: frozenset[str]) -> None:
        self.capabilities, self.capabilities_known = capabilities, True

    def forget_load(self) -> None:
        """The load stream is gone: what it said (version and capabilities included) may be stale. A replica
        that said it is draining stays so until it reports again: it ends its stream after
        saying so, and what answers next at its address is a new process."""
        draining = self.self_draining
        self.load = generation_pb2.LoadReport(draining=True) if draining else None
        self.capabilities, self.capabilities_known = frozenset(), False
        self.num_started_since_report = 0
        self.policy_version = UNKNOWN_VERSION
        self.adapter_versions = {}
        # adapter_owners stay: an owner only narrows who may use an adapter (see apply_load).
        self.load_updating = False
        self.metrics.forget_load()
        self.metrics.policy_version.set(UNKNOWN_VERSION)
        self.metrics.updating.set(self.updating)

    def apply_broadcaster_state(
        self,
        *,
        policy_version: int,
        updating: bool,
        adapter_versions: dict[str, int] | None = None,
        adapter_owners: dict[str, str] | None = None,
    ) -> None:
        """What the weight broadcaster says the replica holds; `adapter_versions`: the adapters
        it pushed there (newer than the last load report's, or not known to it yet), and the
        owners of those that have one (known here as soon as they are pushed)."""
        self.policy_version = policy_version
        for name, version in (adapter_versions or {}).items():
            self.adapter_versions[name.encode()] = version
        for name, owner in (adapter_owners or {}).items():
            self.adapter_owners[name.encode()] = owner
        self.broadcaster_updating = updating
        self.metrics.policy_version.set(policy_version)
        self.metrics.updating.set(self.updating)
