"""LoRA adapters (PUBLISH_KIND_ADAPTER): the latest version of each adapter, and keeping every
replica on it.

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

Replicas get adapters over inference.v1 `LoadAdapter` (the spec, then the tensors as
chunks), whatever transport their full weights take: adapters are a few MB. Each replica's
task (replicas.py `_Worker`) calls `AdapterSync.sync` after every probe; it learns what a
replica process holds with `ListAdapters` once per instance id (a restarted replica holds
none), pushes each adapter it lacks, and backs off per adapter after a failure, so a failing
adapter push delays that replica's full-weight pushes by one bounded call at most.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
import torch

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_common.lora import ADAPTER_NAME_PATTERN, CAPABILITY_LORA, check_adapter_name
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.weights.manifest import ManifestError, load_tensors, read_manifest, write_weights
from primerl_weight_broadcaster import metrics

__all__ = [
    "AdapterStore",
    "AdapterSync",
    "PublishedAdapter",
    "check_adapter_begin",
    "published_adapter",
]

logger = logging.getLogger(__name__)

_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
_VERSION_FOLDER = re.compile(r"v(?P<version>\d+)")
# Longest LoadAdapter call: a hung replica holds its task (and its full-weight pushes) no longer.
_LOAD_TIMEOUT_S = 60.0


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


class AdapterStore:
    """The latest version of each adapter, in RAM and, with `folder`, on disk."""

    def __init__(self, folder: pathlib.Path | None = None) -> None:
        """With `folder`, starts on the adapters written there (blocking: it reads them)."""
        self._folder = folder
        self._latest: dict[str, PublishedAdapter] = {}
        self._writing = threading.Lock()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            for entry in sorted(folder.iterdir()):
                if not (entry.is_dir() and ADAPTER_NAME_PATTERN.fullmatch(entry.name)):
                    continue
                if (adapter := _load_latest(entry)) is not None:
                    self._latest[adapter.name] = adapter

    def latest(self) -> list[PublishedAdapter]:
        return list(self._latest.values())

    def latest_versions(self) -> dict[str, int]:
        return {name: adapter.policy_version for name, adapter in self._latest.items()}

    def owners_of(self, names: Iterable[str]) -> dict[str, str]:
        """The owner of each of the adapters `names` that has one."""
        return {name: adapter.owner for name in names if (adapter := self._latest.get(name)) and adapter.owner}

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
        """-1 when the adapter was never published."""
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


class AdapterSync:
    """Keeps one replica on every adapter's latest version; driven by its replica task.

    `held` is what the replica process holds (name -> version), reported through `on_change`
    (the task's `_set(adapter_versions=...)`, which makes it a WatchReplicas event)."""

    def __init__(
        self,
        replica_id: str,
        stub: inference_pb2_grpc.InferenceServiceStub,
        store: AdapterStore,
        *,
        retry_initial_s: float,
        retry_max_s: float,
        timeout_s: float,
        on_change: Callable[[dict[str, int]], None],
    ) -> None:
        self._replica_id = replica_id
        self._stub = stub
        self._store = store
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._timeout_s = min(timeout_s, _LOAD_TIMEOUT_S)
        self._on_change = on_change
        self.held: dict[str, int] = {}
        self._listed_instance: str | None = None  # the replica process whose adapters `held` lists
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}  # monotonic, per adapter name
        self._no_lora_logged = ""

    def forget(self) -> None:
        """The replica stopped answering: what it holds is unknown until it answers again."""
        self._listed_instance = None
        self._hold({})

    async def sync(self, instance_id: str, capabilities: frozenset[str]) -> None:
        """Pushes every adapter the replica process `instance_id` lacks; failures are logged and
        retried later (with backoff), never raised."""
        adapters = self._store.latest()
        if CAPABILITY_LORA not in capabilities:
            if adapters and self._no_lora_logged != instance_id:
                self._no_lora_logged = instance_id
                logger.warning("replica %s: no adapter pushed: it does not load LoRA adapters", self._replica_id)
            return
        now = time.monotonic()
        if instance_id != self._listed_instance:
            if now < self._retry_at.get("", 0.0) or not await self._attempt("", self._list()):
                return
            self._listed_instance = instance_id
        for adapter in adapters:
            if self.held.get(adapter.name, -1) >= adapter.policy_version:
                self._failures.pop(adapter.name, None)
            elif now >= self._retry_at.get(adapter.name, 0.0):
                await self._attempt(adapter.name, self._load(adapter))

    async def _attempt(self, name: str, call: Awaitable[None]) -> bool:
        """Awaits `call`; on failure logs it and backs off `name`'s pushes (""; the listing)."""
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            message = f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # any failure is retried: the task must go on
            message = repr(exc)
        else:
            self._failures.pop(name, None)
            self._retry_at.pop(name, None)
            return True
        failures = self._failures[name] = self._failures.get(name, 0) + 1
        backoff = min(self._retry_initial_s * 2 ** (failures - 1), self._retry_max_s)
        self._retry_at[name] = time.monotonic() + backoff
        metrics.adapter_push_failed(self._replica_id)
        what = f"pushing adapter {name}" if name else "listing its adapters"
        logger.warning(
            "replica %s: %s failed: %s (failure %d, retry in %.1fs)", self._replica_id, what, message, failures, backoff
        )
        return False

    async def _list(self) -> None:
        reply = await self._stub.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=self._timeout_s)
        self._hold({spec.name: spec.policy_version for spec in reply.adapters})

    async def _load(self, adapter: PublishedAdapter) -> None:
        started = time.monotonic()
        try:
            await self._stub.LoadAdapter(iter(adapter.requests()), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # "Not newer": it holds this version or a newer one already (another broadcaster
            # process pushed it). Any other precondition leaves it older: a failure.
            await self._list()
            if self.held.get(adapter.name, -1) < adapter.policy_version:
                raise
            logger.info(
                "replica %s holds adapter %s version %d already",
                self._replica_id,
                adapter.name,
                self.held[adapter.name],
            )
            return
        self._hold({**self.held, adapter.name: adapter.policy_version})
        metrics.adapter_pushed(self._replica_id)
        logger.info(
            "replica %s: pushed adapter %s version %d (owner %s, rank %d, %d tensors) in %.2fs",
            self._replica_id,
            adapter.name,
            adapter.policy_version,
            adapter.owner or "-",
            adapter.rank,
            len(adapter.tensors),
            time.monotonic() - started,
        )

    def _hold(self, held: dict[str, int]) -> None:
        if held != self.held:
            self.held = held
            self._on_change(dict(held))
