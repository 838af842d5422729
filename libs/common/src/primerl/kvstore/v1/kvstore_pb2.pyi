import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from primerl.common.v1 import service_info_pb2 as _service_info_pb2
from primerl.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_DISK: Tier

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _service_info_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_service_info_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class BlockKey(_message.Message):
    __slots__ = ("model", "parallel_rank", "namespace", "content_hash")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    model: str
    parallel_rank: int
    namespace: str
    content_hash: bytes
    def __init__(self, model: _Optional[str] = ..., parallel_rank: _Optional[int] = ..., namespace: _Optional[str] = ..., content_hash: _Optional[bytes] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("key", "num_bytes", "routed_experts", "found")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    key: BlockKey
    num_bytes: int
    routed_experts: _tensor_pb2.Tensor
    found: bool
    def __init__(self, key: _Optional[_Union[BlockKey, _Mapping]] = ..., num_bytes: _Optional[int] = ..., routed_experts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., found: _Optional[bool] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("num_stored", "num_existing", "num_rejected")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_existing: int
    num_rejected: int
    def __init__(self, num_stored: _Optional[int] = ..., num_existing: _Optional[int] = ..., num_rejected: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[BlockKey, _Mapping]]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BatchExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[BlockKey, _Mapping]]] = ...) -> None: ...

class BatchExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[BlockKey, _Mapping]]] = ...) -> None: ...

class RemoveBlocksResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class RemoveNamespaceRequest(_message.Message):
    __slots__ = ("model", "namespace")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    model: str
    namespace: str
    def __init__(self, model: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class RemoveNamespaceResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "dram_capacity_bytes", "disk_capacity_bytes", "dram_used_bytes", "disk_used_bytes", "last_heartbeat", "num_blocks", "num_evicted_total", "num_spilled_total", "bulk_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    dram_capacity_bytes: int
    disk_capacity_bytes: int
    dram_used_bytes: int
    disk_used_bytes: int
    last_heartbeat: _timestamp_pb2.Timestamp
    num_blocks: int
    num_evicted_total: int
    num_spilled_total: int
    bulk_address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., dram_capacity_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., dram_used_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., last_heartbeat: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_evicted_total: _Optional[int] = ..., num_spilled_total: _Optional[int] = ..., bulk_address: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("key", "found", "node_id", "address", "tier", "lease_id", "bulk_address")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    key: BlockKey
    found: bool
    node_id: str
    address: str
    tier: Tier
    lease_id: str
    bulk_address: str
    def __init__(self, key: _Optional[_Union[BlockKey, _Mapping]] = ..., found: _Optional[bool] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., lease_id: _Optional[str] = ..., bulk_address: _Optional[str] = ...) -> None: ...

class LocateBlocksRequest(_message.Message):
    __slots__ = ("keys", "lease_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[BlockKey]
    lease_ms: int
    def __init__(self, keys: _Optional[_Iterable[_Union[BlockKey, _Mapping]]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LocateBlocksResponse(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ("key", "num_bytes", "tier")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    key: BlockKey
    num_bytes: int
    tier: Tier
    def __init__(self, key: _Optional[_Union[BlockKey, _Mapping]] = ..., num_bytes: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class UpdateBlocksRequest(_message.Message):
    __slots__ = ("node_id", "stored", "removed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    stored: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    removed: _containers.RepeatedCompositeFieldContainer[BlockKey]
    def __init__(self, node_id: _Optional[str] = ..., stored: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ..., removed: _Optional[_Iterable[_Union[BlockKey, _Mapping]]] = ...) -> None: ...

class UpdateBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClaimEvictionRequest(_message.Message):
    __slots__ = ("node_id", "keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: _containers.RepeatedCompositeFieldContainer[BlockKey]
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[BlockKey, _Mapping]]] = ...) -> None: ...

class ClaimEvictionResponse(_message.Message):
    __slots__ = ("granted",)
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    granted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, granted: _Optional[_Iterable[bool]] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("model", "namespace", "num_blocks", "num_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    namespace: str
    num_blocks: int
    num_bytes: int
    def __init__(self, model: _Optional[str] = ..., namespace: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_blocks", "dram_used_bytes", "dram_capacity_bytes", "disk_used_bytes", "disk_capacity_bytes", "num_hits_total", "num_misses_total", "num_evicted_total", "num_spilled_total", "num_leased_blocks", "namespaces", "nodes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    dram_used_bytes: int
    dram_capacity_bytes: int
    disk_used_bytes: int
    disk_capacity_bytes: int
    num_hits_total: int
    num_misses_total: int
    num_evicted_total: int
    num_spilled_total: int
    num_leased_blocks: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, num_blocks: _Optional[int] = ..., dram_used_bytes: _Optional[int] = ..., dram_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., num_hits_total: _Optional[int] = ..., num_misses_total: _Optional[int] = ..., num_evicted_total: _Optional[int] = ..., num_spilled_total: _Optional[int] = ..., num_leased_blocks: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...
