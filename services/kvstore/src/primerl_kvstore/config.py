"""Configuration of the kvstore (flags > PRIMERL_KVSTORE_* > TOML > defaults)."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings

__all__ = ["DiskConfig", "DramConfig", "EvictionConfig", "KvstoreConfig", "MetadataConfig", "NodeConfig"]

RoleName = Literal["both", "metadata", "storage"]


class NodeConfig(Section):
    """This process as a storage node."""

    node_id: str | None = Field(default=None, description="unique node name; unset: the host name and port")
    advertise_address: str | None = Field(
        default=None, description="host:port peers read blocks from; unset: 127.0.0.1 (or server.host) and the port"
    )
    metadata_address: str | None = Field(
        default=None, description="host:port of the metadata role (role storage); unset with role both"
    )
    bulk_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="TCP port of the bulk side channel (raw block puts and gets); 0 picks one; unset: off",
    )
    bulk_max_connections: int = Field(
        default=256,
        gt=0,
        description="bulk channel connections open at once (a thread each); another is answered RESOURCE_EXHAUSTED",
    )
    bulk_max_header_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description="block headers of one bulk put request, all together (held until the blocks are received)",
    )
    bulk_idle_timeout_s: float = Field(
        default=60.0, gt=0, description="within a bulk request, the longest wait for the peer to send or read"
    )
    bulk_request_timeout_s: float = Field(
        default=600.0, gt=0, description="the longest one bulk request may take (DEADLINE_EXCEEDED, then closed)"
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0, description="time between heartbeats to the metadata role")
    chunk_bytes: int = Field(
        default=1024 * 1024, ge=4096, description="data per message when a block read from disk is streamed"
    )


class DramConfig(Section):
    capacity_bytes: int = Field(default=1 << 30, gt=0, description="DRAM segment this node contributes")


class DiskConfig(Section):
    path: str | None = Field(default=None, description="folder of the disk tier; unset: no disk tier")
    capacity_bytes: int = Field(default=8 << 30, gt=0)
    fsync: bool = Field(default=True, description="fsync each block file and its folder before it is served")


class EvictionConfig(Section):
    high_watermark: float = Field(
        default=0.95, gt=0, le=1, description="fraction of a tier's capacity past which it evicts"
    )
    low_watermark: float = Field(default=0.90, gt=0, le=1, description="fraction eviction brings a tier down to")

    @model_validator(mode="after")
    def _ordered(self) -> EvictionConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        return self


class MetadataConfig(Section):
    node_timeout_s: float = Field(
        default=5.0, gt=0, description="a storage node silent this long is dead: its blocks are no longer located"
    )
    max_lease_ms: int = Field(default=60_000, gt=0, description="longest lease LocateBlocks grants")
    max_keys_per_request: int = Field(default=65_536, gt=0)


class KvstoreConfig(ServiceConfig):
    """primerl kvstore: a pooled KV-cache store in DRAM and disk, keyed by model, rank, policy-version
    namespace and block hash.
    """

    service_name = "kvstore"
    model_config = service_settings("kvstore")

    server: ServerConfig = ServerConfig(port=50056)
    role: RoleName = Field(default="both", description="metadata, storage, or both in one process")
    node: NodeConfig = NodeConfig()
    dram: DramConfig = DramConfig()
    disk: DiskConfig = DiskConfig()
    eviction: EvictionConfig = EvictionConfig()
    metadata: MetadataConfig = MetadataConfig()

    @model_validator(mode="after")
    def _storage_is_reachable(self) -> KvstoreConfig:
        if self.role == "storage" and not self.node.metadata_address:
            raise ValueError("node.metadata_address: required with role storage")
        if self.role == "both" and self.node.metadata_address:
            raise ValueError("node.metadata_address: must be unset with role both (the metadata role is this process)")
        if self.role != "metadata" and self.server.port == 0 and not self.node.advertise_address:
            raise ValueError("node.advertise_address: required when server.port is 0 (peers must reach this node)")
        return self

    @property
    def has_storage(self) -> bool:
        return self.role in ("both", "storage")

    @property
    def has_metadata(self) -> bool:
        return self.role in ("both", "metadata")

    def advertise_address(self) -> str:
        if self.node.advertise_address:
            return self.node.advertise_address
        host = self.server.host if self.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{host}:{self.server.port}"

    def bulk_address(self, port: int) -> str:
        return f"{self.advertise_address().rsplit(':', 1)[0]}:{port}"

    def node_id(self) -> str:
        return self.node.node_id or f"{socket.gethostname()}:{self.server.port}"
