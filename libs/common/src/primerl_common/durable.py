"""Files that survive a crash: data reaches the disk before it becomes visible under its
name, and a rename is made durable in its folder."""

from __future__ import annotations

import os
import pathlib

__all__ = ["fsync_dir", "replace_atomically", "write_synced"]


def write_synced(path: pathlib.Path, data: bytes | str) -> None:
    """Writes `path` and waits until its bytes are on the disk."""
    with open(path, "wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(directory: pathlib.Path) -> None:
    """Makes the entries of `directory` (files created or renamed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: pathlib.Path, data: bytes | str) -> None:
    """Replaces `path` by a file holding `data`: after a crash, readers find the old content
    or the new, never a mix or nothing."""
    aside = path.with_name(f".{path.name}.tmp")
    write_synced(aside, data)
    os.replace(aside, path)
    fsync_dir(path.parent)
