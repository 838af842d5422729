"""UpdateWeights request streams serialized by hand: one copy of each tensor byte.

Building `UpdateWeightsRequest(chunk=TensorChunk(data=...))` and serializing it copies every
chunk three or four times in Python protobuf (the `bytes` field, the submessage copy, the
serialization): measured ~8x slower than this on the project's 2-core box. Here each
message's bytes are one `b"".join` of a small protobuf-serialized prefix and a view of the
tensor's memory; the channel sends them as they are (a method with no serializer).

The wire format is protobuf's: UpdateWeightsRequest.chunk is field 2 (a message), and in
it TensorChunk.header is field 1 and TensorChunk.data field 2; both length-delimited.
Tensors travel as `primerl_common.tensors` defines (header, then raw little-endian bytes).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Iterator

import grpc
import numpy as np
import torch

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.tensors import DEFAULT_CHUNK_BYTES, dtype_to_proto, iter_tensor_chunks

__all__ = ["UPDATE_WEIGHTS_METHOD", "SharedSerializer", "update_weights_call"]

UPDATE_WEIGHTS_METHOD = "/primerl.inference.v1.InferenceService/UpdateWeights"
_LENGTH_DELIMITED = 2
_CHUNK_TAG = bytes([2 << 3 | _LENGTH_DELIMITED])  # UpdateWeightsRequest.chunk
_DATA_TAG = bytes([2 << 3 | _LENGTH_DELIMITED])  # TensorChunk.data
# Serialized chunks the pushes of one update share, at most (a few MiB each).
_WINDOW_CHUNKS = 8


def update_weights_call(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    """UpdateWeights taking already serialized requests (see `SharedSerializer.update`)."""
    return channel.stream_unary(
        UPDATE_WEIGHTS_METHOD,
        request_serializer=None,
        response_deserializer=inference_pb2.UpdateWeightsResponse.FromString,
    )


class SharedSerializer:
    """Serializes the chunks of an update once for all the pushes that send the same tensors
    at the same time (the replicas of one format, pushed together after a publish): the
    first push to reach a chunk serializes it and keeps it for the others until every push
    has passed it, `window` chunks at most (a push far behind serializes its own)."""

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, window: int = _WINDOW_CHUNKS) -> None:
        self._chunk_bytes = chunk_bytes
        self._window = window
        self._streams: dict[Hashable, _SharedChunks] = {}

    def update(
        self, key: Hashable, begin: inference_pb2.WeightUpdateBegin, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[bytes]:
        """The serialized requests of an UpdateWeights stream: `begin`, then the tensors' chunks
        (lazily: each chunk is serialized as it is sent, or taken from another stream of the
        same `key`, which must stand for the same tensors: e.g. version, format, base)."""
        yield inference_pb2.UpdateWeightsRequest(begin=begin).SerializeToString()
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _SharedChunks(_ChunkPlan(named_tensors, self._chunk_bytes), self._window)
        reader = object()
        try:
            yield from stream.read(reader)
        finally:
            if stream.close(reader) and self._streams.get(key) is stream:
                del self._streams[key]

    @property
    def num_kept(self) -> int:
        """Serialized chunks held now, over all updates."""
        return sum(len(stream.kept) for stream in self._streams.values())


class _Chunk:
    def __init__(self, prefix: bytes, data: np.ndarray) -> None:
        self.prefix = prefix
        self.data = data

    def serialize(self) -> bytes:
        data = memoryview(self.data)
        data_field = [_DATA_TAG, _varint(len(data)), data] if len(data) else []
        inner = len(self.prefix) + sum(len(part) for part in data_field)
        return b"".join([_CHUNK_TAG, _varint(inner), self.prefix, *data_field])


class _ChunkPlan:
    """Where each chunk of a tensor list lies (views of the tensors' memory, nothing copied)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int) -> None:
        if sys.byteorder != "little":  # the wire is little-endian: let the codec swap the bytes
            self.chunks: list[_Chunk | _Serialized] = [
                _Serialized(inference_pb2.UpdateWeightsRequest(chunk=chunk).SerializeToString())
                for chunk in iter_tensor_chunks(named_tensors, chunk_bytes=chunk_bytes)
            ]
            return
        self.chunks = []
        for name, tensor in named_tensors:
            flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            header = tensor_pb2.TensorHeader(
                name=name, dtype=dtype_to_proto(tensor.dtype), shape=list(tensor.shape), num_bytes=flat.size
            )
            prefix = tensor_pb2.TensorChunk(header=header).SerializeToString()
            for start in range(0, max(flat.size, 1), chunk_bytes):
                self.chunks.append(_Chunk(prefix, flat[start : start + chunk_bytes]))
                prefix = b""


class _Serialized:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return self.data


class _SharedChunks:
    def __init__(self, plan: _ChunkPlan, window: int) -> None:
        self._plan = plan
        self._window = window
        self.kept: dict[int, bytes] = {}
        self._positions: dict[object, int] = {}  # reader -> index of the next chunk it reads

    def read(self, reader: object) -> Iterator[bytes]:
        self._positions[reader] = 0
        for index, chunk in enumerate(self._plan.chunks):
            data = self.kept.get(index)
            if data is None:
                data = chunk.serialize()
                if len(self._positions) > 1 and len(self.kept) < self._window:
                    self.kept[index] = data
            self._positions[reader] = index + 1
            self._forget_passed()
            yield data

    def close(self, reader: object) -> bool:
        """Ends `reader`; True when no reader is left."""
        self._positions.pop(reader, None)
        self._forget_passed()
        return not self._positions

    def _forget_passed(self) -> None:
        lowest = min(self._positions.values(), default=len(self._plan.chunks))
        for index in [index for index in self.kept if index < lowest]:
            del self.kept[index]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
