"""A policy version's weights in a shared folder: safetensors files plus a manifest.

The one place that defines the shared-filesystem weight transport. A writer (the weight
broadcaster) publishes a folder; a reader (an inference replica, told the folder's path in
`WeightUpdateBegin.shared_fs_path`) checks it and loads the tensors from it.

API
---
    write_weights(path, named_tensors, *, policy_version, weight_format,
                  delta=False, base_policy_version=0, max_file_bytes=..., metadata=None) -> WeightManifest
        Writes the tensors (torch, any device; names unique) and publishes the folder `path`
        atomically: everything is written into a hidden sibling folder, fsynced, then renamed
        to `path`. `path` must not exist yet (FileExistsError): use one folder per version,
        e.g. `<root>/v00000042`. `weight_format` is a `tensor_pb2.WeightFormat` value.
        `metadata`: a JSON object of the writer's own, kept in the manifest.
    read_manifest(path, *, verify_checksums=True) -> WeightManifest
        Parses and checks `path/manifest.json` against the files beside it: sizes, byte
        ranges, dtypes, shapes, and (by default) each file's sha256. ManifestError (a
        ValueError) names what is wrong.
    load_tensors(path, manifest) -> Iterator[tuple[str, torch.Tensor]]
        The tensors, in manifest order (file, then offset), as CPU tensors viewed from
        memory-mapped files.

Folder layout
-------------
    manifest.json               written last; see WeightManifest.to_json
    tensors-00000.safetensors   the tensors, split into files of at most max_file_bytes

manifest.json holds `manifest_version` (1), `policy_version`, `weight_format` (the enum name,
e.g. "WEIGHT_FORMAT_KERNEL_FP8"), `delta`, `base_policy_version`, `files` (name, num_bytes,
sha256), `tensors` (name, file, dtype as a torch name without "torch.", shape, offset,
num_bytes) and, when the writer gave any, `metadata` (a JSON object of the writer's own, which
readers may ignore): `offset` is the absolute byte offset of the tensor's data in its file, so
a reader may map the bytes without parsing the safetensors header. Folders in shared memory
(shared_memory.py) hold raw data files instead, and no checksums (`sha256` empty): read them
with verify_checksums=False.

A delta folder (delta=True) holds the changed tensors only, but whole engine modules: see
`WeightUpdateBegin.delta` in protos/primerl/inference/v1/inference.proto.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import _TYPES as SAFETENSORS_DTYPES  # safetensors' dtype names
from safetensors.torch import save_file

from primerl.common.v1 import tensor_pb2
from primerl_common.durable import fsync_dir, write_synced

__all__ = [
    "MANIFEST_NAME",
    "ManifestError",
    "ManifestFile",
    "ManifestTensor",
    "WeightManifest",
    "group_by_size",
    "load_tensors",
    "read_manifest",
    "view_tensor",
    "write_weights",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
DEFAULT_MAX_FILE_BYTES = 4 * 1024**3
_HASH_BLOCK_BYTES = 16 * 1024 * 1024


class ManifestError(ValueError):
    """A folder that is not a complete, consistent set of weights."""


@dataclasses.dataclass(frozen=True)
class ManifestFile:
    name: str
    num_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ManifestTensor:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class WeightManifest:
    policy_version: int
    weight_format: int  # tensor_pb2.WeightFormat
    delta: bool
    base_policy_version: int
    files: tuple[ManifestFile, ...]
    tensors: tuple[ManifestTensor, ...]
    metadata: dict[str, object] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data (not counting safetensors headers)."""
        return sum(t.num_bytes for t in self.tensors)

    def to_json(self) -> str:
        return json.dumps(
            {
                "manifest_version": MANIFEST_VERSION,
                "policy_version": self.policy_version,
                "weight_format": tensor_pb2.WeightFormat.Name(self.weight_format),
                "delta": self.delta,
                "base_policy_version": self.base_policy_version,
                "files": [dataclasses.asdict(f) for f in self.files],
                "tensors": [
                    {
                        "name": t.name,
                        "file": t.file,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "offset": t.offset,
                        "num_bytes": t.num_bytes,
                    }
                    for t in self.tensors
                ],
                **({"metadata": self.metadata} if self.metadata else {}),
            },
            indent=1,
        )


def write_weights(
    path: str | os.PathLike[str],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    policy_version: int,
    weight_format: int,
    delta: bool = False,
    base_policy_version: int = 0,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    metadata: dict[str, object] | None = None,
) -> WeightManifest:
    """Writes the tensors and the manifest into a new folder `path`, published atomically."""
    path = pathlib.Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; weights are published into a new folder")
    tensor_pb2.WeightFormat.Name(weight_format)  # ValueError for an unknown format
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        files, tensors = [], []
        for index, group in enumerate(group_by_size(named_tensors, max_file_bytes)):
            name = f"tensors-{index:05d}.safetensors"
            save_file(group, staging / name)
            files.append(ManifestFile(name, (staging / name).stat().st_size, _sha256_and_fsync(staging / name)))
            tensors.extend(_safetensors_index(staging / name))
        manifest = WeightManifest(
            policy_version,
            weight_format,
            delta,
            base_policy_version,
            tuple(files),
            tuple(tensors),
            dict(metadata or {}),
        )
        write_synced(staging / MANIFEST_NAME, manifest.to_json().encode())
        fsync_dir(staging)
        staging.rename(path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def read_manifest(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> WeightManifest:
    """The manifest of a published folder, checked against its files."""
    path = pathlib.Path(path)
    try:
        raw = json.loads((path / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path} has no {MANIFEST_NAME}") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path / MANIFEST_NAME}: {exc}") from None
    try:
        manifest = _parse(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{path / MANIFEST_NAME}: malformed ({exc!r})") from None
    try:
        _check(path, manifest, verify_checksums=verify_checksums)
    except OSError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    return manifest


def load_tensors(path: str | os.PathLike[str], manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checked folder, viewed from memory-mapped files (read-only: copy
    one before modifying it)."""
    path = pathlib.Path(path)
    mapped: dict[str, torch.Tensor] = {}
    for t in manifest.tensors:
        if t.file not in mapped:
            size = next(f.num_bytes for f in manifest.files if f.name == t.file)
            mapped[t.file] = torch.from_file(str(path / t.file), shared=False, size=size, dtype=torch.uint8)
        yield t.name, view_tensor(mapped[t.file], t)


def view_tensor(data: torch.Tensor, tensor: ManifestTensor) -> torch.Tensor:
    """`tensor` out of its file's bytes (a flat uint8 tensor); a copy only if misaligned."""
    raw = data[tensor.offset : tensor.offset + tensor.num_bytes]
    if tensor.offset % tensor.dtype.itemsize:
        raw = raw.clone()
    return raw.view(tensor.dtype).view(tensor.shape)


def group_by_size(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_file_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive tensors in groups of at most `max_file_bytes` (a larger tensor alone), each
    ready for one safetensors file: contiguous, on the CPU, no two sharing a storage (tied
    weights are cloned). One empty group when there are no tensors; ValueError on a name
    given twice."""
    group: dict[str, torch.Tensor] = {}
    group_bytes = 0
    storages: set[int] = set()  # of the group's tensors: safetensors refuses two sharing one
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        num_bytes = tensor.numel() * tensor.element_size()
        if group and group_bytes + num_bytes > max_file_bytes:
            yield group
            group, group_bytes, storages = {}, 0, set()
        tensor = tensor.detach().contiguous().cpu()
        storage = tensor.untyped_storage().data_ptr()
        group[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
        group_bytes += num_bytes
    if group or not seen:
        yield group


def _safetensors_index(file: pathlib.Path) -> list[ManifestTensor]:
    """Absolute byte ranges of a safetensors file's tensors, from its header."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    base = 8 + header_len
    return [
        ManifestTensor(
            name, file.name, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, end - begin
        )
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
        for begin, end in [info["data_offsets"]]
    ]


def _parse(raw: dict) -> WeightManifest:
    if raw["manifest_version"] != MANIFEST_VERSION:
        raise ValueError(f"manifest_version {raw['manifest_version']}, expected {MANIFEST_VERSION}")
    files = tuple(ManifestFile(str(f["name"]), int(f["num_bytes"]), str(f["sha256"])) for f in raw["files"])
    tensors = tuple(
        ManifestTensor(
            str(t["name"]),
            str(t["file"]),
            _torch_dtype(t["dtype"]),
            tuple(int(d) for d in t["shape"]),
            int(t["offset"]),
            int(t["num_bytes"]),
        )
        for t in raw["tensors"]
    )
    return WeightManifest(
        int(raw["policy_version"]),
        tensor_pb2.WeightFormat.Value(raw["weight_format"]),
        bool(raw["delta"]),
        int(raw["base_policy_version"]),
        files,
        tensors,
        _object(raw.get("metadata", {})),
    )


def _object(value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(value).__name__}")
    return value


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _check(path: pathlib.Path, manifest: WeightManifest, *, verify_checksums: bool) -> None:
    files = {f.name: f for f in manifest.files}
    for f in manifest.files:
        if pathlib.PurePath(f.name).name != f.name or f.name in ("", ".", ".."):
            raise ManifestError(f"file name {f.name!r} is not a plain name in the folder")
        try:
            size = (path / f.name).stat().st_size
        except FileNotFoundError:
            raise ManifestError(f"{path / f.name} is missing") from None
        if size != f.num_bytes:
            raise ManifestError(f"{path / f.name} has {size} bytes, the manifest says {f.num_bytes}")
        if verify_checksums and _sha256(path / f.name) != f.sha256:
            raise ManifestError(f"{path / f.name} does not match its sha256 in the manifest")
    names: set[str] = set()
    for t in manifest.tensors:
        if t.name in names:
            raise ManifestError(f"tensor {t.name!r} appears twice")
        names.add(t.name)
        if t.file not in files:
            raise ManifestError(f"tensor {t.name!r} lies in {t.file!r}, which is not in the manifest's files")
        if any(d < 0 for d in t.shape) or t.num_bytes != math.prod(t.shape) * t.dtype.itemsize:
            raise ManifestError(f"tensor {t.name!r}: num_bytes {t.num_bytes} does not fit {t.dtype} {list(t.shape)}")
        if t.offset < 0 or t.offset + t.num_bytes > files[t.file].num_bytes:
            raise ManifestError(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.num_bytes}) outside {t.file}")


def _sha256(file: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _sha256_and_fsync(file: pathlib.Path) -> str:
    with open(file, "rb+") as f:
        os.fsync(f.fileno())
    return _sha256(file)
