from google.protobuf import struct_pb2 as _struct_pb2
from primerl.common.v1 import generation_pb2 as _generation_pb2
from primerl.common.v1 import service_info_pb2 as _service_info_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_PAUSED: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_FAILED: RunState

class GetServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServiceInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _service_info_pb2.ServiceInfo
    def __init__(self, info: _Optional[_Union[_service_info_pb2.ServiceInfo, _Mapping]] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "data")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    data: _struct_pb2.Struct
    def __init__(self, task_id: _Optional[str] = ..., data: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("episode_id", "group_id", "environment", "task", "group_size", "index_in_group", "policy_version", "evaluation")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_IN_GROUP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    group_id: str
    environment: str
    task: Task
    group_size: int
    index_in_group: int
    policy_version: int
    evaluation: str
    def __init__(self, episode_id: _Optional[str] = ..., group_id: _Optional[str] = ..., environment: _Optional[str] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., group_size: _Optional[int] = ..., index_in_group: _Optional[int] = ..., policy_version: _Optional[int] = ..., evaluation: _Optional[str] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "builtin", "group_size", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    builtin: bool
    group_size: int
    weight: float
    def __init__(self, name: _Optional[str] = ..., builtin: _Optional[bool] = ..., group_size: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments",)
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ...) -> None: ...

class NextEpisodeRequest(_message.Message):
    __slots__ = ("environment",)
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    environment: str
    def __init__(self, environment: _Optional[str] = ...) -> None: ...

class NextEpisodeResponse(_message.Message):
    __slots__ = ("episode",)
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    episode: Episode
    def __init__(self, episode: _Optional[_Union[Episode, _Mapping]] = ...) -> None: ...

class StartEpisodeRequest(_message.Message):
    __slots__ = ("environment", "task", "num_episodes")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    NUM_EPISODES_FIELD_NUMBER: _ClassVar[int]
    environment: str
    task: Task
    num_episodes: int
    def __init__(self, environment: _Optional[str] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., num_episodes: _Optional[int] = ...) -> None: ...

class StartEpisodeResponse(_message.Message):
    __slots__ = ("episodes",)
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[Episode]
    def __init__(self, episodes: _Optional[_Iterable[_Union[Episode, _Mapping]]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImagePart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImagePart, _Mapping]] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "uri", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    uri: str
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., uri: _Optional[str] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("episode_id", "messages", "tokens", "sampling")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    messages: ChatMessages
    tokens: TokenIds
    sampling: _generation_pb2.SamplingParams
    def __init__(self, episode_id: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "num_prompt_tokens", "turn", "truncated", "first_policy_version", "last_policy_version", "tool_calls")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FIRST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generation_pb2.FinishReason
    num_prompt_tokens: int
    turn: int
    truncated: bool
    first_policy_version: int
    last_policy_version: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., turn: _Optional[int] = ..., truncated: _Optional[bool] = ..., first_policy_version: _Optional[int] = ..., last_policy_version: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class FinishEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "reward", "metrics", "discard")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    reward: float
    metrics: _containers.ScalarMap[str, float]
    discard: bool
    def __init__(self, episode_id: _Optional[str] = ..., reward: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., discard: _Optional[bool] = ...) -> None: ...

class FinishEpisodeResponse(_message.Message):
    __slots__ = ("group_complete", "num_samples")
    GROUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    group_complete: bool
    num_samples: int
    def __init__(self, group_complete: _Optional[bool] = ..., num_samples: _Optional[int] = ...) -> None: ...

class EnvironmentStats(_message.Message):
    __slots__ = ("name", "num_episodes_started", "num_episodes_finished", "num_episodes_running", "reward_mean", "reward_std", "num_dropped_off_policy", "num_errors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_EPISODES_STARTED_FIELD_NUMBER: _ClassVar[int]
    NUM_EPISODES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_EPISODES_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_OFF_POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_episodes_started: int
    num_episodes_finished: int
    num_episodes_running: int
    reward_mean: float
    reward_std: float
    num_dropped_off_policy: int
    num_errors: int
    def __init__(self, name: _Optional[str] = ..., num_episodes_started: _Optional[int] = ..., num_episodes_finished: _Optional[int] = ..., num_episodes_running: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., num_dropped_off_policy: _Optional[int] = ..., num_errors: _Optional[int] = ...) -> None: ...

class GroupCounts(_message.Message):
    __slots__ = ("finished", "filtered_equal_rewards", "incomplete", "episodes_timed_out", "batched")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_EQUAL_REWARDS_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    EPISODES_TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    finished: int
    filtered_equal_rewards: int
    incomplete: int
    episodes_timed_out: int
    batched: int
    def __init__(self, finished: _Optional[int] = ..., filtered_equal_rewards: _Optional[int] = ..., incomplete: _Optional[int] = ..., episodes_timed_out: _Optional[int] = ..., batched: _Optional[int] = ...) -> None: ...

class GetRunStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRunStatusResponse(_message.Message):
    __slots__ = ("state", "step", "max_steps", "policy_version", "max_async_level", "max_off_policy_steps", "num_dropped_off_policy_total", "off_policy_steps_mean", "off_policy_steps_max", "environments", "error", "groups")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_ASYNC_LEVEL_FIELD_NUMBER: _ClassVar[int]
    MAX_OFF_POLICY_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_OFF_POLICY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OFF_POLICY_STEPS_MEAN_FIELD_NUMBER: _ClassVar[int]
    OFF_POLICY_STEPS_MAX_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    step: int
    max_steps: int
    policy_version: int
    max_async_level: int
    max_off_policy_steps: int
    num_dropped_off_policy_total: int
    off_policy_steps_mean: float
    off_policy_steps_max: int
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentStats]
    error: str
    groups: GroupCounts
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., max_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., max_async_level: _Optional[int] = ..., max_off_policy_steps: _Optional[int] = ..., num_dropped_off_policy_total: _Optional[int] = ..., off_policy_steps_mean: _Optional[float] = ..., off_policy_steps_max: _Optional[int] = ..., environments: _Optional[_Iterable[_Union[EnvironmentStats, _Mapping]]] = ..., error: _Optional[str] = ..., groups: _Optional[_Union[GroupCounts, _Mapping]] = ...) -> None: ...

class PauseRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseRunResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class ResumeRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRunResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...
