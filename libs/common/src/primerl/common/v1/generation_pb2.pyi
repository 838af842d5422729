from primerl.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_ROLE_UNSPECIFIED: _ClassVar[ReplicaRole]
    REPLICA_ROLE_BOTH: _ClassVar[ReplicaRole]
    REPLICA_ROLE_PREFILL: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DECODE: _ClassVar[ReplicaRole]

class KvTransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_MODE_UNSPECIFIED: _ClassVar[KvTransferMode]
    KV_TRANSFER_MODE_PREFILL_ONLY: _ClassVar[KvTransferMode]
    KV_TRANSFER_MODE_DECODE_FROM_STORE: _ClassVar[KvTransferMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
REPLICA_ROLE_UNSPECIFIED: ReplicaRole
REPLICA_ROLE_BOTH: ReplicaRole
REPLICA_ROLE_PREFILL: ReplicaRole
REPLICA_ROLE_DECODE: ReplicaRole
KV_TRANSFER_MODE_UNSPECIFIED: KvTransferMode
KV_TRANSFER_MODE_PREFILL_ONLY: KvTransferMode
KV_TRANSFER_MODE_DECODE_FROM_STORE: KvTransferMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop_token_ids", "seed", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("every_n_tokens", "every_ms", "final_only")
    EVERY_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVERY_MS_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    every_n_tokens: int
    every_ms: int
    final_only: bool
    def __init__(self, every_n_tokens: _Optional[int] = ..., every_ms: _Optional[int] = ..., final_only: _Optional[bool] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("mode", "transfer_id")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    mode: KvTransferMode
    transfer_id: str
    def __init__(self, mode: _Optional[_Union[KvTransferMode, str]] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class GenerationInput(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stream", "cache_salt", "lora_adapter", "return_prompt_logprobs", "return_routed_experts", "min_policy_version", "kv_transfer", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stream: StreamOptions
    cache_salt: str
    lora_adapter: str
    return_prompt_logprobs: bool
    return_routed_experts: bool
    min_policy_version: int
    kv_transfer: KvTransferParams
    images: _containers.RepeatedCompositeFieldContainer[ImageData]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[_Union[StreamOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_adapter: _Optional[str] = ..., return_prompt_logprobs: _Optional[bool] = ..., return_routed_experts: _Optional[bool] = ..., min_policy_version: _Optional[int] = ..., kv_transfer: _Optional[_Union[KvTransferParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[ImageData, _Mapping]]] = ...) -> None: ...

class ImageData(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_cached_prompt_tokens", "num_output_tokens", "time_to_first_token_s", "total_time_s")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_output_tokens: int
    time_to_first_token_s: float
    total_time_s: float
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., total_time_s: _Optional[float] = ...) -> None: ...

class GenerationOutput(_message.Message):
    __slots__ = ("request_id", "offset", "token_ids", "logprobs", "policy_versions", "finished", "finish_reason", "prompt_logprobs", "routed_experts", "stats", "replica_id", "routed_experts_start", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_START_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: FinishReason
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    routed_experts: _tensor_pb2.Tensor
    stats: GenerationStats
    replica_id: str
    routed_experts_start: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., routed_experts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., replica_id: _Optional[str] = ..., routed_experts_start: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_waiting", "num_running", "kv_cache_usage", "policy_version", "updating_weights", "paused", "draining", "role", "num_prompt_tokens_total", "num_generated_tokens_total", "num_prefix_cache_hit_tokens_total", "num_kv_pool_hit_tokens_total", "adapter_versions", "adapter_owners")
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
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATING_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_POOL_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_OWNERS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    policy_version: int
    updating_weights: bool
    paused: bool
    draining: bool
    role: ReplicaRole
    num_prompt_tokens_total: int
    num_generated_tokens_total: int
    num_prefix_cache_hit_tokens_total: int
    num_kv_pool_hit_tokens_total: int
    adapter_versions: _containers.ScalarMap[str, int]
    adapter_owners: _containers.ScalarMap[str, str]
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., policy_version: _Optional[int] = ..., updating_weights: _Optional[bool] = ..., paused: _Optional[bool] = ..., draining: _Optional[bool] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., num_prompt_tokens_total: _Optional[int] = ..., num_generated_tokens_total: _Optional[int] = ..., num_prefix_cache_hit_tokens_total: _Optional[int] = ..., num_kv_pool_hit_tokens_total: _Optional[int] = ..., adapter_versions: _Optional[_Mapping[str, int]] = ..., adapter_owners: _Optional[_Mapping[str, str]] = ...) -> None: ...
