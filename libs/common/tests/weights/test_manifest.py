"""weight_manifest: a folder of weights is published whole or not at all, reads back exactly,
and a folder that does not match its manifest is refused."""

import json
import pathlib

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.weights.manifest import ManifestError, load_tensors, read_manifest, write_weights

KERNEL = tensor_pb2.WEIGHT_FORMAT_KERNEL


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(4096, generator=generator)
    return {
        "a.weight": torch.randn(64, 32, generator=generator).bfloat16(),
        "b.weight": torch.randn(100, generator=generator),
        # Views of one buffer (safetensors alone refuses tensors that share memory).
        "c.weight": flat[:1024].view(32, 32),
        "d.weight": flat[1024:],
        "e.weight": torch.randn(8, 8, generator=generator).to(torch.float8_e4m3fn),
        "f.scale": torch.tensor(2.5, dtype=torch.float64),
    }


def test_weights_read_back_exactly_from_several_files(tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path):
    written = write_weights(
        tmp_path / "v7", tensors.items(), policy_version=7, weight_format=KERNEL, delta=True, base_policy_version=6,
        max_file_bytes=8192,
    )  # fmt: skip

    manifest = read_manifest(tmp_path / "v7")
    loaded = dict(load_tensors(tmp_path / "v7", manifest))

    assert manifest == written
    assert (manifest.policy_version, manifest.weight_format, manifest.delta, manifest.base_policy_version) == (
        7, KERNEL, True, 6,
    )  # fmt: skip
    assert len(manifest.files) > 1
    assert manifest.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name].float(), tensor.float()), name
    # Published by one rename: nothing but the folder is left beside it.
    assert [p.name for p in tmp_path.iterdir()] == ["v7"]


def test_a_folder_is_published_once_and_a_failed_write_leaves_nothing(
    tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path
):
    write_weights(tmp_path / "v1", tensors.items(), policy_version=1, weight_format=KERNEL)
    with pytest.raises(FileExistsError):
        write_weights(tmp_path / "v1", tensors.items(), policy_version=1, weight_format=KERNEL)

    def failing():
        yield "a.weight", tensors["a.weight"]
        raise RuntimeError("the trainer went away")

    with pytest.raises(RuntimeError):
        write_weights(tmp_path / "v2", failing(), policy_version=2, weight_format=KERNEL)
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda folder, data: data.__setitem__(-1, data[-1] ^ 1), "sha256"),
        (lambda folder, data: data.extend(b"\0"), "bytes, the manifest says"),
        (lambda folder, data: (folder / "manifest.json").write_text("{"), "manifest.json"),
        (lambda folder, data: (folder / "tensors-00000.safetensors").rename(folder / "x"), "missing"),
    ],
    ids=["flipped-bit", "extra-byte", "broken-json", "missing-file"],
)
def test_a_damaged_folder_is_refused(tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path, damage, message):
    folder = tmp_path / "v1"
    write_weights(folder, tensors.items(), policy_version=1, weight_format=KERNEL)
    file = folder / "tensors-00000.safetensors"
    data = bytearray(file.read_bytes())
    damage(folder, data)
    if file.exists():
        file.write_bytes(data)

    with pytest.raises(ManifestError, match=message):
        read_manifest(folder)


def test_a_manifest_pointing_outside_its_files_is_refused(tensors: dict[str, torch.Tensor], tmp_path: pathlib.Path):
    folder = tmp_path / "v1"
    write_weights(folder, tensors.items(), policy_version=1, weight_format=KERNEL)
    raw = json.loads((folder / "manifest.json").read_text())
    raw["tensors"][0]["offset"] = raw["files"][0]["num_bytes"]
    (folder / "manifest.json").write_text(json.dumps(raw))

    with pytest.raises(ManifestError, match="outside"):
        read_manifest(folder)
