"""Blocks on the PutBlocks / GetBlocks streams as raw bytes.

`PutBlocksRequest` and `GetBlocksResponse` share their wire layout (header = 1, data = 2),
so a put message that carries only data (`0x12 <varint len> <bytes>`) is exactly the
`GetBlocksResponse` that serves those bytes back; block streams are built and read as raw
bytes, with no protobuf copy of the data.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument

__all__ = [
    "DATA_TAG",
    "FetchedBlock",
    "data_frame",
    "data_frames",
    "data_view",
    "iter_put_messages",
    "parse_put_message",
    "read_block_stream",
    "stamped_header",
    "varint",
]

DATA_TAG = 0x12  # field 2 (data), length-delimited


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes | bytearray, pos: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) when the buffer ends inside it."""
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def data_frame(data: bytes | memoryview) -> bytes:
    """A message that carries only `data` (a PutBlocksRequest or a GetBlocksResponse)."""
    return b"".join((bytes((DATA_TAG,)), varint(len(data)), data))


def data_frames(data: bytes | memoryview, chunk_bytes: int) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield data_frame(view[start : start + chunk_bytes])


def _data_offset(frame: bytes | bytearray) -> int:
    """Where the data of a data-only message starts; -1 if `frame` is not one."""
    if not frame or frame[0] != DATA_TAG:
        return -1
    length, pos = _read_varint(frame, 1)
    return pos if length >= 0 and pos + length == len(frame) else -1


def data_view(frame: bytes | bytearray) -> memoryview:
    """The data bytes of a data-only message (no copy)."""
    offset = _data_offset(frame)
    assert offset >= 0, "not a data-only message"
    return memoryview(frame)[offset:]


def parse_put_message(message: bytes) -> tuple[kvstore_pb2.BlockHeader | None, bytes | None]:
    """(header or None, data frame or None) of one raw PutBlocksRequest."""
    if _data_offset(message) >= 0:
        return None, message
    try:
        request = kvstore_pb2.PutBlocksRequest.FromString(message)
    except Exception:  # protobuf's DecodeError and friends
        raise InvalidArgument("not a PutBlocksRequest message", field="request") from None
    header = request.header if request.HasField("header") else None
    return header, data_frame(request.data) if request.data else None


def stamped_header(header: kvstore_pb2.BlockHeader, num_bytes: int) -> kvstore_pb2.BlockHeader:
    stamped = kvstore_pb2.BlockHeader()
    stamped.CopyFrom(header)
    stamped.num_bytes = num_bytes
    return stamped


def iter_put_messages(
    blocks: Sequence[tuple[kvstore_pb2.BlockHeader, bytes | bytearray | memoryview]], chunk_bytes: int
) -> Iterator[bytes]:
    """Raw PutBlocksRequest messages: each block's header alone, then its data in chunks."""
    for header, data in blocks:
        yield kvstore_pb2.PutBlocksRequest(header=stamped_header(header, len(data))).SerializeToString()
        yield from data_frames(data, chunk_bytes)


@dataclass
class FetchedBlock:
    header: kvstore_pb2.BlockHeader
    data: bytearray | None  # None when not found

    @property
    def found(self) -> bool:
        return self.header.found


async def read_block_stream(stream: AsyncIterator[bytes]) -> list[FetchedBlock]:
    """Reassembles a raw GetBlocks answer."""
    blocks: list[FetchedBlock] = []
    offset = 0
    async for message in stream:
        header, frame = parse_put_message(message)  # same layout as a put message
        if header is not None:
            data = bytearray(header.num_bytes) if header.found else None
            blocks.append(FetchedBlock(header, data))
            offset = 0
        if frame is not None:
            piece = data_view(frame)
            target = blocks[-1].data
            if target is None or offset + len(piece) > len(target):
                raise ValueError("GetBlocks answer has more data than its header announced")
            target[offset : offset + len(piece)] = piece
            offset += len(piece)
    return blocks
