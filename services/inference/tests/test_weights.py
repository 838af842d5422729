"""WeightTable, WeightStaging and stage_shared_folder: every malformed update (a stream, or a
folder on a shared filesystem) is refused before any engine sees it, naming the field; a good
one is indexed in files the engine process can map."""

import os
import pathlib

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.weights.manifest import write_weights
from primerl_inference.weights import WeightStaging, WeightTable, WeightUpdate, stage_shared_folder
from primerl_inference.worker_extension import _map_staged_tensors

from .serving import checkpoint, tiny_model


@pytest.fixture(scope="module")
def tensors(model_root: pathlib.Path) -> dict[str, torch.Tensor]:
    return checkpoint(tiny_model(model_root, "moe"))


@pytest.fixture(scope="module")
def table(model_root: pathlib.Path) -> WeightTable:
    return WeightTable.from_checkpoint(tiny_model(model_root, "moe"), torch.float32)


def update_of(tensors: dict[str, torch.Tensor], **begin: object) -> WeightUpdate:
    """The `begin` of an HF update carrying `tensors` (version 1) unless `begin` says otherwise."""
    fields = {
        "policy_version": 1,
        "format": "hf",
        "num_tensors": len(tensors),
        "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        **begin,
    }
    return WeightUpdate(**fields)  # type: ignore[arg-type]


def staging(
    table: WeightTable, tmp_path: pathlib.Path, tensors: dict[str, torch.Tensor], **begin: object
) -> WeightStaging:
    return WeightStaging(table, tmp_path, update_of(tensors, **begin))


async def stage(staging: WeightStaging, tensors: dict[str, torch.Tensor], chunk_bytes: int = 100_000) -> None:
    for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=chunk_bytes):
        await staging.feed(chunk)


def test_table_holds_the_checkpoint_names_and_shapes(table: WeightTable, tensors: dict[str, torch.Tensor]) -> None:
    assert table.shapes == {name: tuple(t.shape) for name, t in tensors.items()}
    assert table.shapes["model.layers.0.mlp.experts.7.down_proj.weight"] == (256, 128)
    assert set(table.dtypes.values()) == {frozenset({torch.float32})}
    assert table.modules["model.layers.0.self_attn.qkv_proj"] == {
        f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k", "v")
    }
    assert len(table.modules["model.layers.0.mlp.experts"]) == 8 * 3


async def test_tensors_come_in_the_checkpoint_or_the_served_dtype(
    model_root: pathlib.Path, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    # A float32 checkpoint served in bfloat16 (vLLM's "auto" does that): a trainer publishing
    # its float32 weights and a broadcaster sending bfloat16 are both understood.
    table = WeightTable.from_checkpoint(tiny_model(model_root, "moe"), torch.bfloat16)
    mixed = {name: t.bfloat16() if i % 2 else t for i, (name, t) in enumerate(tensors.items())}

    with staging(table, tmp_path, mixed) as receiver:
        await stage(receiver, mixed)
        staged = receiver.finish()
        mapped = dict(_map_staged_tensors(staged.index()))
        assert all(torch.equal(mapped[name], t) and mapped[name].dtype == t.dtype for name, t in mixed.items())
    half = header_of("model.norm.weight", tensors["model.norm.weight"].half())
    with staging(table, tmp_path, tensors) as receiver, pytest.raises(InvalidArgument, match=r"BFLOAT16 or DTYPE_F"):
        await receiver.feed(half)


async def test_a_full_update_is_staged_for_the_engine(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    with staging(table, tmp_path, tensors) as receiver:
        await stage(receiver, tensors)
        staged = receiver.finish()

        mapped = dict(_map_staged_tensors(staged.index()))

        assert mapped.keys() == tensors.keys()
        assert all(torch.equal(mapped[name], t) for name, t in tensors.items())
        assert all(t.offset % 64 == 0 for t in staged.tensors)
        assert staged.num_bytes == sum(t.numel() * 4 for t in tensors.values())
    assert not os.listdir(tmp_path)  # the staging file has no name there

    # The next update writes over the last complete one's file.
    with staging(table, tmp_path, tensors) as receiver:
        await stage(receiver, tensors)
        mapped = dict(_map_staged_tensors(receiver.finish().index()))
        assert all(torch.equal(mapped[name], t) for name, t in tensors.items())


def header_of(name: str, t: torch.Tensor) -> tensor_pb2.TensorChunk:
    return next(iter_tensor_chunks([(name, t)]))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda ts: {"model.layers.9.mlp.gate.weight": ts.popitem()[1], **ts}, "chunk.header.name"),
        (lambda ts: {**ts, "model.norm.weight": torch.zeros(255)}, "chunk.header.shape"),
        (lambda ts: {**ts, "model.norm.weight": ts["model.norm.weight"].bfloat16()}, "chunk.header.dtype"),
    ],
    ids=["unknown-name", "wrong-shape", "wrong-dtype"],
)
async def test_a_bad_tensor_is_refused_at_its_header(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path, change, field: str
) -> None:
    bad = change(dict(tensors))

    with staging(table, tmp_path, bad) as receiver, pytest.raises(InvalidArgument) as error:
        await stage(receiver, bad)

    assert error.value.field == field
    assert not os.listdir(tmp_path)


async def test_byte_counts_that_do_not_add_up_are_refused(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    name = "model.norm.weight"
    chunk = header_of(name, tensors[name])
    chunk.header.num_bytes += 4  # disagrees with its shape and dtype
    with staging(table, tmp_path, tensors) as receiver, pytest.raises(InvalidArgument) as error:
        await receiver.feed(chunk)
    assert error.value.field == "chunk"

    overlong = header_of(name, tensors[name])
    overlong.data += b"\0\0\0\0"  # more data than the header announced
    with staging(table, tmp_path, tensors) as receiver, pytest.raises(InvalidArgument, match="bytes received"):
        await receiver.feed(overlong)


async def test_a_truncated_stream_is_refused(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    # The embedding (320 x 256 float32) spans several chunks: cut it short.
    embedding = "model.embed_tokens.weight"
    ordered = {**{n: t for n, t in tensors.items() if n != embedding}, embedding: tensors[embedding]}
    chunks = list(iter_tensor_chunks(ordered.items(), chunk_bytes=100_000))

    with staging(table, tmp_path, tensors) as receiver:
        for chunk in chunks[:-1]:
            await receiver.feed(chunk)
        with pytest.raises(InvalidArgument, match="stream ended after"):
            receiver.finish()


async def test_a_full_update_needs_every_tensor_once(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    partial = dict(list(tensors.items())[:-1])
    with staging(table, tmp_path, partial) as receiver:
        await stage(receiver, partial)
        with pytest.raises(InvalidArgument, match=r"missing 'model\.norm\.weight'"):
            receiver.finish()

    name, t = next(iter(tensors.items()))
    with staging(table, tmp_path, tensors) as receiver:
        await stage(receiver, {name: t})
        with pytest.raises(InvalidArgument, match="appears twice"):
            await receiver.feed(header_of(name, t))


async def test_counts_must_match_begin(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    with staging(table, tmp_path, tensors, num_tensors=len(tensors) - 1) as receiver:
        with pytest.raises(InvalidArgument) as error:
            await stage(receiver, tensors)
        assert error.value.field == "begin.num_tensors"

    with staging(table, tmp_path, tensors, num_tensors=len(tensors) + 1) as receiver:
        await stage(receiver, tensors)
        with pytest.raises(InvalidArgument) as error:
            receiver.finish()
        assert error.value.field == "begin.num_tensors"

    num_bytes = sum(t.numel() * 4 for t in tensors.values())
    with staging(table, tmp_path, tensors, num_bytes=num_bytes + 4) as receiver:
        await stage(receiver, tensors)
        with pytest.raises(InvalidArgument) as error:
            receiver.finish()
        assert error.value.field == "begin.num_bytes"


async def test_a_delta_carries_whole_modules(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    attention = {n: t for n, t in tensors.items() if n.startswith("model.layers.0.self_attn.")}
    experts = {n: t for n, t in tensors.items() if n.startswith("model.layers.2.mlp.experts.")}
    one_expert = {n: t for n, t in experts.items() if ".experts.3." in n}

    with staging(table, tmp_path, {**attention, **experts}, delta=True) as receiver:
        await stage(receiver, {**attention, **experts})
        staged = receiver.finish()
        assert staged.modules == (
            "model.layers.0.self_attn.k_norm",
            "model.layers.0.self_attn.o_proj",
            "model.layers.0.self_attn.q_norm",
            "model.layers.0.self_attn.qkv_proj",
            "model.layers.2.mlp.experts",
        )
    q_only = {n: t for n, t in attention.items() if ".k_proj." not in n and ".v_proj." not in n}
    for part, lacking in [(q_only, "model.layers.0.self_attn.k_proj.weight"), (one_expert, "experts.0.down_proj")]:
        with staging(table, tmp_path, part, delta=True) as receiver:
            await stage(receiver, part)
            with pytest.raises(InvalidArgument, match=f"whole modules; .* lacks .*{lacking}") as error:
                receiver.finish()
            assert error.value.field == "chunk"


def test_a_shared_folder_is_checked_like_a_stream(
    table: WeightTable, tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
) -> None:
    hf = tensor_pb2.WEIGHT_FORMAT_HF
    write_weights(tmp_path / "v1", tensors.items(), policy_version=1, weight_format=hf, max_file_bytes=2**20)
    update = update_of(tensors, shared_fs_path=str(tmp_path / "v1"))

    staged = stage_shared_folder(table, update)
    mapped = dict(_map_staged_tensors(staged.index()))

    assert len({t.file for t in staged.tensors}) > 1  # several files
    assert mapped.keys() == tensors.keys() and all(torch.equal(mapped[n], t) for n, t in tensors.items())
    bad_folders = {
        "unknown": {**tensors, "lm_head.weight": tensors["model.norm.weight"]},
        "shape": {**tensors, "model.norm.weight": torch.zeros(255)},
        "partial": dict(list(tensors.items())[1:]),
    }
    for name, bad in bad_folders.items():
        write_weights(tmp_path / name, bad.items(), policy_version=1, weight_format=hf)
    cases = {
        "version": (tmp_path / "v1", {"policy_version": 2}, "begin.policy_version"),
        "format": (tmp_path / "v1", {"format": "kernel"}, "begin.format"),
        "delta": (tmp_path / "v1", {"delta": True}, "begin.delta"),
        "tensor count": (tmp_path / "v1", {"num_tensors": len(tensors) - 1}, "begin.num_tensors"),
        "byte count": (tmp_path / "v1", {"num_bytes": 4}, "begin.num_bytes"),
        "unknown tensor": (tmp_path / "unknown", {"num_tensors": len(tensors) + 1}, "begin.shared_fs_path.name"),
        "wrong shape": (tmp_path / "shape", {}, "begin.shared_fs_path.shape"),
        "missing tensor": (tmp_path / "partial", {}, "begin.shared_fs_path"),
        "no folder": (tmp_path / "absent", {}, "begin.shared_fs_path"),
        "relative path": (pathlib.Path("v1"), {}, "begin.shared_fs_path"),
    }
    for case, (folder, begin, field) in cases.items():
        with pytest.raises(InvalidArgument) as error:
            stage_shared_folder(table, update_of(tensors, shared_fs_path=str(folder), **begin))
        assert error.value.field == field, case

    tensor_file = pathlib.Path(staged.tensors[0].file)
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 1
    tensor_file.write_bytes(data)
    with pytest.raises(InvalidArgument, match="sha256"):
        stage_shared_folder(table, update)
