"""The latest policy version, which opens dispatch (staleness.may_start).

With a weight broadcaster, a version counts once it is published and served by
`min_replicas` replicas (WaitForVersion): then min_policy_version on each turn makes the
router pick such a replica. A run that trains a LoRA adapter follows that adapter's
versions, from 0 (its first publish: replicas start without it). Without a broadcaster,
the trainer's completed steps are taken as the published versions (GetStatus, polled):
inference may serve older weights, which the per-token versions it reports show and
max_off_policy_steps bounds.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable

import grpc

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_orchestrator.trainer_client import TrainerFeed

__all__ = ["BroadcasterVersions", "TrainerVersions", "VersionSource"]

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0


class VersionSource(abc.ABC):
    # Whether the router can be asked for replicas at the version (min_policy_version).
    served: bool

    @abc.abstractmethod
    async def follow(self, on_version: Callable[[int], None]) -> None:
        """Calls `on_version` with the latest version each time it grows, until cancelled."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Releases connections."""


class BroadcasterVersions(VersionSource):
    served = True

    def __init__(
        self, address: str, *, min_replicas: int, wait_timeout_ms: int = 10_000, adapter_name: str = ""
    ) -> None:
        self.address = address
        self._adapter_name = adapter_name
        self._min_replicas = min_replicas
        self._wait_timeout_ms = wait_timeout_ms
        self._channel = make_channel(address)
        self._stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def follow(self, on_version: Callable[[int], None]) -> None:
        # Version 0, the initial weights, is what every replica starts with; an adapter's version 0
        # is the trainer's first publish of it.
        version = -1
        if not self._adapter_name:
            version = 0
            on_version(version)
        backoff = 0.2
        while True:
            request = weight_broadcaster_pb2.WaitForVersionRequest(
                policy_version=version + 1,
                min_replicas=self._min_replicas,
                timeout_ms=self._wait_timeout_ms,
                adapter_name=self._adapter_name,
            )
            try:
                reply = await self._stub.WaitForVersion(request, timeout=self._wait_timeout_ms / 1000 + 10)
            except grpc.aio.AioRpcError as exc:
                logger.warning("weight broadcaster at %s: %s; retrying", self.address, exc.code().name)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
                continue
            backoff = 0.2
            if reply.reached:
                version += 1
                on_version(version)


class TrainerVersions(VersionSource):
    served = False

    def __init__(self, trainer: TrainerFeed, *, poll_interval_s: float) -> None:
        self._trainer = trainer
        self._poll_interval_s = poll_interval_s

    async def follow(self, on_version: Callable[[int], None]) -> None:
        version = -1
        while True:
            try:
                completed = await self._trainer.completed_step()
            except grpc.aio.AioRpcError as exc:
                logger.warning("trainer status: %s; retrying", exc.code().name)
            else:
                if completed > version:
                    version = completed
                    on_version(version)
            await asyncio.sleep(self._poll_interval_s)
