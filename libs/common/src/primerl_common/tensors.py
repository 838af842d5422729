"""Tensor codec: torch tensors <-> `primerl.common.v1` `Tensor` and `TensorChunk` messages.

On the wire a tensor is a `TensorHeader` (name, dtype, shape, num_bytes) plus its raw bytes,
row-major, contiguous and little-endian. Small tensors travel whole in one `Tensor` message;
large ones as a stream of `TensorChunk`: a chunk with a header starts a tensor, and the data of
that chunk and the following ones fills it until `num_bytes` have arrived.

Copies: the sender makes one `bytes` per chunk (grpcio accepts nothing else); the receiver
copies each chunk once into a buffer preallocated from the header (or, with
`FileTensorAssembler`, writes it once to a file). A receiver that takes a method's requests
as bytes (no deserializer) can read a chunk with `parse_tensor_chunk`, its data a view of
the received bytes: protobuf's own parse copies the data, and reading the field copies it
again. Tensors are moved to CPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import BinaryIO

import numpy as np
import torch

from primerl.common.v1 import tensor_pb2

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FileTensorAssembler",
    "TensorAssembler",
    "TensorChunkView",
    "assemble_tensors",
    "assemble_tensors_async",
    "dtype_from_proto",
    "dtype_to_proto",
    "iter_tensor_chunks",
    "iter_wire_fields",
    "parse_tensor_chunk",
    "tensor_from_proto",
    "tensor_to_proto",
]

# Keep the server's and client's max message length above this plus a few bytes of header.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

_TORCH_TO_PROTO: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.float8_e4m3fn: tensor_pb2.DTYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: tensor_pb2.DTYPE_FLOAT8_E5M2,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.int16: tensor_pb2.DTYPE_INT16,
    torch.uint16: tensor_pb2.DTYPE_UINT16,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.uint32: tensor_pb2.DTYPE_UINT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.uint64: tensor_pb2.DTYPE_UINT64,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_PROTO_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_PROTO.items()}

# The wire is little-endian; on a big-endian host every multi-byte element is byte-swapped.
_NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The `Dtype` enum value of a torch dtype; ValueError if it has none."""
    try:
        return _TORCH_TO_PROTO[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}") from None


def dtype_from_proto(value: int) -> torch.dtype:
    """The torch dtype of a `Dtype` enum value; ValueError if it is unknown or unspecified."""
    try:
        return _PROTO_TO_TORCH[value]
    except KeyError:
        name = tensor_pb2.Dtype.Name(value) if value in tensor_pb2.Dtype.values() else str(value)
        raise ValueError(f"unsupported tensor dtype {name}") from None


def _swap_bytes(flat: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Reverse the bytes of each element of a flat uint8 tensor (a copy)."""
    return flat.view(-1, itemsize).flip(-1).reshape(-1)


def _wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (a copy only where needed) of `t`'s bytes in wire order."""
    t = t.detach().cpu().contiguous()
    # reshape(-1) first: a 0-d tensor cannot be viewed as a dtype of another size.
    flat = t.reshape(-1).view(torch.uint8)
    if not _NATIVE_LITTLE_ENDIAN and t.element_size() > 1:
        flat = _swap_bytes(flat, t.element_size())
    return flat


def _make_header(name: str, t: torch.Tensor) -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(
        name=name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape), num_bytes=t.numel() * t.element_size()
    )


def _parse_header(header: tensor_pb2.TensorHeader) -> tuple[torch.dtype, list[int]]:
    """Validate a header; return its dtype and shape."""
    try:
        dtype = dtype_from_proto(header.dtype)
    except ValueError as e:
        raise ValueError(f"tensor {header.name!r}: {e}") from None
    shape = list(header.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {header.name!r}: negative dimension in shape {shape}")
    expected = math.prod(shape) * dtype.itemsize
    if header.num_bytes != expected:
        raise ValueError(
            f"tensor {header.name!r}: num_bytes {header.num_bytes} != {expected} "
            f"(shape {shape}, {dtype}, {dtype.itemsize} bytes per element)"
        )
    return dtype, shape


def _check_bool(data: np.ndarray, name: str) -> None:
    """Refuse bool data (uint8) holding bytes other than 0 and 1."""
    if data.size and int(data.max()) > 1:
        raise ValueError(f"tensor {name!r}: bool data holds bytes other than 0 and 1")


def _buffer_to_tensor(buf: torch.Tensor, dtype: torch.dtype, shape: list[int], name: str) -> torch.Tensor:
    """Reinterpret a filled flat uint8 buffer of wire bytes as the tensor it carries."""
    if not _NATIVE_LITTLE_ENDIAN and dtype.itemsize > 1:
        buf = _swap_bytes(buf, dtype.itemsize)
    if dtype == torch.bool:
        _check_bool(buf.numpy(), name)
    return buf.view(dtype).reshape(shape)


def tensor_to_proto(t: torch.Tensor, name: str = "") -> tensor_pb2.Tensor:
    """A whole tensor in one `Tensor` message (meant for small tensors)."""
    return tensor_pb2.Tensor(header=_make_header(name, t), data=_wire_bytes(t).numpy().tobytes())


def tensor_from_proto(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """The tensor a `Tensor` message carries, in fresh, writable CPU memory."""
    dtype, shape = _parse_header(msg.header)
    if len(msg.data) != msg.header.num_bytes:
        raise ValueError(
            f"tensor {msg.header.name!r}: {len(msg.data)} data bytes, header announced {msg.header.num_bytes}"
        )
    buf = torch.empty(len(msg.data), dtype=torch.uint8)
    buf.numpy()[:] = np.frombuffer(msg.data, dtype=np.uint8)
    return _buffer_to_tensor(buf, dtype, shape, msg.header.name)


def iter_tensor_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tensor_pb2.TensorChunk]:
    """Stream tensors as `TensorChunk` messages of at most `chunk_bytes` data each.

    Each tensor's first chunk carries its header; an empty tensor is one chunk with no data.
    Tensors are read lazily, chunk by chunk: do not modify one until the stream has moved past it.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for name, t in named_tensors:
        header = _make_header(name, t)
        flat = _wire_bytes(t).numpy()
        if flat.size == 0:
            yield tensor_pb2.TensorChunk(header=header)
            continue
        for start in range(0, flat.size, chunk_bytes):
            data = flat[start : start + chunk_bytes].tobytes()
            yield tensor_pb2.TensorChunk(header=header if start == 0 else None, data=data)


@dataclasses.dataclass(frozen=True)
class TensorChunkView:
    """A `TensorChunk` whose data is a view of the bytes it was received in (no copy)."""

    header: tensor_pb2.TensorHeader | None
    data: bytes | memoryview

    @classmethod
    def of(cls, chunk: tensor_pb2.TensorChunk) -> TensorChunkView:
        return cls(chunk.header if chunk.HasField("header") else None, chunk.data)


_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_CHUNK_HEADER_FIELD = tensor_pb2.TensorChunk.DESCRIPTOR.fields_by_name["header"].number
_CHUNK_DATA_FIELD = tensor_pb2.TensorChunk.DESCRIPTOR.fields_by_name["data"].number


def _read_varint(buffer: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buffer) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buffer[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def iter_wire_fields(buffer: memoryview) -> Iterator[tuple[int, int, memoryview | None]]:
    """(field number, wire type, value) of each field of a serialized protobuf message, in
    order; the value of a length-delimited field is a view of `buffer` (no copy), that of
    the others None. ValueError on malformed input."""
    pos = 0
    while pos < len(buffer):
        key, pos = _read_varint(buffer, pos)
        number, wire_type = key >> 3, key & 7
        value = None
        if wire_type == _WIRE_VARINT:
            _, pos = _read_varint(buffer, pos)
        elif wire_type in (_WIRE_I64, _WIRE_I32):
            pos += 8 if wire_type == _WIRE_I64 else 4
        elif wire_type == _WIRE_LEN:
            length, pos = _read_varint(buffer, pos)
            value = buffer[pos : pos + length]
            pos += length
        else:
            raise ValueError(f"unsupported wire type {wire_type} (field {number})")
        if number == 0 or pos > len(buffer):
            raise ValueError("malformed or truncated message")
        yield number, wire_type, value


def parse_tensor_chunk(buffer: memoryview) -> TensorChunkView:
    """A serialized `TensorChunk` whose data stays in `buffer` (protobuf's parse copies it,
    and reading the field copies it again). Unknown fields are skipped, a repeated header
    merged, the last data kept, as protobuf does."""
    header, data = None, buffer[:0]
    for number, wire_type, value in iter_wire_fields(buffer):
        if wire_type != _WIRE_LEN:
            continue
        if number == _CHUNK_HEADER_FIELD:
            if header is None:
                header = tensor_pb2.TensorHeader()
            header.MergeFromString(value)
        elif number == _CHUNK_DATA_FIELD:
            data = value
    return TensorChunkView(header, data)


class TensorAssembler:
    """Rebuilds tensors from a stream of `TensorChunk` messages, fed one at a time.

    The header's num_bytes are allocated up front and each chunk is copied once into its slice.
    Call `finish()` when the stream ends to reject a truncated last tensor.
    """

    def __init__(self) -> None:
        self._header: tensor_pb2.TensorHeader | None = None
        self._dtype = torch.uint8
        self._shape: list[int] = []
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._num_received = 0

    @property
    def in_progress(self) -> bool:
        """Whether a tensor has started and not yet received all its bytes."""
        return self._header is not None

    def feed(self, chunk: tensor_pb2.TensorChunk | TensorChunkView) -> tuple[str, torch.Tensor] | None:
        """Consume one chunk; return `(name, tensor)` if it completed a tensor, else None."""
        # Read once: every read of a protobuf bytes field copies it.
        view = chunk if isinstance(chunk, TensorChunkView) else TensorChunkView.of(chunk)
        data = view.data
        if view.header is not None:
            if self._header is not None:
                raise ValueError(
                    f"tensor {self._header.name!r}: header of {view.header.name!r} arrived after only "
                    f"{self._num_received} of {self._header.num_bytes} bytes"
                )
            self._dtype, self._shape = _parse_header(view.header)
            self._header = tensor_pb2.TensorHeader()
            self._header.CopyFrom(view.header)
            self._start(self._header.num_bytes)
            self._num_received = 0
        elif self._header is None:
            raise ValueError(f"chunk of {len(data)} data bytes arrived with no tensor started (no header)")

        header = self._header
        end = self._num_received + len(data)
        if end > header.num_bytes:
            raise ValueError(f"tensor {header.name!r}: {end} bytes received, header announced {header.num_bytes}")
        self._store(self._num_received, data)
        self._num_received = end
        if end < header.num_bytes:
            return None
        self._header = None
        return header.name, self._complete(header.name)

    # Where the bytes go: fresh memory here, a file in FileTensorAssembler.

    def _start(self, num_bytes: int) -> None:
        self._buf = torch.empty(num_bytes, dtype=torch.uint8)

    def _store(self, start: int, data: bytes | memoryview) -> None:
        self._buf.numpy()[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def _complete(self, name: str) -> torch.Tensor:
        tensor = _buffer_to_tensor(self._buf, self._dtype, self._shape, name)
        self._buf = torch.empty(0, dtype=torch.uint8)
        return tensor

    def finish(self) -> None:
        """Check that the stream did not end in the middle of a tensor."""
        if self._header is not None:
            raise ValueError(
                f"tensor {self._header.name!r}: stream ended after {self._num_received} "
                f"of {self._header.num_bytes} bytes"
            )


class FileTensorAssembler(TensorAssembler):
    """A `TensorAssembler` that writes each chunk's bytes to `file` as it arrives (one copy;
    nothing is held in memory), each tensor starting at a multiple of `alignment`. `feed`
    returns the completed tensor on the meta device (its dtype and shape); its bytes lie in
    the file from `offsets[name]`, in native byte order."""

    def __init__(self, file: BinaryIO, *, alignment: int = 1) -> None:
        super().__init__()
        self._file = file
        self._alignment = alignment
        self.offsets: dict[str, int] = {}

    def _start(self, num_bytes: int) -> None:
        padding = -self._file.tell() % self._alignment
        if padding:
            self._file.write(bytes(padding))
        assert self._header is not None
        self.offsets[self._header.name] = self._file.tell()

    def _store(self, start: int, data: bytes | memoryview) -> None:
        if self._dtype == torch.bool:
            assert self._header is not None
            _check_bool(np.frombuffer(data, dtype=np.uint8), self._header.name)
        self._file.write(data)

    def _complete(self, name: str) -> torch.Tensor:
        itemsize, num_bytes = self._dtype.itemsize, math.prod(self._shape) * self._dtype.itemsize
        if not _NATIVE_LITTLE_ENDIAN and itemsize > 1 and num_bytes:  # swapped in place: an element may span chunks
            self._file.flush()
            offset = self.offsets[name]
            wire = torch.frombuffer(bytearray(os.pread(self._file.fileno(), num_bytes, offset)), dtype=torch.uint8)
            os.pwrite(self._file.fileno(), _swap_bytes(wire, itemsize).numpy().tobytes(), offset)
        return torch.empty(self._shape, dtype=self._dtype, device="meta")


def assemble_tensors(chunks: Iterable[tensor_pb2.TensorChunk]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` as each tensor of a chunk stream completes; raise if it ends truncated."""
    assembler = TensorAssembler()
    for chunk in chunks:
        if (item := assembler.feed(chunk)) is not None:
            yield item
    assembler.finish()


async def assemble_tensors_async(
    chunks: AsyncIterable[tensor_pb2.TensorChunk],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """`assemble_tensors` over an async stream, such as a grpc.aio request or response stream."""
    assembler = TensorAssembler()
    async for chunk in chunks:
        if (item := assembler.feed(chunk)) is not None:
            yield item
    assembler.finish()
