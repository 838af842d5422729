import pathlib

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.weights.manifest import load_tensors, read_manifest
from primerl_weight_broadcaster.shared_fs import SharedFolders
from primerl_weight_broadcaster.store import WeightStore


def _names(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_a_version_is_written_once_as_a_manifest_folder_and_older_folders_go(tmp_path: pathlib.Path):
    # Left by an earlier process: two versions, a crashed write, and something not ours.
    for name in ("v0000000001-hf", ".v0000000009-hf.tmp-0a1b", "v0000000002-kernel", "notes"):
        (tmp_path / name).mkdir()
    folders = SharedFolders(tmp_path, keep_versions=1)
    folders.prune()
    assert _names(tmp_path) == ["notes", "v0000000002-kernel"]

    store = WeightStore()
    store.publish(3, {"a.weight": torch.ones(2, 3), "b.weight": torch.zeros(4)})
    version = store.publish(4, {"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4)})
    async with folders.use(version, None) as (full, manifest), folders.use(version, None) as (again, _):
        assert full == again == tmp_path / "v0000000004-hf"  # written once
        assert read_manifest(full) == manifest and manifest.policy_version == 4 and not manifest.delta
        assert {name: t.tolist() for name, t in load_tensors(full, manifest)} == {
            "a.weight": [[1.0] * 3] * 2,
            "b.weight": [1.0] * 4,
        }
    async with folders.use(version, 3) as (delta, manifest):
        assert delta.name == "v0000000004-hf-delta0000000003"
        assert manifest.delta and manifest.base_policy_version == 3
        assert [t.name for t in manifest.tensors] == ["b.weight"]
        assert manifest.weight_format == tensor_pb2.WEIGHT_FORMAT_HF
    await folders.pruned()  # after the last push in flight
    assert _names(tmp_path) == [
        "notes",
        "v0000000004-hf",
        "v0000000004-hf-delta0000000003",
    ]
