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
from collections.abc import Iterable, Iterator

import grpc
import torch

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.tensors import DEFAULT_CHUNK_BYTES, dtype_to_proto, iter_tensor_chunks

__all__ = ["UPDATE_WEIGHTS_METHOD", "serialized_update", "update_weights_call"]

UPDATE_WEIGHTS_METHOD = "/primerl.inference.v1.InferenceService/UpdateWeights"
_LENGTH_DELIMITED = 2
_CHUNK_TAG = bytes([2 << 3 | _LENGTH_DELIMITED])  # UpdateWeightsRequest.chunk
_DATA_TAG = bytes([2 << 3 | _LENGTH_DELIMITED])  # TensorChunk.data


def update_weights_call(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    """UpdateWeights taking already serialized requests (see `serialized_update`)."""
    return channel.stream_unary(
        UPDATE_WEIGHTS_METHOD,
        request_serializer=None,
        response_deserializer=inference_pb2.UpdateWeightsResponse.FromString,
    )


def serialized_update(
    begin: inference_pb2.WeightUpdateBegin,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[bytes]:
    """The serialized requests of an UpdateWeights stream: `begin`, then the tensors' chunks
    (lazily: each tensor is read while its chunks are sent)."""
    yield inference_pb2.UpdateWeightsRequest(begin=begin).SerializeToString()
    if sys.byteorder != "little":  # the wire is little-endian: let the codec swap the bytes
        for chunk in iter_tensor_chunks(named_tensors, chunk_bytes=chunk_bytes):
            yield inference_pb2.UpdateWeightsRequest(chunk=chunk).SerializeToString()
        return
    for name, tensor in named_tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header = tensor_pb2.TensorHeader(
            name=name, dtype=dtype_to_proto(tensor.dtype), shape=list(tensor.shape), num_bytes=flat.size
        )
        prefix = tensor_pb2.TensorChunk(header=header).SerializeToString()
        for start in range(0, max(flat.size, 1), chunk_bytes):
            data = memoryview(flat[start : start + chunk_bytes])
            data_field = [_DATA_TAG, _varint(len(data)), data] if len(data) else []
            inner = len(prefix) + sum(len(part) for part in data_field)
            yield b"".join([_CHUNK_TAG, _varint(inner), prefix, *data_field])
            prefix = b""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
