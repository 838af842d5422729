"""LoRA adapters (PUBLISH_KIND_ADAPTER): the latest version of each adapter, and the adapters
removed.

An adapter publish carries PEFT-named tensors (`base_model.model.<module>.lora_A.weight`
[rank, in] and `.lora_B.weight` [out, rank], paired per module). Versions count per adapter
name, apart from the full weights': an adapter publish never moves the full weights' latest
version, and a full publish never touches an adapter. With `store.spill_folder` set, each
adapter's latest version is also written to `<spill_folder>/adapters/<name>/v<version>` (a
primerl_common.weights.manifest folder, written aside and renamed into place) and loaded back
at start, so a restarted broadcaster still pushes it.

An adapter may belong to an identity (`PublishBegin.adapter_owner`, a run's owner on a trainer
with runs): replicas then serve it to that identity alone. The owner goes with each version
(its spilled folder too, so a restarted broadcaster keeps it) into every LoadAdapter push, and
binds the name: a publish of the same adapter by another owner (or by none, for an owned one)
is refused, so that one tenant cannot replace another's adapter.

A removed adapter (RemoveAdapter: a deleted run's) is forgotten, its spilled folder too
(renamed aside, then deleted: a broadcaster stopped midway deletes the rest at its next start and
never loads it back), and remembered as removed (its owner, and a serial that tells this removal
from an earlier one of the name), for the replicas to unload it (adapter_sync.py). A later
publish of its name starts afresh: any version, any owner. With a spill folder the removals are
kept in `<spill_folder>/adapters/.removals.json` (replaced atomically, between the renaming aside
and the deletion: a removal a stop interrupted is found by its folder renamed aside and recorded
at the next start), so that a replica that still held a removed adapter when the broadcaster
restarted gets it unloaded all the same; serials go on above the loaded ones. A removal is
remembered for good (a replica that was away may come back holding the adapter any time); a few
bytes each. Without a spill folder they are kept in RAM, and a restart forgets them.

Replicas get adapters from adapter_sync.py `AdapterSync`, one per replica.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import pathlib
import re
import shutil
import threading
import uuid
from collections.abc import Iterable

import torch

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.durable import replace_atomically
from primerl_common.errors import FailedPrecondition, InvalidArgument, NotFound
from primerl_common.lora import ADAPTER_NAME_PATTERN, check_adapter_name
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.weights.manifest import ManifestError, load_tensors, read_manifest, write_weights

__all__ = [
    "REMOVALS_FILE",
    "AdapterStore",
    "PublishedAdapter",
    "check_adapter_begin",
    "published_adapter",
]

logger = logging.getLogger(__name__)

_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
_VERSION_FOLDER = re.compile(r"v(?P<version>\d+)")
# A removed adapter's folder, renamed aside to be deleted (no adapter name starts with ".").
_REMOVED_PREFIX = ".removed-"
# The removals (AdapterStore.removals), beside the adapters' folders.
REMOVALS_FILE = ".removals.json"


def check_adapter_begin(begin: pb2.PublishBegin) -> None:
    """The fields of an adapter publish's `begin`, checked before anything is received."""
    check_adapter_name(begin.adapter_name, field="begin.adapter_name")
    _check_owner_name(begin.adapter_owner)
    if begin.adapter_rank <= 0:
        raise InvalidArgument("must be > 0 for an adapter", field="begin.adapter_rank")
    if not begin.adapter_alpha > 0:
        raise InvalidArgument(f"must be > 0 for an adapter, got {begin.adapter_alpha}", field="begin.adapter_alpha")
    if begin.num_stripes > 1 or begin.stripe_session:
        # Adapters are a few MB: one stream carries them fast enough.
        raise InvalidArgument("an adapter is published over a single stream", field="begin.num_stripes")


def _check_owner_name(owner: str) -> None:
    """An owner is an identity's name: the characters of an adapter name ("": no owner)."""
    if owner and ADAPTER_NAME_PATTERN.fullmatch(owner) is None:
        raise InvalidArgument(
            f"{owner!r} is not an identity name: 1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
            field="begin.adapter_owner",
        )


def _shown_owner(owner: str) -> str:
    return repr(owner) if owner else "no owner"


@dataclasses.dataclass(frozen=True)
class PublishedAdapter:
    """One version of one adapter; never modified once stored (pushes in flight read it)."""

    name: str
    policy_version: int
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    owner: str = ""  # the identity replicas serve it to alone; "": any caller

    def spec(self) -> inference_pb2.AdapterSpec:
        return inference_pb2.AdapterSpec(
            name=self.name,
            rank=self.rank,
            alpha=self.alpha,
            target_modules=list(self.target_modules),
            policy_version=self.policy_version,
            owner=self.owner,
        )

    def requests(self) -> list[inference_pb2.LoadAdapterRequest]:
        """The LoadAdapter stream: the spec, then the tensors."""
        chunks = iter_tensor_chunks(self.tensors.items())
        return [
            inference_pb2.LoadAdapterRequest(spec=self.spec()),
            *(inference_pb2.LoadAdapterRequest(chunk=chunk) for chunk in chunks),
        ]


def published_adapter(begin: pb2.PublishBegin, tensors: dict[str, torch.Tensor]) -> PublishedAdapter:
    """The adapter `tensors` make, checked: PEFT LoRA names, A and B paired per module, of the
    announced rank. Its target modules are the module leaves (`q_proj`), as PEFT lists them."""
    parts: dict[str, set[str]] = {}
    for name, tensor in tensors.items():
        match = _PEFT_NAME.fullmatch(name)
        if match is None:
            raise InvalidArgument(
                f"{name!r} is not a PEFT LoRA name (base_model.model.<module>.lora_A.weight or .lora_B.weight)",
                field="chunk.header.name",
            )
        rank_dim = 0 if match["part"] == "A" else 1
        if tensor.dim() != 2 or tensor.shape[rank_dim] != begin.adapter_rank:
            raise InvalidArgument(
                f"{name!r} has shape {list(tensor.shape)}, not of rank {begin.adapter_rank}",
                field="begin.adapter_rank",
            )
        parts.setdefault(match["module"], set()).add(match["part"])
    for module, found in parts.items():
        if found != {"A", "B"}:
            missing = ({"A", "B"} - found).pop()
            raise InvalidArgument(
                f"module {module!r} has no lora_{missing} (A and B come in pairs)", field="chunk.header.name"
            )
    return PublishedAdapter(
        name=begin.adapter_name,
        policy_version=begin.policy_version,
        rank=begin.adapter_rank,
        alpha=begin.adapter_alpha,
        target_modules=tuple(sorted({module.rsplit(".", 1)[-1] for module in parts})),
        tensors=tensors,
        owner=begin.adapter_owner,
    )


@dataclasses.dataclass(frozen=True)
class _Removal:
    serial: int  # tells this removal from an earlier one of the same name
    owner: str  # its latest version's, for the replicas that still hold it


class AdapterStore:
    """The latest version of each adapter, in RAM and, with `folder`, on disk; and the adapters
    removed (with `folder`, since the folder's first use; else since the start), for the
    replicas to unload."""

    def __init__(self, folder: pathlib.Path | None = None) -> None:
        """With `folder`, starts on the adapters and removals written there (blocking: it reads
        them)."""
        self._folder = folder
        self._latest: dict[str, PublishedAdapter] = {}
        self._removed: dict[str, _Removal] = {}
        # Made by `unspill` (off the event loop), stored by `remove` (on it).
        self._recorded: dict[str, _Removal] = {}
        self._writing = threading.Lock()
        if folder is None:
            self._removals = itertools.count(1)
            return
        folder.mkdir(parents=True, exist_ok=True)
        self._removed = _load_removals(folder / REMOVALS_FILE)
        self._removals = itertools.count(max((r.serial for r in self._removed.values()), default=0) + 1)
        interrupted = []
        for entry in sorted(folder.iterdir()):
            if entry.name.startswith(_REMOVED_PREFIX):  # a removal that a stop interrupted
                interrupted.append(entry)
                name = entry.name.removeprefix(_REMOVED_PREFIX).rsplit("-", 1)[0]
                if name not in self._removed and ADAPTER_NAME_PATTERN.fullmatch(name):
                    self._removed[name] = _Removal(next(self._removals), _spilled_owner(entry))
            elif entry.is_dir() and ADAPTER_NAME_PATTERN.fullmatch(entry.name) and (adapter := _load_latest(entry)):
                self._latest[adapter.name] = adapter
        if interrupted:
            try:
                self._write_removals(self._removed)  # before the folders that tell them go
            except OSError as exc:
                logger.error("recording the removals a stop interrupted failed (%s): retried at the next start", exc)
            else:
                for entry in interrupted:
                    shutil.rmtree(entry, ignore_errors=True)
        if self._removed:
            logger.info("%d removed adapters to keep off the replicas: %s", len(self._removed), sorted(self._removed))

    def latest(self) -> list[PublishedAdapter]:
        return list(self._latest.values())

    def latest_versions(self) -> dict[str, int]:
        return {name: adapter.policy_version for name, adapter in self._latest.items()}

    def owners_of(self, names: Iterable[str]) -> dict[str, str]:
        """The owner of each of the adapters `names` that has one (a removed one's, for the
        replicas that still hold it)."""
        return {
            name: held.owner
            for name in names
            if (held := self._latest.get(name) or self._removed.get(name)) and held.owner
        }

    def removals(self) -> dict[str, int]:
        """Each adapter removed since the start (published again or not), with the serial of
        its latest removal: a replica holding a copy older than that removal must unload it."""
        return {name: removal.serial for name, removal in self._removed.items()}

    def check_owner(self, name: str, owner: str) -> None:
        """Refuses a publish of adapter `name` by another owner than its latest version's: one
        tenant may not replace another's adapter (nor make it anyone's, nor claim an open one)."""
        adapter = self._latest.get(name)
        if adapter is None or adapter.owner == owner:
            return
        raise FailedPrecondition(
            f"adapter {name!r} belongs to {_shown_owner(adapter.owner)}, not to {_shown_owner(owner)}: "
            "an adapter keeps its owner, publish it under another name",
            subject="begin.adapter_owner",
            reason="ADAPTER_OWNER_MISMATCH",
            metadata={"adapter_name": name, "adapter_owner": adapter.owner, "requested_owner": owner},
        )

    def latest_version(self, name: str) -> int:
        """-1 when the adapter was never published (or removed since)."""
        adapter = self._latest.get(name)
        return -1 if adapter is None else adapter.policy_version

    def check_version(self, name: str, policy_version: int) -> None:
        """Refuses a version not newer than the adapter's latest (as store.py does full versions)."""
        if policy_version < 0:
            raise InvalidArgument(f"must be >= 0, got {policy_version}", field="begin.policy_version")
        latest = self.latest_version(name)
        if policy_version <= latest:
            raise FailedPrecondition(
                f"policy version {policy_version} is not newer than the latest published {latest} of adapter "
                f"{name!r}; a resumed trainer must publish versions above it",
                subject="begin.policy_version",
                reason="POLICY_VERSION_NOT_NEWER",
                metadata={"latest_policy_version": str(latest), "adapter_name": name},
            )

    def check_publish(self, name: str, policy_version: int, owner: str) -> None:
        """Refuses a publish of another owner first (a trainer takes "not newer" at its own
        version as already held), then a version not newer than the latest."""
        self.check_owner(name, owner)
        self.check_version(name, policy_version)

    def make_latest(self, adapter: PublishedAdapter) -> None:
        """Stores `adapter` as its name's latest (on the event loop: pushes read it)."""
        self.check_publish(adapter.name, adapter.policy_version, adapter.owner)
        self._latest[adapter.name] = adapter

    def held(self, name: str) -> PublishedAdapter:
        """The latest version of adapter `name`; NotFound when there is none."""
        adapter = self._latest.get(name)
        if adapter is None:
            raise NotFound(
                f"the weight broadcaster holds no adapter {name!r}: never published, or removed already",
                reason="ADAPTER_NOT_FOUND",
                metadata={"adapter_name": name},
            )
        return adapter

    def remove(self, name: str) -> PublishedAdapter:
        """Forgets adapter `name` (on the event loop, after `unspill`): its latest version, owner
        and version floor go, and replicas unload it. NotFound when it is not held."""
        adapter = self.held(name)
        removal = self._recorded.pop(name, None) or _Removal(next(self._removals), adapter.owner)
        del self._latest[name]
        self._removed[name] = removal
        return adapter

    def unspill(self, name: str) -> None:
        """Deletes adapter `name`'s spilled folder and records its removal on disk (blocking;
        `remove` makes it count): the folder is renamed aside first, so that a stop midway leaves
        nothing a restart loads, and the removal a restart still knows. Raises OSError when the
        folder cannot be renamed or the removal not recorded (the folder is then put back)."""
        if self._folder is None:
            return
        adapter = self._latest.get(name)
        removal = _Removal(next(self._removals), adapter.owner if adapter is not None else "")
        spilled = self._folder / name
        aside = self._folder / f"{_REMOVED_PREFIX}{name}-{uuid.uuid4().hex}"
        with self._writing:
            try:
                spilled.rename(aside)
                moved = True
            except FileNotFoundError:  # never spilled (or its writes failed)
                moved = False
            try:
                self._write_removals({**self._removed, name: removal})
            except OSError:
                if moved:
                    aside.rename(spilled)
                raise
            self._recorded[name] = removal
            if moved:
                shutil.rmtree(aside, ignore_errors=True)
                logger.info("deleted the spilled copy of adapter %s", name)

    def _write_removals(self, removed: dict[str, _Removal]) -> None:
        assert self._folder is not None
        records = {name: dataclasses.asdict(removal) for name, removal in sorted(removed.items())}
        replace_atomically(self._folder / REMOVALS_FILE, json.dumps({"removed": records}, indent=1) + "\n")

    def spill(self, adapter: PublishedAdapter) -> None:
        """Writes `adapter` to the folder, then deletes that adapter's older folders (blocking).
        A failed write is logged: the adapter stays in RAM, and a restart loads the older one."""
        if self._folder is None:
            return
        folder = self._folder / adapter.name
        path = folder / f"v{adapter.policy_version:010d}"
        with self._writing:
            try:
                if path.exists():  # a half-written folder of an earlier process
                    shutil.rmtree(path)
                write_weights(
                    path,
                    adapter.tensors.items(),
                    policy_version=adapter.policy_version,
                    weight_format=tensor_pb2.WEIGHT_FORMAT_HF,
                    metadata={"rank": adapter.rank, "alpha": adapter.alpha, "owner": adapter.owner},
                )
            except (OSError, RuntimeError) as exc:
                logger.error("spilling adapter %s version %d failed: %s", adapter.name, adapter.policy_version, exc)
                return
            for entry in folder.iterdir():
                if entry != path:
                    shutil.rmtree(entry, ignore_errors=True)
        logger.info("spilled adapter %s version %d to %s", adapter.name, adapter.policy_version, path)


def _load_removals(path: pathlib.Path) -> dict[str, _Removal]:
    """The removals `AdapterStore._write_removals` wrote; none when there is no file. One that
    does not load is logged (the adapters it named may stay on replicas that held them)."""
    try:
        records = json.loads(path.read_bytes())["removed"]
        removed = {
            name: _Removal(int(record["serial"]), str(record["owner"]))
            for name, record in records.items()
            if ADAPTER_NAME_PATTERN.fullmatch(name)
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.error("%s does not load (%s): the adapters removed before are not unloaded from replicas", path, exc)
        return {}
    return removed


def _spilled_owner(folder: pathlib.Path) -> str:
    """The owner a spilled adapter's folder names (of its newest version that says); "" if none."""
    for entry in sorted(folder.iterdir(), reverse=True):
        try:
            owner = read_manifest(entry, verify_checksums=False).metadata.get("owner", "")
        except (ManifestError, OSError, ValueError):
            continue
        if isinstance(owner, str) and owner:
            return owner
    return ""


def _load_latest(folder: pathlib.Path) -> PublishedAdapter | None:
    """The newest complete version in an adapter's folder; None when there is none. A version
    spilled before adapters had owners has none."""
    versions = sorted(
        (int(match["version"]) for entry in folder.iterdir() if (match := _VERSION_FOLDER.fullmatch(entry.name))),
        reverse=True,
    )
    for policy_version in versions:
        path = folder / f"v{policy_version:010d}"
        try:
            manifest = read_manifest(path)
            begin = pb2.PublishBegin(
                policy_version=manifest.policy_version,
                adapter_name=folder.name,
                adapter_rank=int(manifest.metadata["rank"]),  # type: ignore[call-overload]
                adapter_alpha=float(manifest.metadata["alpha"]),  # type: ignore[arg-type]
                adapter_owner=manifest.metadata.get("owner", ""),  # type: ignore[arg-type]
            )
            _check_owner_name(begin.adapter_owner)
            adapter = published_adapter(begin, dict(load_tensors(path, manifest)))
        except (ManifestError, InvalidArgument, KeyError, TypeError, ValueError) as exc:
            logger.warning("ignoring %s, not a complete spilled adapter: %s", path, exc)
            continue
        logger.info(
            "loaded adapter %s version %d (owner %s) from %s", adapter.name, policy_version, adapter.owner or "-", path
        )
        return adapter
    return None
