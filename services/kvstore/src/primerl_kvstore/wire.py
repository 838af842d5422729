"""How blocks travel and sit in DRAM: as ready-to-send messages.

`PutBlocksRequest` and `GetBlocksResponse` share their wire layout (header = 1,
data = 2), so a put message that carries only data (`0x12 <varint len> <bytes>`)
is exactly the `GetBlocksResponse` that serves those bytes back (the framing itself
is shared with the pool's clients, in primerl_common.kvpool.framing). The servicer
handles PutBlocks and GetBlocks with raw bytes (no protobuf parsing or
serializing of the data): a data message is kept as it arrived and written back
as it is, so the bytes are copied only by gRPC itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from primerl.common.v1 import tensor_pb2
from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.kvpool.framing import data_view
from primerl_common.kvpool.keys import BlockKey

__all__ = [
    "Block",
    "check_put_header",
    "header_frame",
    "validate_routed_experts",
]

_ROUTED_EXPERT_DTYPES = {tensor_pb2.DTYPE_UINT8: 1, tensor_pb2.DTYPE_UINT16: 2}


def header_frame(header: kvstore_pb2.BlockHeader) -> bytes:
    return kvstore_pb2.GetBlocksResponse(header=header).SerializeToString()


def validate_routed_experts(tensor: tensor_pb2.Tensor, field_name: str) -> None:
    """Routed experts are [tokens, layers, top_k] of uint8 or uint16, whole in the message."""
    header = tensor.header
    if header.dtype not in _ROUTED_EXPERT_DTYPES:
        raise InvalidArgument("dtype must be DTYPE_UINT8 or DTYPE_UINT16", field=f"{field_name}.header.dtype")
    if len(header.shape) != 3 or any(d < 0 for d in header.shape):
        raise InvalidArgument(
            f"shape {list(header.shape)} is not [tokens, layers, top_k]", field=f"{field_name}.header.shape"
        )
    expected = math.prod(header.shape) * _ROUTED_EXPERT_DTYPES[header.dtype]
    if header.num_bytes != expected or len(tensor.data) != expected:
        raise InvalidArgument(
            f"{len(tensor.data)} data bytes, header says {header.num_bytes}, shape needs {expected}",
            field=f"{field_name}.data",
        )


def check_put_header(header: kvstore_pb2.BlockHeader, index: int, dram_capacity_bytes: int) -> BlockKey:
    """The key of a block header a client puts; InvalidArgument naming the bad field."""
    where = f"block {index} of the stream: "
    if not header.HasField("key"):
        raise InvalidArgument(where + "missing", field="header.key")
    try:
        key = BlockKey.from_proto(header.key, "header.key")
        if header.HasField("routed_experts"):
            validate_routed_experts(header.routed_experts, "header.routed_experts")
    except InvalidArgument as exc:
        raise InvalidArgument(where + exc.description, field=exc.field) from None
    if header.num_bytes == 0:
        raise InvalidArgument(where + "must be positive", field="header.num_bytes")
    if header.num_bytes > dram_capacity_bytes:
        raise InvalidArgument(
            where + f"{header.num_bytes} bytes is more than this node's DRAM segment ({dram_capacity_bytes})",
            field="header.num_bytes",
        )
    if header.found:
        raise InvalidArgument(where + "is set only in GetBlocks answers", field="header.found")
    return key


@dataclass(eq=False)
class Block:
    """One stored block: its header (found = true, no data) and its bytes as data messages
    (bytearray when it came through the bulk channel)."""

    key: BlockKey
    header: kvstore_pb2.BlockHeader
    frames: list[bytes | bytearray] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return self.header.num_bytes

    def header_frame(self) -> bytes:
        return header_frame(self.header)

    def data_views(self) -> Iterator[memoryview]:
        for frame in self.frames:
            yield data_view(frame)
