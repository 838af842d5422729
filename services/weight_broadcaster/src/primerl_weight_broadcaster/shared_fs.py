"""The shared-filesystem transport: each version written once per format (and per delta base)
into a folder of the configured root, which replicas read (primerl_common.weights.manifest).

Folders are named `v<version>-<format>` (full) or `v<version>-<format>-delta<base>`, written
aside and renamed into place by `write_weights`, so a replica never sees a partial folder.
The root belongs to the broadcaster: it keeps the folders of the `keep_versions` newest
versions, and older ones once no push in flight names them; a folder left by an earlier
process (or a staging folder of a crashed write) is replaced or removed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import pathlib
import re
import shutil
from collections.abc import AsyncIterator

from primerl_common.weights.manifest import WeightManifest, write_weights
from primerl_weight_broadcaster.formats import format_name
from primerl_weight_broadcaster.store import PublishedVersion

__all__ = ["SharedFolders"]

logger = logging.getLogger(__name__)

# A published folder, or write_weights' hidden staging folder beside it.
_FOLDER = re.compile(r"^\.?v(?P<version>\d+)-[a-z0-9_]+(-delta\d+)?(\.tmp-[0-9a-f]+)?$")


class SharedFolders:
    def __init__(self, root: pathlib.Path, *, keep_versions: int) -> None:
        self.root = root
        self.keep_versions = keep_versions
        # Folder name -> its write (shared by every replica that needs it) and number of pushes naming it.
        self._writes: dict[str, asyncio.Future[WeightManifest]] = {}
        self._uses: collections.Counter[str] = collections.Counter()
        # The latest pruning, which runs once no push is in flight (deleting a version frees its
        # pages, CPU that the replicas loading the next one would otherwise compete with).
        self._pruning: asyncio.Future[None] | None = None

    @contextlib.asynccontextmanager
    async def use(
        self, version: PublishedVersion, base_policy_version: int | None
    ) -> AsyncIterator[tuple[pathlib.Path, WeightManifest]]:
        """The folder holding `version` (a delta from `base_policy_version` when given), written
        if it is not yet; it is not deleted while the block runs (a replica loads from it)."""
        name = f"v{version.policy_version:010d}-{format_name(version.format)}"
        if base_policy_version is not None:
            name += f"-delta{base_policy_version:010d}"
        self._uses[name] += 1
        try:
            write = self._writes.get(name)
            if write is None or (write.done() and write.exception() is not None):
                write = asyncio.ensure_future(asyncio.to_thread(self._write, name, version, base_policy_version))
                self._writes[name] = write
            # Shielded: a replica task cancelled mid-wait does not cancel the write the others wait for.
            manifest = await asyncio.shield(write)
            yield self.root / name, manifest
        finally:
            self._uses[name] -= 1
            if not self._uses[name]:
                del self._uses[name]
            if not self._uses:
                self._pruning = asyncio.ensure_future(self._prune_after(self._pruning))

    async def pruned(self) -> None:
        """Returns once the pruning started by the last push to end is done."""
        if self._pruning is not None:
            await asyncio.shield(self._pruning)

    async def _prune_after(self, previous: asyncio.Future[None] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        try:
            await asyncio.to_thread(self.prune)
        except OSError as exc:  # the folder went (the broadcaster stops)
            logger.warning("pruning %s failed: %s", self.root, exc)

    def _write(self, name: str, version: PublishedVersion, base_policy_version: int | None) -> WeightManifest:
        path = self.root / name
        if path.exists():  # left by an earlier process: its content is not known to be this version's
            shutil.rmtree(path)
        manifest = write_weights(
            path,
            version.tensors_since(base_policy_version),
            policy_version=version.policy_version,
            weight_format=version.format,
            delta=base_policy_version is not None,
            base_policy_version=base_policy_version or 0,
        )
        logger.info("wrote %s: %d tensors, %.1f MiB", path, manifest.num_tensors, manifest.num_bytes / 2**20)
        return manifest

    def prune(self) -> None:
        """Deletes folders older than the `keep_versions` newest versions, unless a push names them."""
        entries = [(entry, _FOLDER.match(entry.name)) for entry in self.root.iterdir()]
        ours = [(entry, int(match["version"])) for entry, match in entries if match and entry.is_dir()]
        versions = sorted({version for entry, version in ours if not entry.name.startswith(".")}, reverse=True)
        kept = set(versions[: self.keep_versions])
        in_flight = {name for name, write in self._writes.items() if not write.done()}
        for entry, version in ours:
            published = entry.name.split(".tmp-")[0].lstrip(".")
            staging = published != entry.name
            if published in in_flight or (not staging and (version in kept or published in self._uses)):
                continue
            shutil.rmtree(entry, ignore_errors=True)
            self._writes.pop(published, None)
            logger.info("deleted %s", entry)
