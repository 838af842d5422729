"""The disk tier: one file per block, written aside and renamed into place, checked on read.

File layout (integers little-endian):

    b"PRKVBLK1" | header length u32 | BlockHeader (key, num_bytes, routed_experts) | data | crc32 u32

The crc32 covers the header and the data. A block file appears under `blocks/` only
by an atomic rename of a complete (and, with fsync on, durable) file from `tmp/`, so a
crash never leaves a half-written block where it could be served; leftovers in `tmp/`
are deleted at start. The index is rebuilt at start by reading each file's header
(least recently used first, by modification time, which reads refresh).

`write` and `read` block on file I/O: callers run them in a worker thread. The index
(`entries`) is changed only on the event loop.
"""

from __future__ import annotations

import logging
import os
import pathlib
import struct
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.durable import fsync_dir
from primerl_common.kvpool.keys import BlockKey

__all__ = ["CorruptBlockError", "DiskEntry", "DiskTier"]

logger = logging.getLogger(__name__)

_MAGIC = b"PRKVBLK1"
_LENGTH = struct.Struct("<I")
_PREFIX_BYTES = len(_MAGIC) + _LENGTH.size
_TRAILER_BYTES = 4
_SUFFIX = ".blk"


class CorruptBlockError(Exception):
    """A block file whose checksum or layout is wrong (it is deleted)."""


@dataclass(eq=False)
class DiskEntry:
    key: BlockKey
    num_bytes: int
    path: pathlib.Path


class DiskTier:
    def __init__(self, root: str | os.PathLike[str], *, capacity_bytes: int, fsync: bool = True) -> None:
        self.root = pathlib.Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._blocks = self.root / "blocks"
        self._tmp = self.root / "tmp"
        # Least recently used first.
        self.entries: OrderedDict[BlockKey, DiskEntry] = OrderedDict()
        self.used_bytes = 0

    # ------------------------------------------------------------------ index (event loop only)

    def load(self) -> int:
        """Rebuilds the index from the files; returns the number of blocks found."""
        self._blocks.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
        found = []
        for path in self._blocks.glob(f"*/*{_SUFFIX}"):
            try:
                header, stat = self._read_header(path)
                key = BlockKey.from_proto(header.key)
            except Exception as exc:  # unreadable, truncated or a malformed key: never served
                logger.warning("dropping unreadable block file %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, DiskEntry(key, header.num_bytes, path)))
        self.entries.clear()
        self.used_bytes = 0
        for _, entry in sorted(found, key=lambda item: item[0]):
            self.add(entry)
        return len(self.entries)

    def add(self, entry: DiskEntry) -> None:
        old = self.entries.pop(entry.key, None)
        if old is not None:
            self.used_bytes -= old.num_bytes
        self.entries[entry.key] = entry
        self.used_bytes += entry.num_bytes

    def discard(self, key: BlockKey) -> DiskEntry | None:
        """Forgets a block and deletes its file; a read in progress keeps its open file."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.num_bytes
            entry.path.unlink(missing_ok=True)
        return entry

    def touch(self, key: BlockKey) -> None:
        self.entries.move_to_end(key)

    def path_for(self, key: BlockKey) -> pathlib.Path:
        stem = key.file_stem()
        return self._blocks / stem[:2] / f"{stem}{_SUFFIX}"

    # ------------------------------------------------------------------ file I/O (worker threads)

    def write(self, key: BlockKey, header: kvstore_pb2.BlockHeader, data: Iterable[memoryview]) -> DiskEntry:
        """Writes a block file aside, then renames it into place."""
        stored_header = kvstore_pb2.BlockHeader(key=header.key, num_bytes=header.num_bytes)
        if header.HasField("routed_experts"):
            stored_header.routed_experts.CopyFrom(header.routed_experts)
        header_bytes = stored_header.SerializeToString()
        path = self.path_for(key)
        tmp = self._tmp / f"{uuid.uuid4().hex}.tmp"
        crc = zlib.crc32(header_bytes)
        num_written = 0
        try:
            with open(tmp, "wb") as out:
                out.write(_MAGIC + _LENGTH.pack(len(header_bytes)))
                out.write(header_bytes)
                for piece in data:
                    out.write(piece)
                    crc = zlib.crc32(piece, crc)
                    num_written += len(piece)
                out.write(_LENGTH.pack(crc))
                if num_written != header.num_bytes:
                    raise ValueError(f"block {key}: {num_written} data bytes, header says {header.num_bytes}")
                if self.fsync:
                    out.flush()
                    os.fsync(out.fileno())
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            fsync_dir(path.parent)
        return DiskEntry(key, header.num_bytes, path)

    def read(self, entry: DiskEntry) -> tuple[kvstore_pb2.BlockHeader, memoryview]:
        """The block's header and data, checksum verified. FileNotFoundError when it was
        removed meanwhile; CorruptBlockError (the file is deleted) when it does not check out."""
        raw = entry.path.read_bytes()
        try:
            header = self._parse(raw, entry.path)
        except CorruptBlockError:
            entry.path.unlink(missing_ok=True)
            raise
        os.utime(entry.path)  # least-recently-used order survives a restart
        header_end = _PREFIX_BYTES + _LENGTH.unpack_from(raw, len(_MAGIC))[0]
        return header, memoryview(raw)[header_end : header_end + header.num_bytes]

    def _parse(self, raw: bytes, path: pathlib.Path) -> kvstore_pb2.BlockHeader:
        if len(raw) < _PREFIX_BYTES + _TRAILER_BYTES or raw[: len(_MAGIC)] != _MAGIC:
            raise CorruptBlockError(f"{path}: not a block file")
        (header_len,) = _LENGTH.unpack_from(raw, len(_MAGIC))
        header_end = _PREFIX_BYTES + header_len
        try:
            header = kvstore_pb2.BlockHeader.FromString(raw[_PREFIX_BYTES:header_end])
        except Exception:
            raise CorruptBlockError(f"{path}: unreadable header") from None
        if len(raw) != header_end + header.num_bytes + _TRAILER_BYTES:
            raise CorruptBlockError(f"{path}: {len(raw)} bytes, header says {header.num_bytes} of data")
        (crc,) = _LENGTH.unpack_from(raw, len(raw) - _TRAILER_BYTES)
        if zlib.crc32(memoryview(raw)[_PREFIX_BYTES : len(raw) - _TRAILER_BYTES]) != crc:
            raise CorruptBlockError(f"{path}: checksum mismatch")
        return header

    def _read_header(self, path: pathlib.Path) -> tuple[kvstore_pb2.BlockHeader, os.stat_result]:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            prefix = f.read(_PREFIX_BYTES)
            if len(prefix) != _PREFIX_BYTES or prefix[: len(_MAGIC)] != _MAGIC:
                raise CorruptBlockError("not a block file")
            (header_len,) = _LENGTH.unpack_from(prefix, len(_MAGIC))
            try:
                header = kvstore_pb2.BlockHeader.FromString(f.read(header_len))
            except Exception:
                raise CorruptBlockError("unreadable header") from None
        if stat.st_size != _PREFIX_BYTES + header_len + header.num_bytes + _TRAILER_BYTES:
            raise CorruptBlockError(f"{stat.st_size} bytes, header says {header.num_bytes} of data")
        return header, stat
