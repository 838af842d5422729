"""The same-host transport (TRANSPORT_SHM): each version placed once in shared memory, which
replicas on this host load from directly; UpdateWeights carries only the folder's path.

The broadcaster keeps a folder of its own in the shared-memory filesystem `shm.folder`
(tmpfs, /dev/shm by default), named `primerl-weight-broadcaster-<id>`, locked (flock) while
it runs and removed when it stops; one left by a broadcaster that died is removed by the next
one to start on the host. Version folders in it are those of shared_fs.py (`v<version>-<format>`,
`-delta<base>`), in the raw format of primerl_common.weights.shared_memory.

A publish is received straight into a data file of this folder (`ShmReceiver`) while some
replica takes this transport: the version's bytes are written once, as they arrive, and the
store holds views of them; its HF folder then links those files (no copy), as does a delta
folder. Other formats, and a version received before (or while there was no room), are
written into their folder once, by the first push that needs them.

Whether a replica shares this memory is decided from what it advertises (`route`): the same
kernel boot id, and the same identity (device and inode) of its shared-memory folder as this
one's; its folder's path then names the files in its own view. A push over it that fails is
made again over gRPC (pusher.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Mapping

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.tensors import FileTensorAssembler
from primerl_common.weights.manifest import ManifestTensor, WeightManifest
from primerl_common.weights.shared_memory import (
    ALIGNMENT,
    ATTRIBUTE_BOOT_ID,
    ATTRIBUTE_SHM_FOLDER,
    ATTRIBUTE_SHM_ID,
    METADATA_FINITE,
    all_finite,
    boot_id,
    link_weights,
    shm_id,
    write_raw_weights,
)
from primerl_weight_broadcaster.shared_fs import SharedFolders
from primerl_weight_broadcaster.store import PublishedVersion, ShmFile, ShmPlacement

__all__ = ["SharedMemory", "ShmReceiver"]

logger = logging.getLogger(__name__)

_PREFIX = "primerl-weight-broadcaster-"
_LOCK = ".lock"
# A folder younger than this without its lock file may be one being made.
_NEW_FOLDER_S = 60.0
# Room kept free in the shared-memory filesystem beyond a publish's announced bytes.
_FREE_MARGIN_BYTES = 256 * 1024 * 1024


class ShmReceiver:
    """One publish stream received into a raw data file of the broadcaster's folder: each
    chunk's bytes written once as they arrive. `finish` gives the tensors (views of the
    file) and where they lie; `close` removes the file of a stream that did not finish."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.path = folder / f".incoming-{uuid.uuid4().hex}"
        self._file = open(self.path, "xb", buffering=0)  # noqa: SIM115 (closed by finish or close)
        self.assembler = FileTensorAssembler(self._file, alignment=ALIGNMENT)
        self._finished = False

    def finish(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], ShmPlacement]:
        """`tensors` as the assembler returned them (dtype and shape only), as views of the file."""
        size = self._file.tell()
        self._file.close()
        self._finished = True
        name = self.path.name
        placement = ShmPlacement(
            {name: ShmFile(self.path)},
            {
                tensor_name: ManifestTensor(
                    tensor_name,
                    name,
                    meta.dtype,
                    tuple(meta.shape),
                    self.assembler.offsets[tensor_name],
                    meta.numel() * meta.element_size(),
                )
                for tensor_name, meta in tensors.items()
            },
        )
        data = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8) if size else None
        views = {}
        for tensor_name, t in placement.tensors.items():
            raw = torch.empty(0, dtype=torch.uint8) if data is None else data[t.offset : t.offset + t.num_bytes]
            views[tensor_name] = raw.view(t.dtype).view(t.shape)
        # Checked once here, for every replica that loads the version (each would read it all again).
        return views, dataclasses.replace(placement, finite=all_finite(views.values()))

    def close(self) -> None:
        if not self._finished:
            self._file.close()
            _unlink(self.path)
            self._finished = True


class SharedMemory(SharedFolders):
    """The broadcaster's folder in the shared-memory filesystem `parent` (created here; `close`
    removes it), its version folders, and which replicas read it."""

    def __init__(self, parent: pathlib.Path, *, keep_versions: int) -> None:
        _remove_abandoned(parent)
        root = parent / f"{_PREFIX}{uuid.uuid4().hex[:12]}"
        root.mkdir(mode=0o700)
        self._lock = os.open(root / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        super().__init__(root, keep_versions=keep_versions)
        self.parent = parent
        self.boot_id = boot_id()
        self.identity = shm_id(parent)
        logger.info("shared-memory folder %s", root)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        os.close(self._lock)

    def route(self, attributes: Mapping[str, str]) -> tuple[pathlib.Path | None, str]:
        """(this folder as the replica with these GetServiceInfo attributes sees it, or None
        where it does not share this memory; why)."""
        if not self.identity:
            return None, "the broadcaster's host has no boot id to tell replicas of its host by"
        boot = attributes.get(ATTRIBUTE_BOOT_ID, "")
        if boot != self.boot_id:
            return None, "another host (its boot id differs)" if boot else "the replica names no boot id"
        if attributes.get(ATTRIBUTE_SHM_ID, "") != self.identity:
            return None, f"same host, but its shared-memory folder is not {self.parent} (a container's own /dev/shm?)"
        folder = pathlib.PurePath(attributes.get(ATTRIBUTE_SHM_FOLDER, ""))
        if not folder.is_absolute():
            return None, "the replica names no shared-memory folder"
        return pathlib.Path(folder) / self.root.name, f"same host and shared memory ({folder})"

    def receiver(self, num_bytes: int) -> ShmReceiver | None:
        """A receiver for a publish of `num_bytes` (announced), when they fit; None otherwise."""
        if not num_bytes:
            return None
        try:
            free = os.statvfs(self.root)
            if free.f_bavail * free.f_frsize < num_bytes + _FREE_MARGIN_BYTES:
                logger.warning(
                    "no room in %s for a publish of %.1f MiB: received into RAM", self.root, num_bytes / 2**20
                )
                return None
            return ShmReceiver(self.root)
        except OSError as exc:
            logger.warning("cannot receive into %s (%s): received into RAM", self.root, exc)
            return None

    def _write(self, name: str, version: PublishedVersion, base_policy_version: int | None) -> WeightManifest:
        path = self.root / name
        tensors = version.tensors_since(base_policy_version)
        fields = {
            "policy_version": version.policy_version,
            "weight_format": version.format,
            "delta": base_policy_version is not None,
            "base_policy_version": base_policy_version or 0,
        }
        placement = version.placement
        started = time.monotonic()
        if (
            version.format == tensor_pb2.WEIGHT_FORMAT_HF
            and placement is not None
            and all(tensor_name in placement.tensors for tensor_name, _ in tensors)
        ):
            files = {file_name: f.path for file_name, f in placement.files.items()}
            metadata = {METADATA_FINITE: True} if placement.finite else {}
            manifest = link_weights(
                path, files, [placement.tensors[n] for n, _ in tensors], metadata=metadata, **fields
            )
            how = "linked"
        else:
            metadata = {METADATA_FINITE: True} if all_finite(t for _, t in tensors) else {}
            manifest = write_raw_weights(path, tensors, metadata=metadata, **fields)
            how = "written"
        logger.info(
            "%s %s: %d tensors, %.1f MiB in %.3fs",
            how,
            path,
            manifest.num_tensors,
            manifest.num_bytes / 2**20,
            time.monotonic() - started,
        )
        return manifest


def _unlink(path: pathlib.Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _remove_abandoned(parent: pathlib.Path) -> None:
    """Removes the folders of broadcasters that died on this host (their lock is free)."""
    for folder in parent.glob(f"{_PREFIX}*"):
        try:
            lock = os.open(folder / _LOCK, os.O_RDWR)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - folder.stat().st_mtime > _NEW_FOLDER_S:
                    shutil.rmtree(folder, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its broadcaster runs
        finally:
            os.close(lock)
        logger.info("removing %s, left by a broadcaster that is gone", folder)
        shutil.rmtree(folder, ignore_errors=True)
