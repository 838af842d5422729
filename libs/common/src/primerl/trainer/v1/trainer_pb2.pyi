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

class TrainingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINING_MODE_UNSPECIFIED: _ClassVar[TrainingMode]
    TRAINING_MODE_RL: _ClassVar[TrainingMode]
    TRAINING_MODE_SFT: _ClassVar[TrainingMode]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_ACTIVE: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
TRAINING_MODE_UNSPECIFIED: TrainingMode
TRAINING_MODE_RL: TrainingMode
TRAINING_MODE_SFT: TrainingMode
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_ACTIVE: RunState
RUN_STATE_PAUSED: RunState
RUN_STATE_FAILED: RunState

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _service_info_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_service_info_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class GetBatchSpecRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetBatchSpecResponse(_message.Message):
    __slots__ = ("seq_len", "router_replay", "num_moe_layers", "num_experts_per_token", "num_experts", "vocab_size", "max_queued_batches", "next_step", "num_hidden_layers", "mode", "image_token_id", "patches_per_image_token", "lora_adapter")
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    ROUTER_REPLAY_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PATCHES_PER_IMAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    seq_len: int
    router_replay: bool
    num_moe_layers: int
    num_experts_per_token: int
    num_experts: int
    vocab_size: int
    max_queued_batches: int
    next_step: int
    num_hidden_layers: int
    mode: TrainingMode
    image_token_id: int
    patches_per_image_token: int
    lora_adapter: str
    def __init__(self, seq_len: _Optional[int] = ..., router_replay: _Optional[bool] = ..., num_moe_layers: _Optional[int] = ..., num_experts_per_token: _Optional[int] = ..., num_experts: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_queued_batches: _Optional[int] = ..., next_step: _Optional[int] = ..., num_hidden_layers: _Optional[int] = ..., mode: _Optional[_Union[TrainingMode, str]] = ..., image_token_id: _Optional[int] = ..., patches_per_image_token: _Optional[int] = ..., lora_adapter: _Optional[str] = ...) -> None: ...

class BatchBegin(_message.Message):
    __slots__ = ("step", "num_micro_batches", "num_samples", "num_loss_tokens", "min_policy_version", "max_policy_version", "run_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_micro_batches: int
    num_samples: int
    num_loss_tokens: int
    min_policy_version: int
    max_policy_version: int
    run_id: str
    def __init__(self, step: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_loss_tokens: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures", "routed_experts", "policy_versions", "pixel_values", "image_grid_thw")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    input_ids: _tensor_pb2.Tensor
    position_ids: _tensor_pb2.Tensor
    loss_mask: _tensor_pb2.Tensor
    advantages: _tensor_pb2.Tensor
    inference_logprobs: _tensor_pb2.Tensor
    temperatures: _tensor_pb2.Tensor
    routed_experts: _tensor_pb2.Tensor
    policy_versions: _tensor_pb2.Tensor
    pixel_values: _tensor_pb2.Tensor
    image_grid_thw: _tensor_pb2.Tensor
    def __init__(self, input_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., loss_mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., advantages: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., inference_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., temperatures: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., routed_experts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., policy_versions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., pixel_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., image_grid_thw: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PushBatchRequest(_message.Message):
    __slots__ = ("begin", "micro_batch")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    begin: BatchBegin
    micro_batch: MicroBatch
    def __init__(self, begin: _Optional[_Union[BatchBegin, _Mapping]] = ..., micro_batch: _Optional[_Union[MicroBatch, _Mapping]] = ...) -> None: ...

class PushBatchResponse(_message.Message):
    __slots__ = ("step", "num_micro_batches", "num_queued_batches")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_micro_batches: int
    num_queued_batches: int
    def __init__(self, step: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., num_queued_batches: _Optional[int] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "metrics", "finished_at", "policy_version")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    finished_at: _timestamp_pb2.Timestamp
    policy_version: int
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("mode", "step", "published_policy_version", "num_queued_batches", "training", "last_step", "last_checkpoint_step", "last_publish_error")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_PUBLISH_ERROR_FIELD_NUMBER: _ClassVar[int]
    mode: TrainingMode
    step: int
    published_policy_version: int
    num_queued_batches: int
    training: bool
    last_step: StepMetrics
    last_checkpoint_step: int
    last_publish_error: str
    def __init__(self, mode: _Optional[_Union[TrainingMode, str]] = ..., step: _Optional[int] = ..., published_policy_version: _Optional[int] = ..., num_queued_batches: _Optional[int] = ..., training: _Optional[bool] = ..., last_step: _Optional[_Union[StepMetrics, _Mapping]] = ..., last_checkpoint_step: _Optional[int] = ..., last_publish_error: _Optional[str] = ...) -> None: ...

class WatchStepsRequest(_message.Message):
    __slots__ = ("after_step", "run_id")
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    run_id: str
    def __init__(self, after_step: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class WatchStepsResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: StepMetrics
    def __init__(self, step: _Optional[_Union[StepMetrics, _Mapping]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("step", "path")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("lora_rank", "lora_alpha", "seed", "mode", "learning_rate", "weight_decay", "max_grad_norm", "warmup_steps")
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    lora_rank: int
    lora_alpha: float
    seed: int
    mode: TrainingMode
    learning_rate: float
    weight_decay: float
    max_grad_norm: float
    warmup_steps: int
    def __init__(self, lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., seed: _Optional[int] = ..., mode: _Optional[_Union[TrainingMode, str]] = ..., learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "owner", "spec", "state", "step", "next_step", "num_queued_batches", "published_policy_version", "last_checkpoint_step", "error", "created_at")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    owner: str
    spec: RunSpec
    state: RunState
    step: int
    next_step: int
    num_queued_batches: int
    published_policy_version: int
    last_checkpoint_step: int
    error: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, run_id: _Optional[str] = ..., owner: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., next_step: _Optional[int] = ..., num_queued_batches: _Optional[int] = ..., published_policy_version: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ..., error: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("run_id", "spec", "owner")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: RunSpec
    owner: str
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., owner: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ...) -> None: ...

class PauseRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class PauseRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ResumeRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ResumeRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DeleteRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DeleteRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
