"""The same-host weight transport: a policy version in a folder of shared memory (tmpfs, e.g.
/dev/shm) that a writer on the host (the weight broadcaster) publishes and readers on the
same host (inference replicas, told its path in `WeightUpdateBegin.shm_path`) load straight
from their own mapping of it.

A folder is a manifest folder as in manifest.py, with two differences: its data files are raw
(each tensor's bytes at its manifest offset, a multiple of 64, in native byte order: no
safetensors header) and its manifest has no checksums (the bytes never leave this host's
memory; `read_manifest(..., verify_checksums=False)` reads it, and a reader that verifies
refuses it). Both writers publish atomically (a hidden staging folder renamed into place).

Whether a reader shares a writer's shared memory is not told by a host name: a replica
advertises, in its GetServiceInfo attributes, the kernel's boot id and the identity of its
shared-memory folder (device and inode, which the same tmpfs mount shows to every process of
the host that mounts it, and a container with a /dev/shm of its own does not), and where it
sees that folder; a writer whose own folder has the same identity names its files under the
reader's path.

API
---
    shm_attributes(folder) -> dict[str, str]
        The attributes a reader advertises for `folder` (ATTRIBUTE_BOOT_ID, ATTRIBUTE_SHM_ID,
        ATTRIBUTE_SHM_FOLDER).
    shm_id(folder) -> str
        "<boot id>/<device>:<inode>" of `folder`; "" where the boot id cannot be read.
    write_raw_weights(path, named_tensors, *, policy_version, weight_format, ...) -> WeightManifest
        Writes the tensors, in the order given, into one raw data file (one copy per byte).
    link_weights(path, files, tensors, *, policy_version, weight_format, ...) -> WeightManifest
        A folder made of data files that already exist on the same filesystem (hard links),
        listing `tensors` of them: a version received straight into shared memory, or a delta
        made of part of a full folder, without copying a byte.
    all_finite(tensors) -> bool
        Whether no floating-point tensor of 16 bits or more holds NaN or Inf. A writer that
        checked it says so in the manifest's metadata (METADATA_FINITE: true), and a reader on
        the same host may take its word instead of reading every byte again.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.weights.manifest import MANIFEST_NAME, ManifestFile, ManifestTensor, WeightManifest

__all__ = [
    "ALIGNMENT",
    "ATTRIBUTE_BOOT_ID",
    "ATTRIBUTE_SHM_FOLDER",
    "ATTRIBUTE_SHM_ID",
    "METADATA_FINITE",
    "all_finite",
    "boot_id",
    "link_weights",
    "shm_attributes",
    "shm_id",
    "write_raw_weights",
]

ATTRIBUTE_BOOT_ID = "host.boot_id"
ATTRIBUTE_SHM_FOLDER = "weights.shm_folder"
ATTRIBUTE_SHM_ID = "weights.shm_id"
# Manifest metadata: the writer found no NaN or Inf in the folder's tensors (all_finite).
METADATA_FINITE = "all_finite"
# Each tensor starts at a multiple of this in a data file, so that it can be viewed in place as any dtype.
ALIGNMENT = 64
_DATA_FILE = "data-00000.bin"
_WRITE_BYTES = 256 * 1024 * 1024
_BOOT_ID = pathlib.Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """The running kernel's boot id (the same in every container of the host); "" if unknown."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def shm_id(folder: str | os.PathLike[str]) -> str:
    boot = boot_id()
    if not boot:
        return ""
    stat = os.stat(folder)
    return f"{boot}/{stat.st_dev}:{stat.st_ino}"


def shm_attributes(folder: str | os.PathLike[str]) -> dict[str, str]:
    return {ATTRIBUTE_BOOT_ID: boot_id(), ATTRIBUTE_SHM_ID: shm_id(folder), ATTRIBUTE_SHM_FOLDER: str(folder)}


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """No NaN or Inf in any floating-point tensor of 16 bits or more (8-bit floats are not
    checked, as an inference replica does not check them): min and max in one pass each."""
    for tensor in tensors:
        if not tensor.is_floating_point() or tensor.element_size() < 2 or tensor.numel() == 0:
            continue
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            return False
    return True


def write_raw_weights(
    path: str | os.PathLike[str],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    policy_version: int,
    weight_format: int,
    delta: bool = False,
    base_policy_version: int = 0,
    metadata: dict[str, object] | None = None,
) -> WeightManifest:
    """The tensors (CPU, any dtype; names unique) in one raw data file, in the order given
    (a reader may view tensors that lie back to back as one), and the manifest."""
    if sys.byteorder != "little":
        raise NotImplementedError("raw weight files are little-endian")

    def populate(staging: pathlib.Path) -> tuple[list[ManifestFile], list[ManifestTensor]]:
        tensors: list[ManifestTensor] = []
        names: set[str] = set()
        offset = 0
        fd = os.open(staging / _DATA_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            for name, tensor in named_tensors:
                if name in names:
                    raise ValueError(f"tensor {name!r} given twice")
                names.add(name)
                offset += -offset % ALIGNMENT
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                _pwrite_all(fd, memoryview(data.numpy()), offset)
                tensors.append(
                    ManifestTensor(name, _DATA_FILE, tensor.dtype, tuple(tensor.shape), offset, data.numel())
                )
                offset += data.numel()
            os.ftruncate(fd, offset)  # the last tensor's padding, if any, and an empty file
        finally:
            os.close(fd)
        return [ManifestFile(_DATA_FILE, offset, "")], tensors

    return _publish(pathlib.Path(path), populate, policy_version, weight_format, delta, base_policy_version, metadata)


def link_weights(
    path: str | os.PathLike[str],
    files: Mapping[str, pathlib.Path],
    tensors: Sequence[ManifestTensor],
    *,
    policy_version: int,
    weight_format: int,
    delta: bool = False,
    base_policy_version: int = 0,
    metadata: dict[str, object] | None = None,
) -> WeightManifest:
    """A folder whose data files are hard links to `files` (name in the folder -> an existing
    raw data file on the same filesystem), listing `tensors` (each naming its file by its name
    in the folder); files no tensor lies in are left out."""

    def populate(staging: pathlib.Path) -> tuple[list[ManifestFile], list[ManifestTensor]]:
        used = sorted({t.file for t in tensors})
        manifest_files = []
        for name in used:
            if pathlib.PurePath(name).name != name or name == MANIFEST_NAME:
                raise ValueError(f"file name {name!r} is not a plain data file name")
            os.link(files[name], staging / name)
            manifest_files.append(ManifestFile(name, (staging / name).stat().st_size, ""))
        return manifest_files, list(tensors)

    return _publish(pathlib.Path(path), populate, policy_version, weight_format, delta, base_policy_version, metadata)


def _publish(
    path: pathlib.Path,
    populate: Callable[[pathlib.Path], tuple[list[ManifestFile], list[ManifestTensor]]],
    policy_version: int,
    weight_format: int,
    delta: bool,
    base_policy_version: int,
    metadata: dict[str, object] | None,
) -> WeightManifest:
    if path.exists():
        raise FileExistsError(f"{path} exists; weights are published into a new folder")
    tensor_pb2.WeightFormat.Name(weight_format)  # ValueError for an unknown format
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        files, tensors = populate(staging)
        manifest = WeightManifest(
            policy_version,
            weight_format,
            delta,
            base_policy_version,
            tuple(files),
            tuple(tensors),
            dict(metadata or {}),
        )
        # Memory, not disk: no fsync (a crash of the host loses the folder either way).
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written : written + _WRITE_BYTES], offset + written)
