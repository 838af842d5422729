from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[Dtype]
    DTYPE_FLOAT8_E5M2: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_INT16: _ClassVar[Dtype]
    DTYPE_UINT16: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_UINT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_UINT64: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]

class WeightFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_FORMAT_UNSPECIFIED: _ClassVar[WeightFormat]
    WEIGHT_FORMAT_HF: _ClassVar[WeightFormat]
    WEIGHT_FORMAT_KERNEL: _ClassVar[WeightFormat]
    WEIGHT_FORMAT_KERNEL_FP8: _ClassVar[WeightFormat]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_FLOAT8_E4M3FN: Dtype
DTYPE_FLOAT8_E5M2: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_INT8: Dtype
DTYPE_UINT8: Dtype
DTYPE_INT16: Dtype
DTYPE_UINT16: Dtype
DTYPE_INT32: Dtype
DTYPE_UINT32: Dtype
DTYPE_INT64: Dtype
DTYPE_UINT64: Dtype
DTYPE_BOOL: Dtype
WEIGHT_FORMAT_UNSPECIFIED: WeightFormat
WEIGHT_FORMAT_HF: WeightFormat
WEIGHT_FORMAT_KERNEL: WeightFormat
WEIGHT_FORMAT_KERNEL_FP8: WeightFormat

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "num_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
