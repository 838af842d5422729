"""Weight updates up to the point where the engine loads them.

`WeightTable` is what the engine holds in one weight format: tensor names, shapes, the
dtypes an update may carry, and which engine module each tensor loads into. HF names come
from the checkpoint; kernel-format names (fused `qkv_proj` and `gate_up_proj`, stacked
experts `w13_weight`/`w2_weight`) from the engine's own parameters.

An update arrives as a tensor stream (`WeightStaging`: each tensor is checked as its header
arrives, before a byte of the model is touched, and the accepted ones go into one staging
file, in /dev/shm by default: memory, not disk), as a folder on a shared filesystem
(`stage_shared_folder`: its manifest is checked the same way, see
primerl_common.weights.manifest), or as a folder in this host's shared memory
(`stage_shm_folder`: the same, but no checksums to read, see
primerl_common.weights.shared_memory). Either way the result is a `StagedWeights`, an index
of validated tensors in files that the engine process maps and loads from (see
worker_extension.py). An update that fails any check is refused as a whole.

A delta update carries only some tensors, but always whole engine modules: the engine
rebuilds a module from all of its tensors (q/k/v_proj make one qkv_proj; gate/up_proj one
gate_up_proj; all experts of a layer, w13 and w2, one experts module), so a part of one
would leave the rest undefined.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import tempfile
from collections.abc import Iterable
from typing import IO, Literal

import torch
from safetensors import safe_open

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_common.tensors import FileTensorAssembler, TensorChunkView, dtype_to_proto
from primerl_common.weights.engine_modules import engine_module
from primerl_common.weights.manifest import ManifestError, WeightManifest, read_manifest
from primerl_common.weights.shared_memory import METADATA_FINITE

__all__ = [
    "StagedTensor",
    "StagedWeights",
    "WeightFormat",
    "WeightStaging",
    "WeightTable",
    "WeightUpdate",
    "WeightUpdateResult",
    "default_staging_dir",
    "join_stripes",
    "stage_shared_folder",
    "stage_shm_folder",
]

# Each tensor starts at a multiple of this in the staging file, so that it can be viewed in
# place as any dtype.
_ALIGNMENT = 64
# How many missing names an error message lists.
_NUM_NAMES_SHOWN = 5

WeightFormat = Literal["unspecified", "hf", "kernel", "kernel_fp8"]

# safetensors' dtype names, for the dtypes a checkpoint's weights come in.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
    """The `begin` of an UpdateWeights stream."""

    policy_version: int
    format: WeightFormat
    num_tensors: int
    num_bytes: int
    delta: bool = False
    base_policy_version: int = 0
    # A published folder (primerl_common.weights.manifest) to load from; no chunks follow.
    shared_fs_path: str = ""
    # The same in this host's shared memory (primerl_common.weights.shared_memory).
    shm_path: str = ""
    # A striped update: this stream is stripe `stripe_index` of `num_stripes` (weight_updates.py).
    stripe_session: str = ""
    num_stripes: int = 0
    stripe_index: int = 0


@dataclasses.dataclass(frozen=True)
class WeightUpdateResult:
    policy_version: int
    num_tensors: int
    num_bytes: int
    pause_s: float
    total_s: float


def default_staging_dir() -> pathlib.Path:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() else pathlib.Path(tempfile.gettempdir())


class WeightTable:
    """Tensor names and shapes of one weight format, and the dtypes an update may carry for
    each: the engine's, or the checkpoint's (a trainer publishes what it loaded; a
    broadcaster may convert to what the engine serves): vLLM casts on load."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, frozenset[torch.dtype]]) -> None:
        self.shapes = shapes
        self.dtypes = dtypes
        modules: dict[str, set[str]] = collections.defaultdict(set)
        for name in shapes:
            modules[engine_module(name)].add(name)
        self.modules = {module: frozenset(names) for module, names in modules.items()}

    @classmethod
    def from_checkpoint(cls, model_dir: pathlib.Path, served_dtype: torch.dtype) -> WeightTable:
        """HF names; reads the safetensors headers only (no tensor data)."""
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, frozenset[torch.dtype]] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(path, framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    header = checkpoint.get_slice(name)
                    shapes[name] = tuple(header.get_shape())
                    dtypes[name] = frozenset({served_dtype, _SAFETENSORS_DTYPES[header.get_dtype()]})
        if not shapes:
            raise ValueError(f"{model_dir} holds no tensors in *.safetensors files")
        return cls(shapes, dtypes)

    @classmethod
    def for_kernel_format(cls, parameters: Iterable[tuple[str, Iterable[int]]], hf: WeightTable) -> WeightTable:
        """Kernel-format names: the engine's parameters (name, shape as created), in the
        dtypes an HF update may carry."""
        allowed = frozenset().union(*hf.dtypes.values())
        shapes = {name: tuple(shape) for name, shape in parameters}
        return cls(shapes, dict.fromkeys(shapes, allowed))

    def check(self, header: tensor_pb2.TensorHeader, *, field: str = "chunk.header") -> None:
        """Refuses a tensor this model does not have, or one of another shape or dtype."""
        expected_shape = self.shapes.get(header.name)
        if expected_shape is None:
            raise InvalidArgument(f"unknown tensor {header.name!r} (not in this weight format)", field=f"{field}.name")
        allowed = {dtype_to_proto(dtype) for dtype in self.dtypes[header.name]}
        if header.dtype not in allowed:
            got = tensor_pb2.Dtype.Name(header.dtype) if header.dtype in tensor_pb2.Dtype.values() else header.dtype
            names = " or ".join(sorted(tensor_pb2.Dtype.Name(dtype) for dtype in allowed))
            raise InvalidArgument(f"tensor {header.name!r} is {got}, expected {names}", field=f"{field}.dtype")
        if tuple(header.shape) != expected_shape:
            raise InvalidArgument(
                f"tensor {header.name!r} has shape {list(header.shape)}, expected {list(expected_shape)}",
                field=f"{field}.shape",
            )

    def check_complete(self, names: set[str], *, delta: bool, field: str) -> tuple[str, ...]:
        """Refuses a full update that lacks a tensor, or a delta that carries part of a module;
        the modules the tensors load into."""
        modules = sorted({engine_module(name) for name in names})
        if not delta:
            _refuse_missing(set(self.shapes) - names, "a full update must carry every tensor; missing", field)
        for module in modules:
            _refuse_missing(self.modules[module] - names, f"a delta must carry whole modules; {module!r} lacks", field)
        return tuple(modules)


def _refuse_missing(missing: set[str], message: str, field: str) -> None:
    if not missing:
        return
    ordered = sorted(missing)
    shown = ", ".join(repr(name) for name in ordered[:_NUM_NAMES_SHOWN])
    more = f" and {len(ordered) - _NUM_NAMES_SHOWN} more" if len(ordered) > _NUM_NAMES_SHOWN else ""
    raise InvalidArgument(f"{message} {shown}{more}", field=field)


def _check_counts(num_tensors: int, num_bytes: int, update: WeightUpdate, *, source: str) -> None:
    if num_tensors != update.num_tensors:
        raise InvalidArgument(
            f"{source} carried {num_tensors} tensors, begin announced {update.num_tensors}", field="begin.num_tensors"
        )
    if num_bytes != update.num_bytes:
        raise InvalidArgument(
            f"{source} carried {num_bytes} bytes, begin announced {update.num_bytes}", field="begin.num_bytes"
        )


@dataclasses.dataclass(frozen=True)
class StagedTensor:
    file: str
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class StagedWeights:
    """A complete, validated update: where each tensor lies, and the engine modules they
    load into."""

    tensors: tuple[StagedTensor, ...]
    modules: tuple[str, ...]
    # The writer of a folder in this host's shared memory found no NaN or Inf in it: the
    # engine does not read every byte again to check (primerl_common.weights.shared_memory).
    finite_checked: bool = False

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)

    def index(self) -> list[list[object]]:
        """The tensor index in plain lists, as vLLM's RPC serializer carries them."""
        return [[t.file, t.name, t.dtype, list(t.shape), t.offset, t.num_bytes] for t in self.tensors]


# The staging file of the last complete update, by folder: the next update writes over it,
# which costs about half as much as writing a new file, whose memory the kernel must first
# allocate and clear. Staging files have no name in the folder (they go with this process,
# however it ends); other processes (vLLM's engine) open them through /proc.
_spare_files: dict[pathlib.Path, IO[bytes]] = {}


class WeightStaging:
    """Receives the chunks of one update into a staging file, each chunk's bytes written
    once as they arrive (no tensor is assembled in memory). Use as a context manager: on
    exit, the file of a complete update is kept for the next one to write over; that of an
    incomplete or refused one is freed."""

    def __init__(self, table: WeightTable, directory: pathlib.Path, update: WeightUpdate) -> None:
        self._table = table
        self._update = update
        self._tensors: list[StagedTensor] = []
        self._names: set[str] = set()
        self._num_bytes = 0
        self._directory = directory
        self._complete = False
        self._file = _spare_files.pop(directory, None) or tempfile.TemporaryFile(dir=directory)  # noqa: SIM115
        self._file.seek(0)
        self.path = pathlib.Path(f"/proc/{os.getpid()}/fd/{self._file.fileno()}")
        self._assembler = FileTensorAssembler(self._file, alignment=_ALIGNMENT)

    def __enter__(self) -> WeightStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._complete and self._directory not in _spare_files:
            _spare_files[self._directory] = self._file
        else:
            self._file.close()

    async def feed(self, chunk: tensor_pb2.TensorChunk | TensorChunkView) -> None:
        view = chunk if isinstance(chunk, TensorChunkView) else TensorChunkView.of(chunk)
        if view.header is not None:
            self._check_header(view.header)
        try:
            # On the event loop: a chunk (a few MiB) is written in about a millisecond, less
            # than a hop to a worker thread and back costs in all.
            completed = self._assembler.feed(view)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="chunk") from None
        if completed is not None:
            name, tensor = completed  # on the meta device: its bytes are in the file
            num_bytes = tensor.numel() * tensor.element_size()
            dtype = str(tensor.dtype).removeprefix("torch.")
            offset = self._assembler.offsets[name]
            self._tensors.append(StagedTensor(str(self.path), name, dtype, tuple(tensor.shape), offset, num_bytes))
            self._num_bytes += num_bytes

    def finish(self, *, part: bool = False) -> StagedWeights:
        """Checks that the stream was complete and matched its `begin` message. `part`: the
        stream is one stripe of an update; `join_stripes` checks the whole."""
        try:
            self._assembler.finish()
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="chunk") from None
        modules: tuple[str, ...] = ()
        if not part:
            modules = self._table.check_complete(self._names, delta=self._update.delta, field="chunk")
            _check_counts(len(self._tensors), self._num_bytes, self._update, source="stream")
        self._file.flush()
        self._complete = True
        return StagedWeights(tuple(self._tensors), modules)

    def _check_header(self, header: tensor_pb2.TensorHeader) -> None:
        self._table.check(header)
        if header.name in self._names:
            raise InvalidArgument(f"tensor {header.name!r} appears twice", field="chunk.header.name")
        # Refuse an overlong stream as soon as it shows, not after receiving all of it.
        if len(self._names) + 1 > self._update.num_tensors:
            raise InvalidArgument(
                f"more than the {self._update.num_tensors} tensors begin announced", field="begin.num_tensors"
            )
        if self._num_bytes + header.num_bytes > self._update.num_bytes:
            raise InvalidArgument(
                f"more than the {self._update.num_bytes} bytes begin announced", field="begin.num_bytes"
            )
        self._names.add(header.name)


def join_stripes(table: WeightTable, update: WeightUpdate, parts: list[StagedWeights]) -> StagedWeights:
    """The stripes of an update (each `WeightStaging.finish(part=True)`'s) as one, checked as a
    single stream's would be."""
    tensors = tuple(tensor for part in parts for tensor in part.tensors)
    names = {tensor.name for tensor in tensors}
    if len(names) < len(tensors):
        raise InvalidArgument("a tensor arrived on two stripes", field="chunk.header.name")
    modules = table.check_complete(names, delta=update.delta, field="chunk")
    _check_counts(len(tensors), sum(t.num_bytes for t in tensors), update, source="the stripes")
    return StagedWeights(tensors, modules)


def stage_shared_folder(table: WeightTable, update: WeightUpdate) -> StagedWeights:
    """Checks a folder published on a shared filesystem (its manifest, checksums, and every
    tensor as a stream's would be) against `update`; its tensors stay where they are.
    Reads every byte once (checksums): call it off the event loop."""
    field = "begin.shared_fs_path"
    folder = pathlib.Path(update.shared_fs_path)
    if not folder.is_absolute():
        raise InvalidArgument(f"{update.shared_fs_path!r} is not an absolute path", field=field)
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        raise InvalidArgument(str(exc), field=field) from None
    return _staged_folder(table, update, folder, manifest, field)


def stage_shm_folder(table: WeightTable, update: WeightUpdate, shm_folder: pathlib.Path) -> StagedWeights:
    """Checks a folder in this host's shared memory against `update`, as `stage_shared_folder`
    does but for checksums (it holds none: primerl_common.weights.shared_memory). The folder
    must lie in `shm_folder`; one this replica cannot read (not the writer's shared memory
    after all) is refused FAILED_PRECONDITION, reason SHM_UNREADABLE."""
    field = "begin.shm_path"
    folder = pathlib.Path(update.shm_path)
    if not folder.is_absolute() or ".." in folder.parts or not folder.is_relative_to(shm_folder):
        raise InvalidArgument(f"{update.shm_path!r} is not an absolute path in {shm_folder}", field=field)
    if not folder.is_dir():
        raise FailedPrecondition(
            f"{folder} cannot be read here: this replica does not share the writer's shared memory",
            subject=field,
            reason="SHM_UNREADABLE",
        )
    try:
        manifest = read_manifest(folder, verify_checksums=False)
    except ManifestError as exc:
        raise InvalidArgument(str(exc), field=field) from None
    staged = _staged_folder(table, update, folder, manifest, field)
    return dataclasses.replace(staged, finite_checked=manifest.metadata.get(METADATA_FINITE) is True)


def _staged_folder(
    table: WeightTable, update: WeightUpdate, folder: pathlib.Path, manifest: WeightManifest, field: str
) -> StagedWeights:
    """A folder's checked manifest, checked against `update` and the table, as an index."""
    announced = {
        "policy_version": (manifest.policy_version, update.policy_version),
        "format": (tensor_pb2.WeightFormat.Name(manifest.weight_format), f"WEIGHT_FORMAT_{update.format.upper()}"),
        "delta": (manifest.delta, update.delta),
        "base_policy_version": (manifest.base_policy_version, update.base_policy_version),
    }
    for name, (in_manifest, in_begin) in announced.items():
        if in_manifest != in_begin:
            raise InvalidArgument(f"the manifest says {name} {in_manifest}, begin {in_begin}", field=f"begin.{name}")
    for t in manifest.tensors:
        try:
            dtype = dtype_to_proto(t.dtype)
        except ValueError as exc:
            raise InvalidArgument(f"tensor {t.name!r}: {exc}", field=field) from None
        table.check(tensor_pb2.TensorHeader(name=t.name, dtype=dtype, shape=list(t.shape)), field=field)
    modules = table.check_complete({t.name for t in manifest.tensors}, delta=update.delta, field=field)
    _check_counts(manifest.num_tensors, manifest.num_bytes, update, source="the manifest")
    tensors = tuple(
        StagedTensor(str(folder / t.file), t.name, str(t.dtype).removeprefix("torch."), t.shape, t.offset, t.num_bytes)
        for t in manifest.tensors
    )
    return StagedWeights(tensors, modules)
