"""shared_memory: raw weight folders read back exactly, in the order written (fused parts back
to back), linked folders share the bytes, and a folder's identity tells readers of the same
filesystem apart from others."""

import os
import pathlib

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.weights.manifest import ManifestError, load_tensors, read_manifest
from primerl_common.weights.shared_memory import (
    ALIGNMENT,
    ATTRIBUTE_BOOT_ID,
    ATTRIBUTE_SHM_FOLDER,
    ATTRIBUTE_SHM_ID,
    all_finite,
    boot_id,
    link_weights,
    shm_attributes,
    shm_id,
    write_raw_weights,
)

HF = tensor_pb2.WEIGHT_FORMAT_HF


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "l.q_proj.weight": torch.randn(8, 4, generator=generator),
        "l.k_proj.weight": torch.randn(4, 4, generator=generator),
        "l.v_proj.weight": torch.randn(4, 4, generator=generator),
        "norm.weight": torch.randn(3, generator=generator).bfloat16(),
        "flag": torch.tensor([True, False]),
        "empty": torch.empty(0, 5),
    }


def test_raw_weights_read_back_exactly_in_the_order_written(tmp_path: pathlib.Path):
    tensors = _tensors()
    written = write_raw_weights(tmp_path / "v3", tensors.items(), policy_version=3, weight_format=HF)

    manifest = read_manifest(tmp_path / "v3", verify_checksums=False)
    loaded = dict(load_tensors(tmp_path / "v3", manifest))

    assert manifest == written and manifest.policy_version == 3 and not manifest.delta
    assert [t.name for t in manifest.tensors] == list(tensors)
    assert all(t.offset % ALIGNMENT == 0 for t in manifest.tensors)
    assert all(torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype for name, t in tensors.items())
    q, k, v = manifest.tensors[:3]
    assert k.offset == q.offset + q.num_bytes and v.offset == k.offset + k.num_bytes  # one [16, 4] view
    # No checksums: a reader that verifies them refuses the folder.
    with pytest.raises(ManifestError, match="sha256"):
        read_manifest(tmp_path / "v3")
    assert [p.name for p in tmp_path.iterdir()] == ["v3"]  # nothing left beside it


def test_a_linked_folder_shares_the_files_and_lists_part_of_them(tmp_path: pathlib.Path):
    tensors = _tensors()
    full = write_raw_weights(tmp_path / "v4", tensors.items(), policy_version=4, weight_format=HF)
    part = [t for t in full.tensors if t.name == "norm.weight"]
    (data,) = {t.file for t in full.tensors}

    delta = link_weights(
        tmp_path / "v4-delta3",
        {data: tmp_path / "v4" / data},
        part,
        policy_version=4,
        weight_format=HF,
        delta=True,
        base_policy_version=3,
    )

    assert read_manifest(tmp_path / "v4-delta3", verify_checksums=False) == delta
    assert delta.delta and delta.base_policy_version == 3 and [t.name for t in delta.tensors] == ["norm.weight"]
    assert os.stat(tmp_path / "v4-delta3" / data).st_ino == os.stat(tmp_path / "v4" / data).st_ino
    ((name, tensor),) = load_tensors(tmp_path / "v4-delta3", delta)
    assert name == "norm.weight" and torch.equal(tensor, tensors["norm.weight"])
    with pytest.raises(FileExistsError):
        link_weights(tmp_path / "v4", {}, [], policy_version=4, weight_format=HF)


def test_all_finite_looks_at_floats_of_16_bits_or_more():
    assert all_finite(_tensors().values())
    assert not all_finite([torch.ones(3), torch.tensor([0.0, float("inf")])])
    assert not all_finite([torch.tensor([float("nan")], dtype=torch.bfloat16)])
    assert all_finite([torch.tensor([float("nan")]).to(torch.float8_e4m3fn), torch.tensor([1, 2])])


def test_a_folder_identity_names_the_boot_and_the_filesystem_object(tmp_path: pathlib.Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    if not boot_id():
        pytest.skip("no kernel boot id here")

    assert shm_id(tmp_path / "a") == shm_id(tmp_path / "a") != shm_id(tmp_path / "b")
    assert shm_id(tmp_path / "a").startswith(boot_id() + "/")
    # Another path to the same folder (a bind mount, a symlink) is the same folder.
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert shm_id(tmp_path / "link") == shm_id(tmp_path / "a")
    attributes = shm_attributes(tmp_path / "a")
    assert attributes == {
        ATTRIBUTE_BOOT_ID: boot_id(),
        ATTRIBUTE_SHM_ID: shm_id(tmp_path / "a"),
        ATTRIBUTE_SHM_FOLDER: str(tmp_path / "a"),
    }
