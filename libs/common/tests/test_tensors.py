import asyncio
import math

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl_common import tensors
from primerl_common.tensors import (
    DEFAULT_CHUNK_BYTES,
    TensorAssembler,
    TensorChunkView,
    assemble_tensors,
    assemble_tensors_async,
    dtype_from_proto,
    dtype_to_proto,
    iter_tensor_chunks,
    parse_tensor_chunk,
    tensor_from_proto,
    tensor_to_proto,
)

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64]
INT_DTYPES = [
    torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64
]  # fmt: skip
ALL_DTYPES = [*FLOAT_DTYPES, *INT_DTYPES, torch.bool]


def sample(dtype: torch.dtype, numel: int = 64, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads, subnormals, ...) followed by the dtype's special values."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    rand = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype)
    if dtype in FLOAT_DTYPES:
        info = torch.finfo(dtype)
        values = [math.nan, math.inf, -math.inf, -0.0, 0.0, info.max, info.min, info.tiny, info.smallest_normal]
        special = torch.tensor(values, dtype=torch.float64).to(dtype)
    else:
        info = torch.iinfo(dtype)
        special = torch.tensor([info.min, info.max, 0, 1], dtype=dtype)
    return torch.cat([rand, special])


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.device.type == "cpu"
    assert torch.equal(raw(actual), raw(expected))


def roundtrip_stream(named, **kwargs) -> list[tuple[str, torch.Tensor]]:
    return list(assemble_tensors(iter_tensor_chunks(named, **kwargs)))


# ---- dtype mapping ----


def test_dtype_mapping_covers_every_enum_value():
    values = [v for v in tensor_pb2.Dtype.values() if v != tensor_pb2.DTYPE_UNSPECIFIED]
    assert sorted(dtype_to_proto(d) for d in ALL_DTYPES) == sorted(values)
    for dtype in ALL_DTYPES:
        assert dtype_from_proto(dtype_to_proto(dtype)) == dtype


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fnuz, torch.quint8], ids=str)
def test_unsupported_torch_dtype(dtype):
    with pytest.raises(ValueError, match=str(dtype)):
        dtype_to_proto(dtype)


def test_unsupported_tensor_dtype():
    with pytest.raises(ValueError, match=r"torch\.complex64"):
        tensor_to_proto(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"torch\.complex64"):
        list(iter_tensor_chunks([("c", torch.zeros(2, dtype=torch.complex64))]))


@pytest.mark.parametrize("value,name", [(tensor_pb2.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"), (99, "99")])
def test_unknown_proto_dtype(value, name):
    with pytest.raises(ValueError, match=name):
        dtype_from_proto(value)


# ---- round trips ----


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_inline_roundtrip(dtype):
    t = sample(dtype).reshape(-1)
    msg = tensor_to_proto(t, name="w")
    assert msg.header.name == "w"
    assert msg.header.dtype == dtype_to_proto(dtype)
    assert list(msg.header.shape) == list(t.shape)
    assert msg.header.num_bytes == len(msg.data) == t.numel() * dtype.itemsize
    assert_bit_equal(tensor_from_proto(msg), t)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_stream_roundtrip_many_chunks(dtype):
    t = sample(dtype, numel=3000, seed=1)
    t = t[: (t.numel() // 4) * 4].reshape(4, -1)
    chunks = list(iter_tensor_chunks([("layer.weight", t)], chunk_bytes=1000))
    num_bytes = t.numel() * dtype.itemsize
    assert len(chunks) == math.ceil(num_bytes / 1000)
    assert chunks[0].header.name == "layer.weight" and chunks[0].header.num_bytes == num_bytes
    assert not any(c.HasField("header") for c in chunks[1:])
    assert all(len(c.data) <= 1000 for c in chunks)
    [(name, out)] = assemble_tensors(chunks)
    assert name == "layer.weight"
    assert_bit_equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_chunk_boundaries_split_elements(dtype):
    t = sample(dtype, numel=101)
    [(_, out)] = roundtrip_stream([("x", t)], chunk_bytes=7)
    assert_bit_equal(out, t)


def test_large_tensor_default_chunking():
    t = torch.randn(10 * 1024 * 1024 // 4 + 3)  # just over 10 MiB of float32
    chunks = list(iter_tensor_chunks([("big", t)]))
    assert [len(c.data) for c in chunks] == [DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_BYTES, 2 * 1024 * 1024 + 12]
    [(_, out)] = assemble_tensors(chunks)
    assert_bit_equal(out, t)


def test_small_tensor_is_one_message_with_header():
    [chunk] = iter_tensor_chunks([("b", torch.arange(10))])
    assert chunk.header.name == "b" and len(chunk.data) == 80


def test_several_tensors_in_one_stream():
    named = [
        ("a", sample(torch.bfloat16, 691).reshape(10, 70)),
        ("empty", torch.empty(0, 3, dtype=torch.float16)),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("experts", torch.randint(0, 256, (5, 4, 8), dtype=torch.uint8)),
        ("fp8", sample(torch.float8_e4m3fn, 2048)),
        ("mask", torch.tensor([True, False, True])),
    ]
    out = roundtrip_stream(named, chunk_bytes=256)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, got), (_, want) in zip(out, named, strict=True):
        assert_bit_equal(got, want)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(30, 50).t(),
        lambda: sample(torch.bfloat16, 2000)[: 40 * 50].reshape(40, 50)[5:, ::3],
        lambda: torch.arange(6, dtype=torch.int32).expand(4, 6),
        lambda: torch.randn(4, 5, 6, dtype=torch.float64).permute(2, 0, 1),
    ],
    ids=["transposed", "sliced", "expanded", "permuted"],
)
def test_non_contiguous_input(make):
    t = make()
    assert not t.is_contiguous()
    assert_bit_equal(tensor_from_proto(tensor_to_proto(t)), t)
    [(_, out)] = roundtrip_stream([("t", t)], chunk_bytes=64)
    assert_bit_equal(out, t)
    assert out.is_contiguous()


def test_requires_grad_parameter():
    p = torch.nn.Parameter(torch.randn(3, 4))
    assert_bit_equal(tensor_from_proto(tensor_to_proto(p)), p.detach())
    [(_, out)] = roundtrip_stream([("p", p)])
    assert_bit_equal(out, p.detach())
    assert not out.requires_grad


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_scalar_and_empty(dtype):
    scalar = sample(dtype, numel=1)[:1].reshape(())
    for t in [scalar, torch.empty(0, dtype=dtype), torch.empty(3, 0, 2, dtype=dtype)]:
        msg = tensor_to_proto(t)
        assert list(msg.header.shape) == list(t.shape)
        assert_bit_equal(tensor_from_proto(msg), t)
        chunks = list(iter_tensor_chunks([("t", t)]))
        assert len(chunks) == 1 and chunks[0].header.num_bytes == t.numel() * dtype.itemsize
        [(_, out)] = assemble_tensors(chunks)
        assert_bit_equal(out, t)


def test_stream_survives_serialization():
    named = [("a", sample(torch.float32, 1000)), ("b", torch.empty(0, dtype=torch.int8)), ("c", torch.tensor(7))]
    wire = [c.SerializeToString() for c in iter_tensor_chunks(named, chunk_bytes=300)]
    out = list(assemble_tensors(tensor_pb2.TensorChunk.FromString(b) for b in wire))
    for (n_got, got), (n_want, want) in zip(out, named, strict=True):
        assert n_got == n_want
        assert_bit_equal(got, want)
    msg = tensor_pb2.Tensor.FromString(tensor_to_proto(named[0][1], "a").SerializeToString())
    assert_bit_equal(tensor_from_proto(msg), named[0][1])


def test_chunks_parse_as_views_of_their_bytes():
    named = [("a", sample(torch.float32, 1000)), ("b", torch.empty(0, dtype=torch.int8)), ("c", torch.tensor(7))]
    wire = [c.SerializeToString() for c in iter_tensor_chunks(named, chunk_bytes=300)]
    views = [parse_tensor_chunk(memoryview(b)) for b in wire]
    assert views == [TensorChunkView.of(tensor_pb2.TensorChunk.FromString(b)) for b in wire]
    assert all(isinstance(v.data, memoryview) and v.data.obj is b for v, b in zip(views, wire, strict=True))
    for (_, got), (_, want) in zip(assemble_tensors(views), named, strict=True):
        assert_bit_equal(got, want)

    # As protobuf parses it: unknown fields skipped, a repeated header merged, the last data kept.
    odd = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name="x"), data=b"old").SerializeToString()
    odd += bytes([7 << 3 | 0, 0x96, 0x01, 9 << 3 | 5, 1, 2, 3, 4])  # unknown varint and fixed32
    odd += tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(num_bytes=3), data=b"new").SerializeToString()
    assert parse_tensor_chunk(memoryview(odd)) == TensorChunkView.of(tensor_pb2.TensorChunk.FromString(odd))
    for malformed in (wire[0][:-1], b"\x12\xff", b"\x0f", b"\x00\x01"):
        with pytest.raises(ValueError):
            parse_tensor_chunk(memoryview(malformed))


def test_async_assembly():
    named = [("a", torch.randn(100, 3)), ("b", sample(torch.uint16, 5))]

    async def chunk_stream():
        for chunk in iter_tensor_chunks(named, chunk_bytes=100):
            await asyncio.sleep(0)
            yield chunk

    async def collect():
        return [item async for item in assemble_tensors_async(chunk_stream())]

    out = asyncio.run(collect())
    assert [n for n, _ in out] == ["a", "b"]
    for (_, got), (_, want) in zip(out, named, strict=True):
        assert_bit_equal(got, want)


def test_big_endian_host_swaps_bytes(monkeypatch):
    t = torch.tensor([1, 0x01020304], dtype=torch.int32)
    little = tensor_to_proto(t).data
    assert little == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    monkeypatch.setattr(tensors, "_NATIVE_LITTLE_ENDIAN", False)  # pretend native order is big-endian
    swapped = tensor_to_proto(t)
    assert swapped.data == b"\x00\x00\x00\x01\x01\x02\x03\x04"
    assert_bit_equal(tensor_from_proto(swapped), t)
    [(_, out)] = roundtrip_stream([("t", sample(torch.bfloat16, 50))], chunk_bytes=9)
    assert_bit_equal(out, sample(torch.bfloat16, 50))


# ---- memory ownership ----


def test_assembled_tensor_owns_its_memory():
    src = torch.arange(1000, dtype=torch.int32)
    chunks = list(iter_tensor_chunks([("a", src), ("b", src)], chunk_bytes=1000))
    src.fill_(-1)  # the messages hold copies, not views of the source
    assembler = TensorAssembler()
    results = [item for c in chunks if (item := assembler.feed(c)) is not None]
    assembler.finish()
    for c in chunks:  # mutating messages after feeding them must not reach the tensors
        c.data = b"\xff" * len(c.data)
        if c.HasField("header"):
            c.header.name = "changed"
    [(name_a, a), (name_b, b)] = results
    assert (name_a, name_b) == ("a", "b")
    expected = torch.arange(1000, dtype=torch.int32)
    assert torch.equal(a, expected) and torch.equal(b, expected)
    a.zero_()  # two tensors from one assembler do not share a buffer
    assert torch.equal(b, expected)


def test_inline_tensor_is_writable_and_independent():
    msg = tensor_to_proto(torch.arange(4, dtype=torch.int64))
    data = msg.data
    out = tensor_from_proto(msg)
    out.add_(10)
    assert msg.data == data
    msg.data = b"\x00" * len(data)
    assert torch.equal(out, torch.arange(10, 14))


# ---- validation ----


def header(name="t", dtype=tensor_pb2.DTYPE_FLOAT32, shape=(2, 3), num_bytes=24):
    return tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=list(shape), num_bytes=num_bytes)


@pytest.mark.parametrize(
    "bad,match",
    [
        (header(num_bytes=20), r"'t'.*num_bytes 20 != 24"),
        (header(dtype=tensor_pb2.DTYPE_BFLOAT16), r"'t'.*num_bytes 24 != 12"),
        (header(dtype=99), r"'t'.*unsupported tensor dtype 99"),
        (header(dtype=tensor_pb2.DTYPE_UNSPECIFIED), r"'t'.*DTYPE_UNSPECIFIED"),
        (header(shape=(-2, -3)), r"'t'.*negative dimension"),
    ],
)
def test_bad_header(bad, match):
    with pytest.raises(ValueError, match=match):
        TensorAssembler().feed(tensor_pb2.TensorChunk(header=bad, data=b"\x00" * 24))
    with pytest.raises(ValueError, match=match):
        tensor_from_proto(tensor_pb2.Tensor(header=bad, data=b"\x00" * 24))


def test_inline_data_length_mismatch():
    with pytest.raises(ValueError, match=r"'t': 23 data bytes, header announced 24"):
        tensor_from_proto(tensor_pb2.Tensor(header=header(), data=b"\x00" * 23))


def test_data_before_any_header():
    with pytest.raises(ValueError, match="no header"):
        TensorAssembler().feed(tensor_pb2.TensorChunk(data=b"\x00" * 4))


def test_data_after_tensor_completed_without_new_header():
    assembler = TensorAssembler()
    assert assembler.feed(tensor_pb2.TensorChunk(header=header(), data=b"\x00" * 24)) is not None
    with pytest.raises(ValueError, match="no header"):
        assembler.feed(tensor_pb2.TensorChunk(data=b"\x00"))


def test_more_bytes_than_announced():
    with pytest.raises(ValueError, match=r"'t': 25 bytes received, header announced 24"):
        TensorAssembler().feed(tensor_pb2.TensorChunk(header=header(), data=b"\x00" * 25))
    assembler = TensorAssembler()
    assembler.feed(tensor_pb2.TensorChunk(header=header(), data=b"\x00" * 20))
    with pytest.raises(ValueError, match=r"'t': 28 bytes received, header announced 24"):
        assembler.feed(tensor_pb2.TensorChunk(data=b"\x00" * 8))


def test_new_header_before_previous_complete():
    assembler = TensorAssembler()
    assert assembler.feed(tensor_pb2.TensorChunk(header=header(), data=b"\x00" * 10)) is None
    assert assembler.in_progress
    with pytest.raises(ValueError, match=r"'t': header of 'u' arrived after only 10 of 24 bytes"):
        assembler.feed(tensor_pb2.TensorChunk(header=header(name="u"), data=b"\x00" * 24))


def test_incomplete_stream():
    assembler = TensorAssembler()
    assembler.finish()  # nothing started: fine
    assembler.feed(tensor_pb2.TensorChunk(header=header(), data=b"\x00" * 10))
    with pytest.raises(ValueError, match=r"'t': stream ended after 10 of 24 bytes"):
        assembler.finish()
    chunks = list(iter_tensor_chunks([("w", torch.zeros(100))], chunk_bytes=64))
    with pytest.raises(ValueError, match=r"'w': stream ended after 384 of 400 bytes"):
        list(assemble_tensors(chunks[:-1]))


def test_invalid_bool_bytes():
    bad = header(dtype=tensor_pb2.DTYPE_BOOL, shape=(3,), num_bytes=3)
    with pytest.raises(ValueError, match=r"'t': bool data"):
        tensor_from_proto(tensor_pb2.Tensor(header=bad, data=b"\x00\x01\x02"))


@pytest.mark.parametrize("chunk_bytes", [0, -1])
def test_bad_chunk_bytes(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(iter_tensor_chunks([("t", torch.zeros(2))], chunk_bytes=chunk_bytes))


def test_public_names():
    assert all(hasattr(tensors, name) for name in tensors.__all__)
