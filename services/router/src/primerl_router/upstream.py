"""The gRPC side of one replica: its channel, the raw Generate method, and the
two loops that keep its Replica current: grpc.health.v1 checks (health with
thresholds) and the WatchLoad stream (load, policy version, update state; its
GetServiceInfo capabilities asked each time the stream connects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common import security
from primerl_common.server import channel_options
from primerl_router.config import HealthConfig, LoadConfig
from primerl_router.replica import Replica

__all__ = ["INFERENCE_SERVICE", "Upstream"]

logger = logging.getLogger(__name__)

INFERENCE_SERVICE = "primerl.inference.v1.InferenceService"
_GENERATE = f"/{INFERENCE_SERVICE}/Generate"
_MAX_RECONNECT_S = 2.0


class Upstream:
    def __init__(
        self,
        replica: Replica,
        *,
        health: HealthConfig,
        load: LoadConfig,
        max_message_bytes: int,
        on_change: Callable[[], None],
    ) -> None:
        self.replica = replica
        self._health_config = health
        self._load_config = load
        self._on_change = on_change
        # No channel-level retries (the router retries on another replica itself) and no
        # client interceptors (the forwarding path sets the trace context once).
        self.channel = security.secure_aio_channel(
            replica.address, options=[*channel_options(max_message_bytes), ("grpc.enable_retries", 0)]
        )
        # Request and response bytes pass through unparsed: no (de)serializers.
        self.generate = self.channel.unary_stream(_GENERATE, _registered_method=True)
        self._inference = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        name = self.replica.replica_id
        self._tasks = [
            asyncio.create_task(self._health_loop(), name=f"health-check {name}"),
            asyncio.create_task(self._load_loop(), name=f"load-watch {name}"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.channel.close()

    async def check_health(self) -> None:
        """One grpc.health.v1 check of the inference service, fed to the replica."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE), timeout=self._health_config.timeout_s
            )
            passed = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            passed = False
        before = self.replica.health.state
        if self.replica.record_health_check(passed):
            logger.info(
                "replica %s is %s (was %s)",
                self.replica.replica_id,
                self.replica.health.state.value,
                before.value,
                extra={"replica_id": self.replica.replica_id, "address": self.replica.address},
            )
            self._on_change()

    async def reset_prefix_cache(self, timeout_s: float) -> bool:
        try:
            reply = await self._inference.ResetPrefixCache(inference_pb2.ResetPrefixCacheRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("replica %s did not reset its prefix cache: %s", self.replica.replica_id, exc.code().name)
            return False
        return reply.reset

    async def _ask_capabilities(self) -> None:
        """The replica's capabilities, from its GetServiceInfo (raises where it does not answer)."""
        try:
            reply = await self._inference.GetServiceInfo(
                inference_pb2.GetServiceInfoRequest(), timeout=self._health_config.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            capabilities: frozenset[str] = frozenset()  # a replica older than capabilities
        else:
            capabilities = frozenset(reply.info.capabilities)
        if not self.replica.capabilities_known or capabilities != self.replica.capabilities:
            logger.info(
                "replica %s lists capabilities %s",
                self.replica.replica_id,
                ", ".join(sorted(capabilities)) or "none",
                extra={"replica_id": self.replica.replica_id, "address": self.replica.address},
            )
        self.replica.set_capabilities(capabilities)
        self._on_change()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_config.interval_s)
            await self.check_health()

    async def _load_loop(self) -> None:
        request = inference_pb2.WatchLoadRequest(interval_ms=self._load_config.report_interval_ms)
        backoff = self._load_config.report_interval_ms / 1000
        while True:
            try:
                await self._ask_capabilities()
                async for response in self._inference.WatchLoad(request):
                    self.replica.apply_load(response.load)
                    self._on_change()
                    backoff = self._load_config.report_interval_ms / 1000
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.warning(
                        "replica %s sends no load reports: routing counts only this router's requests",
                        self.replica.replica_id,
                    )
                    return
            # Until the stream is back, its version is unknown: a replica that restarts comes back
            # at the version it loads, not at the one it served before.
            self.replica.forget_load()
            self._on_change()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_RECONNECT_S)
