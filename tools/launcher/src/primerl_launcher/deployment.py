"""The inference deployment shape, one section of the launch file ([inference.deployment]):

- `single`: one replica of role both;
- `replicas`: `replicas` copies of role both behind the router (its policy spreads episodes);
- `disaggregated`: `prefill` replicas of role prefill and `decode` of role decode; the router
  sends each request to a prefill replica, which saves the prompt's KV to the kvstore, then to a
  decode replica, which loads it and decodes (primerl_router.disaggregation). The KV pool is on.

`kv_pool` puts the replicas of any shape on the kvstore's pooled KV cache (one replica's prefix
is another's hit); it is required by `disaggregated`, whose halves meet only there.

What each shape means for each service (a replica's role and pool switch, the router's
`routing.disaggregate`, the kvstore) is said once here, in `ReplicaLayout`s and
`router_settings`: the launcher applies them to the launch file's tables, and the files of
deploy/ are checked against them (tests/test_deploy_*.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

__all__ = ["SHAPES", "DeploymentConfig", "ReplicaLayout", "apply_settings", "replica_settings", "router_settings"]

Shape = Literal["single", "replicas", "disaggregated"]
SHAPES: tuple[Shape, ...] = ("single", "replicas", "disaggregated")
DEFAULT_REPLICAS = 2
# The services' own defaults of what a shape sets.
_SERVICE_DEFAULTS: dict[str, Any] = {"replica.role": "both", "routing.disaggregate": False}


@dataclass(frozen=True)
class ReplicaLayout:
    """One inference replica of a shape: its name (and replica id), role and pool switch."""

    name: str
    role: Literal["both", "prefill", "decode"]
    kv_pool: bool


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shape: Shape = Field(default="single", description="single | replicas | disaggregated")
    replicas: int | None = Field(
        default=None, ge=1, description=f"shape replicas: replicas behind the router (default {DEFAULT_REPLICAS})"
    )
    prefill: int | None = Field(
        default=None, ge=1, validate_default=True, description="shape disaggregated: prefill replicas (required)"
    )
    decode: int | None = Field(
        default=None, ge=1, validate_default=True, description="shape disaggregated: decode replicas (required)"
    )
    kv_pool: bool | None = Field(
        default=None,
        description="the replicas load and save prefix KV through the kvstore; disaggregated: always on; "
        "otherwise default off",
    )

    @field_validator("replicas")
    @classmethod
    def _replicas_of_the_shape(cls, value: int | None, info: ValidationInfo) -> int | None:
        shape = info.data.get("shape")
        if value is not None and shape == "single" and value != 1:
            raise ValueError(f'shape single has one replica, got {value}: use shape = "replicas"')
        if value is not None and shape == "disaggregated":
            raise ValueError("shape disaggregated counts its replicas in prefill and decode, not replicas")
        return value

    @field_validator("prefill", "decode")
    @classmethod
    def _halves_of_the_shape(cls, value: int | None, info: ValidationInfo) -> int | None:
        shape = info.data.get("shape")
        if shape == "disaggregated" and value is None:
            raise ValueError("required with shape disaggregated (at least 1)")
        if shape in ("single", "replicas") and value is not None:
            raise ValueError(f"only with shape disaggregated (shape is {shape})")
        return value

    @field_validator("kv_pool")
    @classmethod
    def _pool_of_the_shape(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is False and info.data.get("shape") == "disaggregated":
            raise ValueError("shape disaggregated needs the KV pool: its prefill and decode halves meet there")
        return value

    @classmethod
    def from_replicas(cls, num_replicas: int) -> DeploymentConfig:
        """The shape a launch file without the section has: [launcher] inference_replicas copies."""
        if num_replicas == 1:
            return cls()
        return cls(shape="replicas", replicas=num_replicas)

    @property
    def pool_on(self) -> bool:
        return self.shape == "disaggregated" or bool(self.kv_pool)

    @property
    def disaggregate(self) -> bool:
        return self.shape == "disaggregated"

    @property
    def num_replicas(self) -> int:
        if self.shape == "disaggregated":
            assert self.prefill is not None and self.decode is not None
            return self.prefill + self.decode
        return self.replicas or (1 if self.shape == "single" else DEFAULT_REPLICAS)

    def layout(self) -> list[ReplicaLayout]:
        """The replicas in start order, named as the launcher and the router know them."""
        pool = self.pool_on
        if self.shape != "disaggregated":
            return [ReplicaLayout(f"inference-{i}", "both", pool) for i in range(self.num_replicas)]
        assert self.prefill is not None and self.decode is not None
        return [
            *(ReplicaLayout(f"inference-prefill-{i}", "prefill", True) for i in range(self.prefill)),
            *(ReplicaLayout(f"inference-decode-{i}", "decode", True) for i in range(self.decode)),
        ]

    def describe(self) -> str:
        if self.shape == "disaggregated":
            return f"disaggregated ({self.prefill} prefill + {self.decode} decode, KV pool on)"
        pool = ", KV pool on" if self.pool_on else ""
        if self.shape == "single":
            return f"single (1 replica{pool})"
        return f"replicas ({self.num_replicas} behind the router{pool})"


def router_settings(deployment: DeploymentConfig) -> dict[str, Any]:
    """What the shape sets in the router's config (dotted keys)."""
    return {"routing.disaggregate": deployment.disaggregate}


def replica_settings(layout: ReplicaLayout) -> dict[str, Any]:
    """What the shape sets in one replica's config (dotted keys); the pool's address is wiring."""
    settings: dict[str, Any] = {"replica.role": layout.role}
    if layout.kv_pool:
        settings["kv_cache_pool.enabled"] = True
    return settings


def apply_settings(table: dict[str, Any], settings: dict[str, Any]) -> None:
    """Sets each dotted key of `settings` in `table` (in place); ValueError naming the key
    when the table already sets it otherwise. A value that is the service's own default is
    checked, not written."""
    for dotted, value in settings.items():
        *parents, last = dotted.split(".")
        node: Any = table
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else None
        current = node.get(last) if isinstance(node, dict) else None
        if current is not None and current != value:
            raise ValueError(f"{dotted}: the deployment shape sets it to {value!r}, the file to {current!r}")
        if _SERVICE_DEFAULTS.get(dotted) == value:
            continue
        node = table
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{dotted}: {part} must be a table")
        node[last] = value
