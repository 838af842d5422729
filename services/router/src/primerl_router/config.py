"""Configuration of the router (flags > PRIMERL_ROUTER_* > TOML > defaults)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings
from primerl_router.policies import policy_class

RoleName = Literal["both", "prefill", "decode"]


class ReplicaConfig(Section):
    """An inference replica known from the start (others register at run time)."""

    replica_id: str = Field(min_length=1)
    address: str = Field(min_length=1, description="host:port of its inference.v1 server")
    role: RoleName = "both"
    labels: dict[str, str] = {}


class PolicyConfig(Section):
    name: str = Field(
        default="consistent_hash", description="round_robin | consistent_hash | least_loaded | cache_aware"
    )
    # The chosen policy's own settings (see the Options of policies/<name>.py).
    options: dict[str, Any] = {}

    @model_validator(mode="after")
    def _check_policy(self) -> PolicyConfig:
        cls = policy_class(self.name)  # ValueError naming the known policies
        try:
            cls.Options.model_validate(self.options)
        except ValidationError as exc:
            fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"options of policy {self.name!r}: {fields}") from None
        return self


class HealthConfig(Section):
    interval_s: float = Field(default=1.0, gt=0, description="time between grpc.health.v1 checks of a replica")
    timeout_s: float = Field(default=1.0, gt=0)
    unhealthy_threshold: int = Field(default=3, ge=1, description="consecutive failed checks that make it unhealthy")
    healthy_threshold: int = Field(default=2, ge=1, description="consecutive passed checks that make it healthy again")


class CircuitBreakerConfig(Section):
    failure_threshold: int = Field(default=5, ge=1, description="consecutive failed requests that open the circuit")
    open_s: float = Field(default=5.0, gt=0, description="how long an open circuit refuses requests before a trial")


class RoutingConfig(Section):
    max_attempts: int = Field(default=3, ge=1, description="replicas tried per request before its first token")
    no_replica_wait_s: float = Field(
        default=5.0, ge=0, description="how long a request waits for an eligible replica (e.g. one at its version)"
    )
    avoid_updating: bool = Field(
        default=True, description="keep new requests off replicas that update their weights while others can serve"
    )
    max_concurrent_generate: int = Field(
        default=8192,
        gt=0,
        description="Generate calls in flight on this router; past it a call is refused RESOURCE_EXHAUSTED at once "
        "with a retry hint (nothing queues)",
    )
    max_concurrent_generate_per_caller: int = Field(
        default=8192, gt=0, description="Generate calls in flight from one caller (its address)"
    )
    disaggregate: bool = Field(
        default=False,
        description="requests that name no role go to a prefill replica, which saves the prompt's KV to the "
        "kvstore, then to a decode replica, which loads it and decodes (primerl_router.disaggregation)",
    )


class LoadConfig(Section):
    report_interval_ms: int = Field(default=200, ge=10, description="WatchLoad interval asked of each replica")


class VersionsConfig(Section):
    weight_broadcaster_address: str | None = Field(
        default=None, description="host:port of the weight broadcaster to follow (WatchReplicas); unset: off"
    )


class RouterConfig(ServiceConfig):
    """primerl router: fronts the inference replicas: routing policies, prefill/decode groups, health,
    failover and policy versions.
    """

    service_name = "router"
    model_config = service_settings("router")

    server: ServerConfig = ServerConfig(port=50054)
    replicas: list[ReplicaConfig] = []
    policy: PolicyConfig = PolicyConfig()
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    load: LoadConfig = LoadConfig()
    versions: VersionsConfig = VersionsConfig()

    @model_validator(mode="after")
    def _unique_replica_ids(self) -> RouterConfig:
        ids = [replica.replica_id for replica in self.replicas]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"replicas: duplicate replica_id {', '.join(duplicates)}")
        return self
