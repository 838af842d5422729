import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from primerl.common.v1 import service_info_pb2 as _service_info_pb2
from primerl.common.v1 import tensor_pb2 as _tensor_pb2
from primerl.inference.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUBLISH_KIND_UNSPECIFIED: _ClassVar[PublishKind]
    PUBLISH_KIND_FULL: _ClassVar[PublishKind]
    PUBLISH_KIND_ADAPTER: _ClassVar[PublishKind]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_GRPC: _ClassVar[Transport]
    TRANSPORT_SHARED_FS: _ClassVar[Transport]
    TRANSPORT_NCCL: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_AUTO: _ClassVar[Transport]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_CURRENT: _ClassVar[ReplicaState]
    REPLICA_STATE_UPDATING: _ClassVar[ReplicaState]
    REPLICA_STATE_BEHIND: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]
PUBLISH_KIND_UNSPECIFIED: PublishKind
PUBLISH_KIND_FULL: PublishKind
PUBLISH_KIND_ADAPTER: PublishKind
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_GRPC: Transport
TRANSPORT_SHARED_FS: Transport
TRANSPORT_NCCL: Transport
TRANSPORT_SHM: Transport
TRANSPORT_AUTO: Transport
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_CURRENT: ReplicaState
REPLICA_STATE_UPDATING: ReplicaState
REPLICA_STATE_BEHIND: ReplicaState
REPLICA_STATE_FAILED: ReplicaState

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _service_info_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_service_info_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class PublishBegin(_message.Message):
    __slots__ = ("policy_version", "kind", "num_tensors", "num_bytes", "trainer_step", "adapter_name", "adapter_rank", "adapter_alpha", "model_type", "stripe_session", "num_stripes", "stripe_index", "adapter_owner")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ALPHA_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    STRIPE_SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_STRIPES_FIELD_NUMBER: _ClassVar[int]
    STRIPE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_OWNER_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    kind: PublishKind
    num_tensors: int
    num_bytes: int
    trainer_step: int
    adapter_name: str
    adapter_rank: int
    adapter_alpha: float
    model_type: str
    stripe_session: str
    num_stripes: int
    stripe_index: int
    adapter_owner: str
    def __init__(self, policy_version: _Optional[int] = ..., kind: _Optional[_Union[PublishKind, str]] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., trainer_step: _Optional[int] = ..., adapter_name: _Optional[str] = ..., adapter_rank: _Optional[int] = ..., adapter_alpha: _Optional[float] = ..., model_type: _Optional[str] = ..., stripe_session: _Optional[str] = ..., num_stripes: _Optional[int] = ..., stripe_index: _Optional[int] = ..., adapter_owner: _Optional[str] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("begin", "chunk")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    begin: PublishBegin
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, begin: _Optional[_Union[PublishBegin, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class PublishCollectiveRequest(_message.Message):
    __slots__ = ("begin", "tensors", "new_group")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_FIELD_NUMBER: _ClassVar[int]
    begin: PublishBegin
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorHeader]
    new_group: bool
    def __init__(self, begin: _Optional[_Union[PublishBegin, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorHeader, _Mapping]]] = ..., new_group: _Optional[bool] = ...) -> None: ...

class PublishCollectiveResponse(_message.Message):
    __slots__ = ("group", "replica_ids", "send_data")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    SEND_DATA_FIELD_NUMBER: _ClassVar[int]
    group: _inference_pb2.CollectiveGroup
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    send_data: bool
    def __init__(self, group: _Optional[_Union[_inference_pb2.CollectiveGroup, _Mapping]] = ..., replica_ids: _Optional[_Iterable[str]] = ..., send_data: _Optional[bool] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "num_tensors", "num_bytes", "num_changed_tensors")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHANGED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tensors: int
    num_bytes: int
    num_changed_tensors: int
    def __init__(self, policy_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_changed_tensors: _Optional[int] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "address", "format", "transport", "delta", "policy_version")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    format: _tensor_pb2.WeightFormat
    transport: Transport
    delta: bool
    policy_version: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., format: _Optional[_Union[_tensor_pb2.WeightFormat, str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., delta: _Optional[bool] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("replica", "latest_policy_version")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    latest_policy_version: int
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., latest_policy_version: _Optional[int] = ...) -> None: ...

class DeregisterReplicaRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class DeregisterReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "state", "policy_version", "target_policy_version", "last_error", "num_consecutive_failures", "next_retry_at", "last_push_s", "num_bytes_sent_total", "format", "transport", "delta", "num_tensors_last_push", "num_bytes_last_push", "last_push_delta", "last_push_transport", "transport_reason", "adapter_versions", "adapter_owners")
    class AdapterVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AdapterOwnersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NEXT_RETRY_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_S_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_SENT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_LAST_PUSH_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_LAST_PUSH_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_DELTA_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_REASON_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_OWNERS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    state: ReplicaState
    policy_version: int
    target_policy_version: int
    last_error: str
    num_consecutive_failures: int
    next_retry_at: _timestamp_pb2.Timestamp
    last_push_s: float
    num_bytes_sent_total: int
    format: _tensor_pb2.WeightFormat
    transport: Transport
    delta: bool
    num_tensors_last_push: int
    num_bytes_last_push: int
    last_push_delta: bool
    last_push_transport: Transport
    transport_reason: str
    adapter_versions: _containers.ScalarMap[str, int]
    adapter_owners: _containers.ScalarMap[str, str]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., policy_version: _Optional[int] = ..., target_policy_version: _Optional[int] = ..., last_error: _Optional[str] = ..., num_consecutive_failures: _Optional[int] = ..., next_retry_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_push_s: _Optional[float] = ..., num_bytes_sent_total: _Optional[int] = ..., format: _Optional[_Union[_tensor_pb2.WeightFormat, str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., delta: _Optional[bool] = ..., num_tensors_last_push: _Optional[int] = ..., num_bytes_last_push: _Optional[int] = ..., last_push_delta: _Optional[bool] = ..., last_push_transport: _Optional[_Union[Transport, str]] = ..., transport_reason: _Optional[str] = ..., adapter_versions: _Optional[_Mapping[str, int]] = ..., adapter_owners: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("latest_policy_version", "replicas", "latest_adapter_versions")
    class LatestAdapterVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    latest_policy_version: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    latest_adapter_versions: _containers.ScalarMap[str, int]
    def __init__(self, latest_policy_version: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., latest_adapter_versions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WaitForVersionRequest(_message.Message):
    __slots__ = ("policy_version", "min_replicas", "timeout_ms", "adapter_name")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    min_replicas: int
    timeout_ms: int
    adapter_name: str
    def __init__(self, policy_version: _Optional[int] = ..., min_replicas: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., adapter_name: _Optional[str] = ...) -> None: ...

class WaitForVersionResponse(_message.Message):
    __slots__ = ("reached", "latest_policy_version", "num_replicas_at_version")
    REACHED_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    reached: bool
    latest_policy_version: int
    num_replicas_at_version: int
    def __init__(self, reached: _Optional[bool] = ..., latest_policy_version: _Optional[int] = ..., num_replicas_at_version: _Optional[int] = ...) -> None: ...

class WatchReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchReplicasResponse(_message.Message):
    __slots__ = ("replica", "removed", "latest_policy_version")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    removed: bool
    latest_policy_version: int
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., removed: _Optional[bool] = ..., latest_policy_version: _Optional[int] = ...) -> None: ...

class RemoveAdapterRequest(_message.Message):
    __slots__ = ("adapter_name",)
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    adapter_name: str
    def __init__(self, adapter_name: _Optional[str] = ...) -> None: ...

class RemoveAdapterResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...
