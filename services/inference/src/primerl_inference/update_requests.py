"""UpdateWeights requests as the service takes them: serialized, with each chunk's data read from
the bytes it came in rather than copied by protobuf's parse (and again when the field is read).
Free of vLLM, so that what reads them can be measured and tested without an engine
(bench/tls_overhead.py's push sink serves UpdateWeights exactly so)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.errors import InvalidArgument
from primerl_common.tensors import TensorChunkView, iter_wire_fields, parse_tensor_chunk

__all__ = ["add_inference_service", "parse_update_request"]

_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
_CHUNK_FIELD = inference_pb2.UpdateWeightsRequest.DESCRIPTOR.fields_by_name["chunk"].number
_LENGTH_DELIMITED = 2  # protobuf's wire type of a message or bytes field


def parse_update_request(raw: bytes) -> inference_pb2.UpdateWeightsRequest | TensorChunkView:
    """A serialized UpdateWeightsRequest: one that holds a chunk alone (all but the first of a
    stream) as a view of `raw`, its data not copied (protobuf's parse would copy it, and
    reading the field again); any other as protobuf parses it."""
    try:
        fields = list(iter_wire_fields(memoryview(raw)))
        if len(fields) == 1 and fields[0][:2] == (_CHUNK_FIELD, _LENGTH_DELIMITED):
            return parse_tensor_chunk(fields[0][2])
        return inference_pb2.UpdateWeightsRequest.FromString(raw)
    except (ValueError, DecodeError) as exc:
        raise InvalidArgument(f"not a serialized UpdateWeightsRequest: {exc}", field="chunk") from None


def add_inference_service(servicer: Any, server: grpc.aio.Server) -> None:
    """The InferenceService of `servicer`, its UpdateWeights registered with no request
    deserializer: its requests arrive as bytes (for parse_update_request). A later registration
    of a method replaces the earlier one."""
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    handler = grpc.stream_unary_rpc_method_handler(
        servicer.UpdateWeights, response_serializer=inference_pb2.UpdateWeightsResponse.SerializeToString
    )
    server.add_registered_method_handlers(_SERVICE.full_name, {"UpdateWeights": handler})
