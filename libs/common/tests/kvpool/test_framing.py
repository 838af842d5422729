"""primerl_common.kvpool.framing: data-only messages are the bytes protobuf writes, and put messages parse back."""

import pytest

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.kvpool.framing import data_frame, data_frames, data_view, parse_put_message
from primerl_common.kvpool.keys import BlockKey


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20])
def test_a_data_frame_is_the_message_protobuf_writes(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    frame = data_frame(data)
    assert frame == kvstore_pb2.GetBlocksResponse(data=data).SerializeToString() or size == 0
    assert kvstore_pb2.PutBlocksRequest.FromString(frame).data == data
    if size:
        assert bytes(data_view(frame)) == data
        assert parse_put_message(frame) == (None, frame)


def test_put_messages_with_a_header_are_parsed():
    header = kvstore_pb2.BlockHeader(key=BlockKey("tiny", 0, "v1", b"hash").to_proto(), num_bytes=3)
    message = kvstore_pb2.PutBlocksRequest(header=header, data=b"abc").SerializeToString()
    parsed, frame = parse_put_message(message)
    assert parsed == header and bytes(data_view(frame)) == b"abc"
    assert parse_put_message(kvstore_pb2.PutBlocksRequest(header=header).SerializeToString()) == (header, None)
    with pytest.raises(InvalidArgument):
        parse_put_message(b"\x0a\xff")


def test_data_frames_split_at_the_chunk_size():
    frames = list(data_frames(b"x" * 10, 4))
    assert [bytes(data_view(f)) for f in frames] == [b"xxxx", b"xxxx", b"xx"]
