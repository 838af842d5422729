"""Weight updates in Hugging Face format, up to the point where the engine loads them.

`WeightTable` is what the served checkpoint holds (HF names and shapes) and the dtype the
engine serves it in. `WeightStaging` receives one update's tensor stream and checks every
tensor against the table as its header arrives, before a byte of the model is touched; the
accepted tensors go into one staging file (in /dev/shm by default: memory, not disk) that
the engine process maps and loads from (see worker_extension.py). A stream that fails any
check is refused as a whole and its file deleted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import tempfile
from collections.abc import Iterable
from typing import Literal

import torch
from safetensors import safe_open

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.tensors import TensorAssembler, dtype_to_proto

__all__ = [
    "StagedTensor",
    "StagedWeights",
    "WeightFormat",
    "WeightStaging",
    "WeightTable",
    "WeightUpdate",
    "WeightUpdateResult",
    "default_staging_dir",
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
    """HF tensor names, shapes and dtypes of the served checkpoint, and the dtype the engine
    serves them in. An update may carry a tensor in either dtype (a trainer publishes what it
    loaded; a broadcaster may convert to what the engine serves): vLLM casts on load."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], checkpoint_dtypes: dict[str, torch.dtype], served_dtype: torch.dtype
    ) -> None:
        self.shapes = shapes
        self.checkpoint_dtypes = checkpoint_dtypes
        self.served_dtype = served_dtype

    @classmethod
    def from_checkpoint(cls, model_dir: pathlib.Path, served_dtype: torch.dtype) -> WeightTable:
        """Reads the safetensors headers only (no tensor data)."""
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, torch.dtype] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(path, framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    header = checkpoint.get_slice(name)
                    shapes[name] = tuple(header.get_shape())
                    dtypes[name] = _SAFETENSORS_DTYPES[header.get_dtype()]
        if not shapes:
            raise ValueError(f"{model_dir} holds no tensors in *.safetensors files")
        return cls(shapes, dtypes, served_dtype)

    def check(self, header: tensor_pb2.TensorHeader) -> None:
        """Refuses a tensor this model does not have, or one of another shape or dtype."""
        expected_shape = self.shapes.get(header.name)
        if expected_shape is None:
            raise InvalidArgument(f"unknown tensor {header.name!r} (not in the checkpoint)", field="chunk.header.name")
        allowed = {dtype_to_proto(self.served_dtype), dtype_to_proto(self.checkpoint_dtypes[header.name])}
        if header.dtype not in allowed:
            got = tensor_pb2.Dtype.Name(header.dtype) if header.dtype in tensor_pb2.Dtype.values() else header.dtype
            names = " or ".join(sorted(tensor_pb2.Dtype.Name(dtype) for dtype in allowed))
            raise InvalidArgument(f"tensor {header.name!r} is {got}, expected {names}", field="chunk.header.dtype")
        if tuple(header.shape) != expected_shape:
            raise InvalidArgument(
                f"tensor {header.name!r} has shape {list(header.shape)}, expected {list(expected_shape)}",
                field="chunk.header.shape",
            )


@dataclasses.dataclass(frozen=True)
class StagedTensor:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class StagedWeights:
    """A complete, validated update in one file: `tensors` say where each one lies."""

    path: pathlib.Path
    tensors: tuple[StagedTensor, ...]

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)

    def index(self) -> list[list[object]]:
        """The tensor index in plain lists, as vLLM's RPC serializer carries them."""
        return [[t.name, t.dtype, list(t.shape), t.offset, t.num_bytes] for t in self.tensors]


class WeightStaging:
    """Receives the chunks of one update into a staging file. Use as a context manager:
    the file is deleted on exit, whether the update was applied or refused."""

    def __init__(
        self,
        table: WeightTable,
        directory: pathlib.Path,
        *,
        num_tensors: int,
        num_bytes: int,
        names_required: Iterable[str],
    ) -> None:
        self._table = table
        self._num_tensors_announced = num_tensors
        self._num_bytes_announced = num_bytes
        self._missing = set(names_required)
        self._assembler = TensorAssembler()
        self._tensors: list[StagedTensor] = []
        self._names: set[str] = set()
        self._num_bytes = 0
        self._file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed and deleted in close())
            dir=directory, prefix="primerl-weights-", suffix=".bin", delete=False
        )
        self.path = pathlib.Path(self._file.name)

    def __enter__(self) -> WeightStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    async def feed(self, chunk: tensor_pb2.TensorChunk) -> None:
        if chunk.HasField("header"):
            self._check_header(chunk.header)
        try:
            completed = self._assembler.feed(chunk)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="chunk") from None
        if completed is not None:
            await self._write(*completed)

    def finish(self) -> StagedWeights:
        """Checks that the stream was complete and matched its `begin` message."""
        try:
            self._assembler.finish()
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="chunk") from None
        if self._missing:
            missing = sorted(self._missing)
            shown = ", ".join(repr(name) for name in missing[:_NUM_NAMES_SHOWN])
            more = f" and {len(missing) - _NUM_NAMES_SHOWN} more" if len(missing) > _NUM_NAMES_SHOWN else ""
            raise InvalidArgument(f"a full update must carry every tensor; missing {shown}{more}", field="chunk")
        if len(self._tensors) != self._num_tensors_announced:
            raise InvalidArgument(
                f"stream carried {len(self._tensors)} tensors, begin announced {self._num_tensors_announced}",
                field="begin.num_tensors",
            )
        if self._num_bytes != self._num_bytes_announced:
            raise InvalidArgument(
                f"stream carried {self._num_bytes} bytes, begin announced {self._num_bytes_announced}",
                field="begin.num_bytes",
            )
        self._file.flush()
        return StagedWeights(self.path, tuple(self._tensors))

    def _check_header(self, header: tensor_pb2.TensorHeader) -> None:
        self._table.check(header)
        if header.name in self._names:
            raise InvalidArgument(f"tensor {header.name!r} appears twice", field="chunk.header.name")
        # Refuse an overlong stream as soon as it shows, not after receiving all of it.
        if len(self._names) + 1 > self._num_tensors_announced:
            raise InvalidArgument(
                f"more than the {self._num_tensors_announced} tensors begin announced", field="begin.num_tensors"
            )
        if self._num_bytes + header.num_bytes > self._num_bytes_announced:
            raise InvalidArgument(
                f"more than the {self._num_bytes_announced} bytes begin announced", field="begin.num_bytes"
            )
        self._names.add(header.name)

    async def _write(self, name: str, tensor: torch.Tensor) -> None:
        offset = self._file.tell()
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        padding = -(offset + data.size) % _ALIGNMENT
        # Off the event loop: a large tensor takes a while to copy.
        await asyncio.to_thread(self._file.write, data)
        if padding:
            self._file.write(bytes(padding))
        dtype = str(tensor.dtype).removeprefix("torch.")
        self._tensors.append(StagedTensor(name, dtype, tuple(tensor.shape), offset, data.size))
        self._num_bytes += data.size
        self._missing.discard(name)
