"""Keeping one replica on the adapters of the AdapterStore (adapters.py): the latest version of
each pushed, the removed ones unloaded.

Replicas get adapters over inference.v1 `LoadAdapter` (the spec, then the tensors as
chunks), whatever transport their full weights take: adapters are a few MB. Each replica's
task (pusher.py `ReplicaPusher`) calls `AdapterSync.sync` after every probe; it learns what a
replica process holds with `ListAdapters` once per instance id (a restarted replica holds
none), pushes each adapter it lacks, and backs off per adapter after a failure, so a failing
adapter push delays that replica's full-weight pushes by one bounded call at most.

An adapter this broadcaster removed (RemoveAdapter, `AdapterStore.remove`) is unloaded
(`UnloadAdapter`; NOT_FOUND: not held, done) from every replica process that lists it: the
ones that held it then, and any that registers or comes back later still holding it. Adapters
it did not remove are never unloaded. Until a process is clear of a removal, the name is not
pushed to it again (a publish after the removal starts the name afresh, possibly at a lower
version or for another owner, which the old copy would refuse or be mistaken for); a process
that restarted still listing a removed name that was published again gets it unloaded and
pushed again, as nothing tells its copy from the old one. The removals outlive a restart of the
broadcaster when it has a spill folder (adapters.py); a restarted broadcaster knows of no process
as clear of any, so each replica holding a removed name then gets it unloaded (and pushed again
if the name was published again since: its copy may be the old one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.lora import CAPABILITY_LORA
from primerl_weight_broadcaster import metrics
from primerl_weight_broadcaster.adapters import AdapterStore, PublishedAdapter

__all__ = ["AdapterSync"]

logger = logging.getLogger(__name__)

# Longest LoadAdapter call: a hung replica holds its task (and its full-weight pushes) no longer.
_LOAD_TIMEOUT_S = 60.0


class AdapterSync:
    """Keeps one replica on every adapter's latest version, and clear of removed ones; driven
    by its replica task.

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
        # The removals (name -> AdapterStore.removals() serial) the process `_cleared_instance`
        # is known to be clear of: it held no older copy, or that copy was unloaded.
        self._cleared: dict[str, int] = {}
        self._cleared_instance = ""
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}  # monotonic, per adapter name
        self._no_lora_logged = ""

    def forget(self) -> None:
        """The replica stopped answering: what it holds is unknown until it answers again."""
        self._listed_instance = None
        self._hold({})

    async def sync(self, instance_id: str, capabilities: frozenset[str]) -> None:
        """Unloads the removed adapters the replica process `instance_id` holds, then pushes
        every adapter it lacks; failures are logged and retried later (with backoff), never
        raised."""
        if CAPABILITY_LORA not in capabilities:
            if self._store.latest() and self._no_lora_logged != instance_id:
                self._no_lora_logged = instance_id
                logger.warning("replica %s: no adapter pushed: it does not load LoRA adapters", self._replica_id)
            return
        now = time.monotonic()
        if instance_id != self._listed_instance:
            if now < self._retry_at.get("", 0.0) or not await self._attempt("", self._list(), "listing its adapters"):
                return
            self._listed_instance = instance_id
            if instance_id != self._cleared_instance:
                self._cleared, self._cleared_instance = {}, instance_id
        removals = self._store.removals()
        for name, removal in removals.items():
            if self._cleared.get(name) == removal or (name in self.held and now < self._retry_at.get(name, 0.0)):
                continue
            if name not in self.held or await self._attempt(name, self._unload(name), f"unloading adapter {name}"):
                self._cleared[name] = removal
        for adapter in self._store.latest():
            if adapter.name in removals and self._cleared.get(adapter.name) != removals[adapter.name]:
                continue  # its older copy is unloaded first
            if self.held.get(adapter.name, -1) >= adapter.policy_version:
                self._failures.pop(adapter.name, None)
            elif now >= self._retry_at.get(adapter.name, 0.0):
                await self._attempt(adapter.name, self._load(adapter), f"pushing adapter {adapter.name}")

    async def _attempt(self, name: str, call: Awaitable[None], what: str) -> bool:
        """Awaits `call`; on failure logs it and backs off `name`'s calls (""; the listing)."""
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
        logger.warning(
            "replica %s: %s failed: %s (failure %d, retry in %.1fs)", self._replica_id, what, message, failures, backoff
        )
        return False

    async def _list(self) -> None:
        reply = await self._stub.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=self._timeout_s)
        self._hold({spec.name: spec.policy_version for spec in reply.adapters})

    async def _unload(self, name: str) -> None:
        try:
            await self._stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=name), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: gone already
                raise
        self._hold({held: version for held, version in self.held.items() if held != name})
        logger.info("replica %s: unloaded removed adapter %s", self._replica_id, name)

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
