from primerl.common.v1 import generation_pb2 as _generation_pb2
from primerl.common.v1 import service_info_pb2 as _service_info_pb2
from primerl.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_KEEP: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_ABORT: PauseMode

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _service_info_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_service_info_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("input",)
    INPUT_FIELD_NUMBER: _ClassVar[int]
    input: _generation_pb2.GenerationInput
    def __init__(self, input: _Optional[_Union[_generation_pb2.GenerationInput, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: _generation_pb2.GenerationOutput
    def __init__(self, output: _Optional[_Union[_generation_pb2.GenerationOutput, _Mapping]] = ...) -> None: ...

class WeightUpdateBegin(_message.Message):
    __slots__ = ("policy_version", "format", "num_tensors", "num_bytes", "delta", "base_policy_version", "shared_fs_path", "collective", "collective_tensors", "stripe_session", "num_stripes", "stripe_index", "shm_path")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FS_PATH_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    STRIPE_SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_STRIPES_FIELD_NUMBER: _ClassVar[int]
    STRIPE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    format: _tensor_pb2.WeightFormat
    num_tensors: int
    num_bytes: int
    delta: bool
    base_policy_version: int
    shared_fs_path: str
    collective: CollectiveGroup
    collective_tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorHeader]
    stripe_session: str
    num_stripes: int
    stripe_index: int
    shm_path: str
    def __init__(self, policy_version: _Optional[int] = ..., format: _Optional[_Union[_tensor_pb2.WeightFormat, str]] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., delta: _Optional[bool] = ..., base_policy_version: _Optional[int] = ..., shared_fs_path: _Optional[str] = ..., collective: _Optional[_Union[CollectiveGroup, _Mapping]] = ..., collective_tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorHeader, _Mapping]]] = ..., stripe_session: _Optional[str] = ..., num_stripes: _Optional[int] = ..., stripe_index: _Optional[int] = ..., shm_path: _Optional[str] = ...) -> None: ...

class CollectiveGroup(_message.Message):
    __slots__ = ("store_address", "group_name", "rank", "world_size", "backend", "timeout_ms", "bucket_bytes")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    group_name: str
    rank: int
    world_size: int
    backend: str
    timeout_ms: int
    bucket_bytes: int
    def __init__(self, store_address: _Optional[str] = ..., group_name: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("begin", "chunk")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    begin: WeightUpdateBegin
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, begin: _Optional[_Union[WeightUpdateBegin, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "num_tensors", "num_bytes", "pause_s", "total_s")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tensors: int
    num_bytes: int
    pause_s: float
    total_s: float
    def __init__(self, policy_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., pause_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _generation_pb2.LoadReport
    def __init__(self, load: _Optional[_Union[_generation_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _generation_pb2.LoadReport
    def __init__(self, load: _Optional[_Union[_generation_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _generation_pb2.LoadReport
    def __init__(self, load: _Optional[_Union[_generation_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class WatchLoadResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _generation_pb2.LoadReport
    def __init__(self, load: _Optional[_Union[_generation_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class AdapterSpec(_message.Message):
    __slots__ = ("name", "path", "rank", "alpha", "target_modules", "policy_version", "owner")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    policy_version: int
    owner: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., policy_version: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("spec", "chunk")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    spec: AdapterSpec
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, spec: _Optional[_Union[AdapterSpec, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("name", "replaced")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    name: str
    replaced: bool
    def __init__(self, name: _Optional[str] = ..., replaced: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterSpec]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterSpec, _Mapping]]] = ...) -> None: ...
