"""Builds the kvstore's ServiceDefinition from its config: the metadata role, a storage node, or both."""

from __future__ import annotations

import grpc

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common import security
from primerl_common.server import ServiceDefinition
from primerl_kvstore import __version__
from primerl_kvstore.bulk import BulkLimits, BulkServer
from primerl_kvstore.config import KvstoreConfig
from primerl_kvstore.disk import DiskTier
from primerl_kvstore.links import LocalMetadataLink, Membership, RemoteMetadataLink, RemoteStorageLinks
from primerl_kvstore.metadata import Metadata
from primerl_kvstore.metrics import track
from primerl_kvstore.servicer import KvstoreServicer
from primerl_kvstore.storage import MetadataLink, StorageNode

__all__ = ["ROLES", "build"]

_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"]
# Who may call what (primerl_common.security): inference replicas (their KV connectors) put,
# get and locate blocks; kvstore nodes talk to each other (membership, block reports,
# evictions, removal fan-out); removal is also the orchestrator's (a version no rollout uses)
# and operators'; anyone authenticated reads the stats.
_POOL = {security.INFERENCE, security.KVSTORE}
ROLES = {
    "PutBlocks": {security.INFERENCE},
    "GetBlocks": {security.INFERENCE},
    "BatchExists": _POOL,
    "RemoveBlocks": {security.KVSTORE, security.OPERATOR},
    "RemoveNamespace": {security.KVSTORE, security.ORCHESTRATOR, security.OPERATOR},
    "RegisterNode": {security.KVSTORE},
    "Heartbeat": {security.KVSTORE},
    "LocateBlocks": _POOL,
    "ReleaseLeases": _POOL,
    "UpdateBlocks": {security.KVSTORE},
    "ClaimEviction": {security.KVSTORE},
    "GetStats": security.ANY,
}


def _add_kvstore_service(servicer: KvstoreServicer, server: grpc.aio.Server) -> None:
    kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(servicer, server)
    # Registered again with raw bytes for the block streams (see wire.py); a later
    # registration of a method replaces the earlier one.
    server.add_registered_method_handlers(
        _SERVICE.full_name,
        {
            "PutBlocks": grpc.stream_unary_rpc_method_handler(servicer.PutBlocks),
            "GetBlocks": grpc.unary_stream_rpc_method_handler(
                servicer.GetBlocks, request_deserializer=kvstore_pb2.GetBlocksRequest.FromString
            ),
        },
    )


async def build(config: KvstoreConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="kvstore", version=__version__, servicers=[], attributes={"role": config.role})
    max_message_bytes = config.server.max_message_bytes
    capabilities = []
    metadata = storage = None
    storage_links = None
    if config.has_metadata:
        storage_links = RemoteStorageLinks(local=None, max_message_bytes=max_message_bytes)
        metadata = Metadata(
            node_timeout_s=config.metadata.node_timeout_s,
            max_lease_ms=config.metadata.max_lease_ms,
            storage_link=storage_links,
        )
        capabilities.append("kvstore.role.metadata")
        definition.on_start = [*definition.on_start, metadata.start]
        definition.on_stop = [*definition.on_stop, metadata.stop, storage_links.close]
    if config.has_storage:
        link: MetadataLink
        if metadata is not None:
            link = LocalMetadataLink(metadata)
        else:
            assert config.node.metadata_address is not None
            remote = RemoteMetadataLink(config.node.metadata_address, max_message_bytes=max_message_bytes)
            definition.on_stop = [*definition.on_stop, remote.close]
            link = remote
        disk = None
        if config.disk.path is not None:
            disk = DiskTier(config.disk.path, capacity_bytes=config.disk.capacity_bytes, fsync=config.disk.fsync)
            capabilities.append("kvstore.tier.disk")
        storage = StorageNode(
            node_id=config.node_id(),
            address=config.advertise_address(),
            dram_capacity_bytes=config.dram.capacity_bytes,
            disk=disk,
            high_watermark=config.eviction.high_watermark,
            low_watermark=config.eviction.low_watermark,
            chunk_bytes=config.node.chunk_bytes,
            metadata=link,
        )
        storage.load()
        if storage_links is not None:
            storage_links.local = storage
        if config.node.bulk_port is not None:
            bulk = BulkServer(
                storage,
                config.server.host,
                config.node.bulk_port,
                limits=BulkLimits(
                    max_connections=config.node.bulk_max_connections,
                    max_header_bytes=config.node.bulk_max_header_bytes,
                    idle_timeout_s=config.node.bulk_idle_timeout_s,
                    request_timeout_s=config.node.bulk_request_timeout_s,
                ),
                tls=config.tls,
                allowed_roles=ROLES["PutBlocks"] | ROLES["GetBlocks"],
            )

            async def start_bulk(bulk: BulkServer = bulk, node: StorageNode = storage) -> None:
                await bulk.start()
                node.bulk_address = config.bulk_address(bulk.port)

            definition.on_start = [*definition.on_start, start_bulk]
            definition.on_stop = [bulk.stop, *definition.on_stop]
            capabilities.append("kvstore.bulk")
        membership = Membership(storage, interval_s=config.node.heartbeat_interval_s)
        capabilities.append("kvstore.role.storage")
        definition.on_start = [*definition.on_start, membership.start]
        # Stops before the links it uses close.
        definition.on_stop = [membership.stop, *definition.on_stop]
        definition.attributes["node_id"] = storage.node_id
    track(node=storage, metadata=metadata)
    definition.capabilities = capabilities
    servicer = KvstoreServicer(
        definition, metadata=metadata, storage=storage, max_keys=config.metadata.max_keys_per_request
    )
    definition.servicers = [(_add_kvstore_service, servicer, _SERVICE)]
    definition.permissions = security.method_roles(_SERVICE, ROLES)
    return definition
