"""Weights over a collective group, without global torch.distributed state.

A group (inference.v1 CollectiveGroup) is formed by every member connecting to one TCPStore
(the weight broadcaster hosts it) and building its process group directly under a key prefix
of its own: `ProcessGroupNCCL` for GPU buffers, `ProcessGroupGloo` for CPU ones, the same code
path either way. Rank 0 (the trainer) broadcasts the tensors of a version in an order every
member knows beforehand (their `TensorSpec`s), packed as bytes into flat buffers of at most
`bucket_bytes` (`buckets`), each tensor starting at a multiple of `ALIGNMENT` bytes so that a
receiver views it in place as its dtype. After the last buffer every member confirms the
version (`_all_received`): rank 0 learns of a member that is gone even when each of its
broadcasts returned.

Only torch and the stubs here: the receiving side runs inside vLLM's engine process.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import threading
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from primerl.inference.v1 import inference_pb2

__all__ = [
    "ALIGNMENT",
    "BACKENDS",
    "CollectiveReceiver",
    "GroupCache",
    "GroupSpec",
    "TensorSpec",
    "buckets",
    "receive_tensors",
    "send_tensors",
]

logger = logging.getLogger(__name__)

ALIGNMENT = 64
BACKENDS = ("nccl", "gloo")
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One member's place in a group (the fields of inference.v1 CollectiveGroup)."""

    store_address: str
    group_name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    bucket_bytes: int

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not within the group's world size {self.world_size}")
        if self.bucket_bytes <= 0 or self.timeout_s <= 0:
            raise ValueError("bucket_bytes and timeout_s must be positive")

    @classmethod
    def from_proto(cls, group: inference_pb2.CollectiveGroup) -> GroupSpec:
        """ValueError when the group is not one a member can join."""
        host, _, port = group.store_address.rpartition(":")
        if not host or not port.isdigit() or not group.group_name:
            raise ValueError("a group needs store_address (host:port) and group_name")
        return cls(
            store_address=group.store_address,
            group_name=group.group_name,
            rank=group.rank,
            world_size=group.world_size,
            backend=group.backend,
            timeout_s=group.timeout_ms / 1000,
            bucket_bytes=group.bucket_bytes,
        )

    @property
    def device(self) -> torch.device:
        """Where the buffers live: the current GPU for NCCL, the CPU for gloo."""
        if self.backend == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("the nccl backend needs a GPU, and this process has none (use gloo)")
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """Consecutive tensors packed into buffers of at most `bucket_bytes` (a larger tensor goes
    alone): per buffer, (index into `specs`, byte offset) of each tensor."""
    packed: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    size = 0
    for index, spec in enumerate(specs):
        offset = _aligned(size)
        if current and offset + spec.num_bytes > bucket_bytes:
            packed.append(current)
            current, offset = [], 0
        current.append((index, offset))
        size = offset + spec.num_bytes
    if current:
        packed.append(current)
    return packed


def _buffer_bytes(specs: Sequence[TensorSpec], bucket: list[tuple[int, int]]) -> int:
    index, offset = bucket[-1]
    return offset + specs[index].num_bytes


def connect(spec: GroupSpec) -> dist.ProcessGroup:
    """Builds this member's process group; blocks until every member has joined (or the
    timeout passed: RuntimeError)."""
    host, _, port = spec.store_address.rpartition(":")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(spec.group_name, store)
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # On a failure or timeout abort the communicator and raise, rather than the default of
        # ending the whole process (a dead replica must not take the trainer down).
        before = os.environ.get(_NCCL_ERROR_HANDLING)
        os.environ[_NCCL_ERROR_HANDLING] = "2"
        try:
            group = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, options)
        finally:
            if before is None:
                del os.environ[_NCCL_ERROR_HANDLING]
            else:
                os.environ[_NCCL_ERROR_HANDLING] = before
    else:
        group = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, timeout)
    # Gloo and NCCL connect lazily; one tiny broadcast makes every member meet here.
    _broadcast(group, torch.zeros(1, dtype=torch.uint8, device=spec.device), spec.timeout_s)
    return group


def _broadcast(group: dist.ProcessGroup, buffer: torch.Tensor, timeout_s: float) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    work = group.broadcast([buffer], options)
    if not work.wait(datetime.timedelta(seconds=timeout_s)):
        raise RuntimeError(f"a broadcast did not complete within {timeout_s}s")


def _all_received(group: dist.ProcessGroup, spec: GroupSpec) -> None:
    """Every member's confirmation that the whole version arrived: one tiny all-reduce after the
    last buffer (rank 0 contributes 1 as well). A broadcast can return on rank 0 before a member
    that died shows up (gloo's sends land in socket buffers): this cannot, it fails (or times
    out) without every member."""
    flag = torch.ones(1, dtype=torch.int32, device=spec.device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    options.timeout = datetime.timedelta(seconds=spec.timeout_s)
    work = group.allreduce([flag], options)
    if not work.wait(datetime.timedelta(seconds=spec.timeout_s)):
        raise RuntimeError(f"the members did not confirm the version within {spec.timeout_s}s")
    if int(flag.item()) != spec.world_size:
        raise RuntimeError(f"{int(flag.item())} of {spec.world_size} members confirmed the version")


def send_tensors(
    group: dist.ProcessGroup,
    spec: GroupSpec,
    specs: Sequence[TensorSpec],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0: broadcasts `named_tensors` (in the order, and with the names, shapes and dtypes
    of `specs`), yielding each one once it is packed: a buffer goes out when it is full."""
    device = spec.device
    source = iter(named_tensors)
    for bucket in buckets(specs, spec.bucket_bytes):
        buffer = torch.empty(_buffer_bytes(specs, bucket), dtype=torch.uint8, device=device)
        for index, offset in bucket:
            expected = specs[index]
            item = next(source, None)
            if item is None:
                raise ValueError(f"{index} tensors came, {len(specs)} were announced")
            name, tensor = item
            if (name, tensor.dtype, tuple(tensor.shape)) != (expected.name, expected.dtype, expected.shape):
                raise ValueError(
                    f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, announced "
                    f"{expected.name!r} {expected.dtype} {list(expected.shape)}"
                )
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + expected.num_bytes].copy_(raw)
            yield name, tensor
        _broadcast(group, buffer, spec.timeout_s)
    if next(source, None) is not None:
        raise ValueError(f"more tensors than the {len(specs)} announced")
    _all_received(group, spec)


def receive_tensors(
    group: dist.ProcessGroup, spec: GroupSpec, specs: Sequence[TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..N: the tensors rank 0 broadcasts, as views of the received buffers."""
    device = spec.device
    for bucket in buckets(specs, spec.bucket_bytes):
        buffer = torch.empty(_buffer_bytes(specs, bucket), dtype=torch.uint8, device=device)
        _broadcast(group, buffer, spec.timeout_s)
        for index, offset in bucket:
            t = specs[index]
            yield t.name, buffer[offset : offset + t.num_bytes].view(t.dtype).view(t.shape)


class GroupCache:
    """The group of the latest generation this member joined: kept for the next versions while
    the broadcaster names the same group, replaced (the old one dropped) when it names
    another, and dropped after any failure."""

    def __init__(self) -> None:
        self._key: GroupSpec | None = None
        self._group: dist.ProcessGroup | None = None

    @property
    def holds_group(self) -> bool:
        return self._group is not None

    def get(self, spec: GroupSpec) -> dist.ProcessGroup:
        if self._key != spec or self._group is None:
            self.drop()
            self._group = connect(spec)
            self._key = spec
        return self._group

    def drop(self) -> None:
        group, self._group, self._key = self._group, None, None
        if group is not None and isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
            try:
                group.abort()
            except RuntimeError:
                logger.debug("aborting an NCCL group failed", exc_info=True)


class CollectiveReceiver:
    """A member's receiving side, in the engine process: `start` receives one version in a
    thread (generation goes on meanwhile), `poll` says when it is done, `take` hands over the
    tensors (the buffers stay on the receiving device)."""

    def __init__(self) -> None:
        self._groups = GroupCache()
        self._thread: threading.Thread | None = None
        self._result: list[tuple[str, torch.Tensor]] | None = None
        self._error = ""

    def start(self, spec: GroupSpec, specs: Sequence[TensorSpec]) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a collective receive is already running")
        self._result, self._error = None, ""
        device = spec.device

        def run() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                group = self._groups.get(spec)
                received = list(receive_tensors(group, spec, specs))
            except Exception as exc:  # reported through poll()
                self._groups.drop()
                self._error = f"{type(exc).__name__}: {exc}"
                return
            try:
                _all_received(group, spec)
            except RuntimeError as exc:
                # Another member failed: this one has every tensor, and loads them; the group is
                # not used again (rank 0 knows the broadcast failed, and forms a new one).
                logger.warning("every tensor arrived, then group %s failed: %s", spec.group_name, str(exc))
                self._groups.drop()
            self._result = received

        self._thread = threading.Thread(target=run, name="primerl-collective-receive", daemon=True)
        self._thread.start()

    def poll(self) -> str | None:
        """None while receiving; "" when the tensors arrived; the error otherwise."""
        if self._thread is None:
            return "no collective receive was started"
        if self._thread.is_alive():
            return None
        return self._error

    def take(self) -> list[tuple[str, torch.Tensor]]:
        if self.poll() != "" or self._result is None:
            raise RuntimeError("no received tensors to load")
        result, self._result = self._result, None
        return result
