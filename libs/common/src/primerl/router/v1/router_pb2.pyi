import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from primerl.common.v1 import generation_pb2 as _generation_pb2
from primerl.common.v1 import service_info_pb2 as _service_info_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_HEALTH_UNSPECIFIED: _ClassVar[ReplicaHealth]
    REPLICA_HEALTH_HEALTHY: _ClassVar[ReplicaHealth]
    REPLICA_HEALTH_DEGRADED: _ClassVar[ReplicaHealth]
    REPLICA_HEALTH_UNHEALTHY: _ClassVar[ReplicaHealth]

class CircuitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CIRCUIT_STATE_UNSPECIFIED: _ClassVar[CircuitState]
    CIRCUIT_STATE_CLOSED: _ClassVar[CircuitState]
    CIRCUIT_STATE_OPEN: _ClassVar[CircuitState]
    CIRCUIT_STATE_HALF_OPEN: _ClassVar[CircuitState]
REPLICA_HEALTH_UNSPECIFIED: ReplicaHealth
REPLICA_HEALTH_HEALTHY: ReplicaHealth
REPLICA_HEALTH_DEGRADED: ReplicaHealth
REPLICA_HEALTH_UNHEALTHY: ReplicaHealth
CIRCUIT_STATE_UNSPECIFIED: CircuitState
CIRCUIT_STATE_CLOSED: CircuitState
CIRCUIT_STATE_OPEN: CircuitState
CIRCUIT_STATE_HALF_OPEN: CircuitState

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _service_info_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_service_info_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class RoutingHints(_message.Message):
    __slots__ = ("session_key", "role")
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    role: _generation_pb2.ReplicaRole
    def __init__(self, session_key: _Optional[str] = ..., role: _Optional[_Union[_generation_pb2.ReplicaRole, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("input", "routing")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    input: _generation_pb2.GenerationInput
    routing: RoutingHints
    def __init__(self, input: _Optional[_Union[_generation_pb2.GenerationInput, _Mapping]] = ..., routing: _Optional[_Union[RoutingHints, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: _generation_pb2.GenerationOutput
    def __init__(self, output: _Optional[_Union[_generation_pb2.GenerationOutput, _Mapping]] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "address", "role", "health", "circuit", "draining", "load", "num_in_flight", "num_requests_total", "num_errors_total", "last_seen", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    role: _generation_pb2.ReplicaRole
    health: ReplicaHealth
    circuit: CircuitState
    draining: bool
    load: _generation_pb2.LoadReport
    num_in_flight: int
    num_requests_total: int
    num_errors_total: int
    last_seen: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_generation_pb2.ReplicaRole, str]] = ..., health: _Optional[_Union[ReplicaHealth, str]] = ..., circuit: _Optional[_Union[CircuitState, str]] = ..., draining: _Optional[bool] = ..., load: _Optional[_Union[_generation_pb2.LoadReport, _Mapping]] = ..., num_in_flight: _Optional[int] = ..., num_requests_total: _Optional[int] = ..., num_errors_total: _Optional[int] = ..., last_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "address", "role", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    role: _generation_pb2.ReplicaRole
    labels: _containers.ScalarMap[str, str]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_generation_pb2.ReplicaRole, str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaInfo
    def __init__(self, replica: _Optional[_Union[ReplicaInfo, _Mapping]] = ...) -> None: ...

class DeregisterReplicaRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class DeregisterReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ...) -> None: ...

class DrainReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "wait")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    wait: bool
    def __init__(self, replica_id: _Optional[str] = ..., wait: _Optional[bool] = ...) -> None: ...

class DrainReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaInfo
    def __init__(self, replica: _Optional[_Union[ReplicaInfo, _Mapping]] = ...) -> None: ...

class UndrainReplicaRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class UndrainReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaInfo
    def __init__(self, replica: _Optional[_Union[ReplicaInfo, _Mapping]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset_replica_ids", "failed_replica_ids")
    RESET_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    reset_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reset_replica_ids: _Optional[_Iterable[str]] = ..., failed_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...
