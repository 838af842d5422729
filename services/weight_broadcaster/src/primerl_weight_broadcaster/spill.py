"""The store's copy on disk (`store.spill_folder`): each published version, as published (HF
names), written as a primerl_common.weights.manifest folder with the version each tensor last
changed, and held from then on as memory-mapped views of those files instead of RAM copies.
At start, the newest complete folder is loaded back, so a restarted broadcaster holds the
current version at once.

Folders are named `spill-v<version>`. write_weights writes each aside and renames it into
place, so a crash never leaves a folder that looks complete; one without its manifest, or whose
files fail their checksums, is skipped at start. After each write the folders of the two newest
versions are kept (the newest, and the one before in case the newest is damaged) and the rest
deleted: a push in flight that still reads a deleted version's mapped files is not disturbed
(the files' data lives until they are unmapped).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pathlib
import re
import shutil
import threading

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.weights.manifest import ManifestError, WeightManifest, load_tensors, read_manifest, write_weights

__all__ = ["SpillFolder", "SpilledVersion"]

logger = logging.getLogger(__name__)

_KEEP_VERSIONS = 2
# A published folder, or write_weights' hidden staging folder beside it.
_FOLDER = re.compile(r"^\.?spill-v(?P<version>\d+)(\.tmp-[0-9a-f]+)?$")


@dataclasses.dataclass(frozen=True)
class SpilledVersion:
    policy_version: int
    tensors: dict[str, torch.Tensor]  # views of the folder's files, in the order published
    last_changed: dict[str, int]
    first_policy_version: int
    model_type: str = ""


class SpillFolder:
    """Blocking file work: call it off the event loop."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self._kept: collections.deque[int] = collections.deque(maxlen=_KEEP_VERSIONS)
        # One write at a time, also when a publisher went away mid-write and the next publish
        # (its retry, say) starts while that write's thread still runs.
        self._writing = threading.Lock()

    def path(self, policy_version: int) -> pathlib.Path:
        return self.root / f"spill-v{policy_version:010d}"

    def write(self, version: SpilledVersion) -> SpilledVersion:
        """`version` written to its folder; the same version with its tensors mapped from the files."""
        with self._writing:
            return self._write(version)

    def _write(self, version: SpilledVersion) -> SpilledVersion:
        path = self.path(version.policy_version)
        if path.exists():  # damaged, from an earlier process, or the write of a publisher that went away
            shutil.rmtree(path)
        manifest = write_weights(
            path,
            version.tensors.items(),
            policy_version=version.policy_version,
            weight_format=tensor_pb2.WEIGHT_FORMAT_HF,
            metadata={
                "last_changed": version.last_changed,
                "first_policy_version": version.first_policy_version,
                "model_type": version.model_type,
            },
        )
        mapped = dict(load_tensors(path, manifest))
        if version.policy_version not in self._kept:
            self._kept.append(version.policy_version)
        self._prune()
        logger.info(
            "spilled policy version %d to %s (%.1f MiB)", version.policy_version, path, manifest.num_bytes / 2**20
        )
        return dataclasses.replace(version, tensors={name: mapped[name] for name in version.tensors})

    def load_latest(self) -> SpilledVersion | None:
        """The newest complete version in the folder, mapped; None when there is none."""
        versions = {int(match["version"]) for entry in self.root.iterdir() if (match := _FOLDER.match(entry.name))}
        for policy_version in sorted(versions, reverse=True):
            path = self.path(policy_version)
            if not path.is_dir():
                continue  # a staging folder only
            try:
                version = _loaded(path, read_manifest(path), policy_version)
            except (ManifestError, KeyError, TypeError, ValueError) as exc:
                logger.warning("ignoring %s, not a complete spilled version: %s", path, exc)
                continue
            self._kept.append(policy_version)
            logger.info("loaded policy version %d from %s", policy_version, path)
            return version
        return None

    def _prune(self) -> None:
        """Deletes every folder (and staging folder) but those of the kept versions."""
        kept = {self.path(policy_version).name for policy_version in self._kept}
        for entry in self.root.iterdir():
            if _FOLDER.match(entry.name) and entry.name not in kept and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("deleted %s", entry)


def _loaded(path: pathlib.Path, manifest: WeightManifest, policy_version: int) -> SpilledVersion:
    if manifest.policy_version != policy_version or manifest.weight_format != tensor_pb2.WEIGHT_FORMAT_HF:
        raise ManifestError(f"holds policy version {manifest.policy_version}, format {manifest.weight_format}")
    if manifest.delta:
        raise ManifestError("holds a delta")
    last_changed = {str(name): int(version) for name, version in manifest.metadata["last_changed"].items()}
    tensors = dict(load_tensors(path, manifest))
    if set(tensors) != set(last_changed):
        raise ManifestError("its tensors are not those its last_changed map names")
    return SpilledVersion(
        policy_version=policy_version,
        tensors={name: tensors[name] for name in last_changed},
        last_changed=last_changed,
        first_policy_version=int(manifest.metadata["first_policy_version"]),
        model_type=str(manifest.metadata.get("model_type", "")),
    )
