from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSealedStreamsRequest(_message.Message):
    __slots__ = ("method", "streams")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    method: str
    streams: int
    def __init__(self, method: _Optional[str] = ..., streams: _Optional[int] = ...) -> None: ...

class SealedSession(_message.Message):
    __slots__ = ("session_id", "key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    key: bytes
    def __init__(self, session_id: _Optional[str] = ..., key: _Optional[bytes] = ...) -> None: ...

class OpenSealedStreamsResponse(_message.Message):
    __slots__ = ("sessions", "port", "expires_in_s")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SealedSession]
    port: int
    expires_in_s: float
    def __init__(self, sessions: _Optional[_Iterable[_Union[SealedSession, _Mapping]]] = ..., port: _Optional[int] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class SealedStreamRequest(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...

class SealedStreamResponse(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...
