"""primerl.weight_broadcaster.v1.WeightBroadcasterService: proto <-> domain translation only."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterable, AsyncIterator

import grpc
import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.admission import ConcurrencyLimit, caller_key, check_limit
from primerl_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from primerl_common.lora import check_adapter_name
from primerl_common.observability import policy_version_var
from primerl_common.server import ServiceDefinition
from primerl_common.stripes import PUBLISH_STRIPED, StripeSession, StripeSessions, check_stripe_fields
from primerl_common.tensors import TensorAssembler
from primerl_weight_broadcaster.adapters import check_adapter_begin, published_adapter
from primerl_weight_broadcaster.collective import check_tensor_list
from primerl_weight_broadcaster.config import PublishLimitsConfig
from primerl_weight_broadcaster.replica_set import ReplicaSet
from primerl_weight_broadcaster.replicas import Replica
from primerl_weight_broadcaster.shm import ShmReceiver
from primerl_weight_broadcaster.store import ShmPlacement, WeightStore

__all__ = ["CAPABILITIES", "CAPABILITY_NCCL", "CAPABILITY_SHARED_FS", "CAPABILITY_SHM", "WeightBroadcasterServicer"]

logger = logging.getLogger(__name__)

CAPABILITIES = (
    "publish.full",
    "publish.adapter",
    PUBLISH_STRIPED,
    "format.hf",
    "format.kernel",
    "format.kernel_fp8",
    "transport.grpc",
    "transport.auto",
    "delta",
)
CAPABILITY_SHARED_FS = "transport.shared_fs"  # listed when shared_fs.folder is configured
CAPABILITY_SHM = "transport.shm"  # listed when shm.folder is configured (and usable)
CAPABILITY_NCCL = "transport.nccl"  # listed when collective.backend is configured
_FORMATS = {
    tensor_pb2.WEIGHT_FORMAT_UNSPECIFIED: tensor_pb2.WEIGHT_FORMAT_HF,
    tensor_pb2.WEIGHT_FORMAT_HF: tensor_pb2.WEIGHT_FORMAT_HF,
    tensor_pb2.WEIGHT_FORMAT_KERNEL: tensor_pb2.WEIGHT_FORMAT_KERNEL,
    tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8: tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8,
}


class WeightBroadcasterServicer(weight_broadcaster_pb2_grpc.WeightBroadcasterServiceServicer):
    def __init__(
        self,
        definition: ServiceDefinition,
        store: WeightStore,
        replicas: ReplicaSet,
        limits: PublishLimitsConfig | None = None,
    ) -> None:
        self._definition = definition
        self._store = store
        self._replicas = replicas
        self._limits = limits or PublishLimitsConfig()
        # Publishes being received: each holds a whole version until it is stored.
        self._receiving = ConcurrencyLimit(
            what="publishes being received",
            limit=self._limits.max_concurrent,
            per_caller_limit=self._limits.max_concurrent,
            config_field="publish.max_concurrent",
            per_caller_config_field="publish.max_concurrent",
        )
        # Striped publishes being received (each holds one `_receiving` place).
        self._stripes: StripeSessions[_Received, pb2.PublishWeightsResponse] = StripeSessions(
            join_timeout_s=self._limits.stripe_join_timeout_s
        )
        # One publish at a time: versions are checked and stored in order.
        self._publishing = asyncio.Lock()
        # Each open WatchReplicas stream's queue (None ends it).
        self._watches: set[asyncio.Queue[pb2.WatchReplicasResponse | None]] = set()
        self._draining = False

    async def drain(self) -> None:
        """Ends the WatchReplicas streams and WaitForVersion polls, which would otherwise hold a
        graceful stop for its whole grace period; their clients ask again (the next process)."""
        self._draining = True
        for queue in self._watches:
            queue.put_nowait(None)
        self._replicas.wake_waiters()

    async def GetServiceInfo(
        self, request: pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb2.GetServiceInfoResponse:
        return pb2.GetServiceInfoResponse(info=self._definition.info())

    async def PublishWeights(
        self, request_iterator: AsyncIterable[pb2.PublishWeightsRequest], context: grpc.aio.ServicerContext
    ) -> pb2.PublishWeightsResponse:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or not first.HasField("begin"):
            raise InvalidArgument("the first message must be `begin`", field="begin")
        begin = first.begin
        policy_version_var.set(begin.policy_version)
        if begin.kind == pb2.PUBLISH_KIND_ADAPTER:
            return await self._publish_adapter(requests, begin, caller_key(context))
        if begin.kind not in (pb2.PUBLISH_KIND_UNSPECIFIED, pb2.PUBLISH_KIND_FULL):
            raise InvalidArgument(
                "supported: PUBLISH_KIND_FULL, PUBLISH_KIND_ADAPTER (over PublishWeights)", field="begin.kind"
            )
        _check_announced(begin, self._limits)
        striped = check_stripe_fields(
            begin.stripe_session,
            begin.num_stripes,
            begin.stripe_index,
            max_stripes=self._limits.max_stripes,
            config_field="publish.max_stripes",
        )
        # Refuse a stale version before receiving its bytes (checked again when storing).
        self._check_version(begin.policy_version, data=True)
        if striped:
            return await self._receive_stripe(requests, begin, caller_key(context))
        with self._receiving.hold(caller_key(context)):
            received = await _receive(requests, _Budget(begin, self._limits), self._replicas.shm_receiver(begin))
            return await self._store_version(begin, _joined([received], begin))

    async def _publish_adapter(
        self, requests: AsyncIterator[pb2.PublishWeightsRequest], begin: pb2.PublishBegin, caller: str
    ) -> pb2.PublishWeightsResponse:
        """A LoRA adapter's new version (adapters.py): checked whole before it is stored; the
        full weights' versions are not involved."""
        check_adapter_begin(begin)
        _check_announced(begin, self._limits)
        adapters = self._replicas.adapters
        adapters.check_publish(begin.adapter_name, begin.policy_version, begin.adapter_owner)  # before its bytes
        with self._receiving.hold(caller):
            received = _joined([await _receive(requests, _Budget(begin, self._limits))], begin)
            adapter = published_adapter(begin, received.tensors)
            async with self._publishing:
                adapters.make_latest(adapter)
                self._replicas.published()
                await asyncio.to_thread(adapters.spill, adapter)
        num_bytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
        logger.info(
            "adapter %s version %d published (owner %s): rank %d, alpha %g, modules %s, %d tensors, %.2f MiB",
            adapter.name,
            adapter.policy_version,
            adapter.owner or "-",
            adapter.rank,
            adapter.alpha,
            ",".join(adapter.target_modules),
            len(adapter.tensors),
            num_bytes / 2**20,
        )
        return pb2.PublishWeightsResponse(
            policy_version=adapter.policy_version,
            num_tensors=len(adapter.tensors),
            num_bytes=num_bytes,
            num_changed_tensors=len(adapter.tensors),
        )

    async def _receive_stripe(
        self, requests: AsyncIterator[pb2.PublishWeightsRequest], begin: pb2.PublishBegin, caller: str
    ) -> pb2.PublishWeightsResponse:
        """One stream of a striped publish: stored with the others, all or nothing (stripes.py)."""
        if not begin.num_tensors:
            raise InvalidArgument("a striped publish must announce its tensors", field="begin.num_tensors")

        def new_state(session: StripeSession) -> _Budget:
            self._receiving.acquire(caller)  # one place per publish, whatever its stripes
            session.add_done_callback(lambda: self._receiving.release(caller))
            return _Budget(begin, self._limits)

        key = pb2.PublishBegin()
        key.CopyFrom(begin)
        key.stripe_index = 0
        session = self._stripes.join(
            begin.stripe_session,
            num_stripes=begin.num_stripes,
            stripe_index=begin.stripe_index,
            key=key.SerializeToString(deterministic=True),
            new_state=new_state,
        )

        async def commit(parts: list[_Received]) -> pb2.PublishWeightsResponse:
            return await self._store_version(begin, _joined(parts, begin))

        receive = _receive(requests, session.state, self._replicas.shm_receiver(begin))
        return await session.run(begin.stripe_index, receive, commit)

    async def _store_version(self, begin: pb2.PublishBegin, received: _Received) -> pb2.PublishWeightsResponse:
        tensors = received.tensors
        async with self._publishing:
            self._check_version(begin.policy_version, data=True)
            # Off the event loop: comparing with the latest version, and spilling, take a while.
            published = self._store.make_latest(
                await asyncio.to_thread(
                    self._store.prepare, begin.policy_version, tensors, begin.model_type, received.placement
                )
            )
            self._replicas.published()  # pushes start from the received tensors, not waiting for the disk
            # Spilled before the reply and the next publish: a version the trainer saw stored is on
            # disk (unless the write failed: logged, and the version stays in RAM).
            self._store.hold_spilled(published, await asyncio.to_thread(self._store.spill, published))
        logger.info(
            "policy version %d published: %d tensors (%d changed), %.1f MiB",
            published.policy_version,
            len(tensors),
            published.num_changed_tensors,
            published.num_bytes / 2**20,
        )
        return pb2.PublishWeightsResponse(
            policy_version=published.policy_version,
            num_tensors=len(tensors),
            num_bytes=published.num_bytes,
            num_changed_tensors=published.num_changed_tensors,
        )

    async def PublishCollective(
        self, request: pb2.PublishCollectiveRequest, context: grpc.aio.ServicerContext
    ) -> pb2.PublishCollectiveResponse:
        if request.begin.kind == pb2.PUBLISH_KIND_ADAPTER:
            raise InvalidArgument("an adapter is published over PublishWeights", field="begin.kind")
        if self._replicas.collective is None:
            raise FailedPrecondition(
                "collective publishes need the broadcaster's collective.backend, which is not configured",
                subject="collective.backend",
            )
        begin = request.begin
        policy_version_var.set(begin.policy_version)
        if begin.kind not in (pb2.PUBLISH_KIND_UNSPECIFIED, pb2.PUBLISH_KIND_FULL):
            raise InvalidArgument("only PUBLISH_KIND_FULL is supported", field="begin.kind")
        _check_announced(begin, self._limits)
        check_tensor_list(request)
        async with self._publishing:
            self._check_version(begin.policy_version, data=False)
            response = self._replicas.publish_collective(request)
        logger.info(
            "policy version %d announced for a collective broadcast: %d tensors, %.1f MiB, group %s of %d (%s)%s",
            begin.policy_version,
            begin.num_tensors,
            begin.num_bytes / 2**20,
            response.group.group_name,
            response.group.world_size,
            ", ".join(response.replica_ids) or "no replica",
            "; the data comes too" if response.send_data else "",
        )
        return response

    def _check_version(self, policy_version: int, *, data: bool) -> None:
        """Refuses a version not newer than the latest; `data`: a PublishWeights, which may carry
        the data of the version just announced by PublishCollective."""
        self._store.check_version(policy_version)
        if self._replicas.collective is not None:
            self._replicas.collective.check_version(policy_version, data=data)

    async def RegisterReplica(
        self, request: pb2.RegisterReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb2.RegisterReplicaResponse:
        if not request.replica_id:
            raise InvalidArgument("must be set", field="replica_id")
        if not request.address:
            raise InvalidArgument("must be set (host:port of the replica's inference.v1 server)", field="address")
        if request.format not in _FORMATS:
            raise InvalidArgument(f"unknown weight format {request.format}", field="format")
        replica = Replica(
            replica_id=request.replica_id,
            address=request.address,
            delta=request.delta,
            format=_FORMATS[request.format],
            transport=self._transport(request.transport, _FORMATS[request.format]),
            policy_version=request.policy_version,
        )
        await self._replicas.register(replica)
        logger.info("replica %s registered at %s", replica.replica_id, replica.address)
        return pb2.RegisterReplicaResponse(
            replica=replica.to_proto(), latest_policy_version=self._replicas.latest_policy_version
        )

    def _transport(self, transport: int, weight_format: int) -> int:
        if transport in (pb2.TRANSPORT_UNSPECIFIED, pb2.TRANSPORT_AUTO):
            return pb2.TRANSPORT_AUTO
        if transport == pb2.TRANSPORT_GRPC:
            return pb2.TRANSPORT_GRPC
        if transport == pb2.TRANSPORT_SHM:
            raise InvalidArgument(
                "TRANSPORT_SHM is picked by the broadcaster for replicas on its host: register TRANSPORT_AUTO",
                field="transport",
            )
        if transport == pb2.TRANSPORT_SHARED_FS:
            if not self._replicas.shared_fs_enabled:
                raise InvalidArgument(
                    "TRANSPORT_SHARED_FS needs the broadcaster's shared_fs.folder, which is not configured",
                    field="transport",
                )
            return transport
        if transport == pb2.TRANSPORT_NCCL:
            if self._replicas.collective is None:
                raise InvalidArgument(
                    "TRANSPORT_NCCL needs the broadcaster's collective.backend, which is not configured",
                    field="transport",
                )
            if weight_format != tensor_pb2.WEIGHT_FORMAT_HF:
                raise InvalidArgument(
                    "TRANSPORT_NCCL carries the trainer's HF tensors: use WEIGHT_FORMAT_HF", field="format"
                )
            return transport
        name = pb2.Transport.Name(transport) if transport in pb2.Transport.values() else str(transport)
        raise InvalidArgument(
            f"{name} is not supported; supported: TRANSPORT_AUTO, TRANSPORT_GRPC, TRANSPORT_SHARED_FS, TRANSPORT_NCCL",
            field="transport",
        )

    async def DeregisterReplica(
        self, request: pb2.DeregisterReplicaRequest, context: grpc.aio.ServicerContext
    ) -> pb2.DeregisterReplicaResponse:
        if not await self._replicas.deregister(request.replica_id):
            raise NotFound(f"no replica {request.replica_id!r} is registered")
        logger.info("replica %s deregistered", request.replica_id)
        return pb2.DeregisterReplicaResponse()

    async def RemoveAdapter(
        self, request: pb2.RemoveAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb2.RemoveAdapterResponse:
        """Forgets the adapter (adapters.py), its spilled copy first; the replica tasks unload it."""
        name = request.adapter_name
        check_adapter_name(name, field="adapter_name")
        adapters = self._replicas.adapters
        async with self._publishing:  # not while a publish of it is stored or spilled
            adapters.held(name)
            try:
                await asyncio.to_thread(adapters.unspill, name)
            except OSError as exc:
                raise Unavailable(f"deleting the spilled copy of adapter {name!r} failed: {exc}") from None
            removed = adapters.remove(name)
            self._replicas.published()
        logger.info("adapter %s removed at version %d (owner %s)", name, removed.policy_version, removed.owner or "-")
        return pb2.RemoveAdapterResponse(policy_version=removed.policy_version)

    async def GetStatus(
        self, request: pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb2.GetStatusResponse:
        return pb2.GetStatusResponse(
            latest_policy_version=self._replicas.latest_policy_version,
            replicas=[replica.to_proto() for replica in self._replicas.replicas()],
            latest_adapter_versions=self._replicas.adapters.latest_versions(),
        )

    async def WaitForVersion(
        self, request: pb2.WaitForVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb2.WaitForVersionResponse:
        version, min_replicas, adapter = request.policy_version, request.min_replicas, request.adapter_name
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else context.time_remaining()
        if adapter:
            check_adapter_name(adapter, field="adapter_name")

        def latest() -> int:
            if adapter:
                return self._replicas.adapters.latest_version(adapter)
            return self._replicas.latest_policy_version

        def num_at_version() -> int:
            if adapter:
                return self._replicas.num_holding(adapter, version)
            return self._replicas.num_at_version(version)

        def reached() -> bool:
            return latest() >= version and (min_replicas == 0 or num_at_version() >= min_replicas)

        # Answer a little before the call's own deadline, so the client gets the state reached.
        if timeout_s is not None and not request.timeout_ms:
            timeout_s = max(timeout_s - 0.05, 0.0)
        await self._replicas.wait_until(lambda: reached() or self._draining, timeout_s)
        return pb2.WaitForVersionResponse(
            reached=reached(), latest_policy_version=latest(), num_replicas_at_version=num_at_version()
        )

    async def WatchReplicas(
        self, request: pb2.WatchReplicasRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb2.WatchReplicasResponse]:
        if self._draining:
            raise Unavailable("the weight broadcaster is shutting down", reason="DRAINING", retry_after_s=1.0)
        queue: asyncio.Queue[pb2.WatchReplicasResponse | None] = asyncio.Queue()
        stop = self._replicas.listen(queue.put_nowait)
        self._watches.add(queue)
        try:
            latest = self._replicas.latest_policy_version
            for replica in self._replicas.replicas():
                yield pb2.WatchReplicasResponse(replica=replica.to_proto(), latest_policy_version=latest)
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watches.discard(queue)
            stop()


def _check_announced(begin: pb2.PublishBegin, limits: PublishLimitsConfig) -> None:
    check_limit(
        begin.num_tensors,
        limits.max_tensors,
        field="begin.num_tensors",
        config_field="publish.max_tensors",
        what="tensors",
    )
    check_limit(
        begin.num_bytes, limits.max_bytes, field="begin.num_bytes", config_field="publish.max_bytes", what="bytes"
    )


class _Budget:
    """What a publish may still bring: what `begin` announced, else the configured caps. Each
    tensor is counted from its header, before its bytes are allocated (over all the streams of
    a striped publish)."""

    def __init__(self, begin: pb2.PublishBegin, limits: PublishLimitsConfig) -> None:
        self._begin = begin
        self._limits = limits
        self.num_tensors = 0
        self.num_bytes = 0
        self._names: set[str] = set()

    def start(self, header: tensor_pb2.TensorHeader) -> None:
        if header.name in self._names:
            raise InvalidArgument(f"tensor {header.name!r} sent twice", field="chunk.header.name")
        self._names.add(header.name)
        self.num_tensors += 1
        self.num_bytes += header.num_bytes
        begin, limits = self._begin, self._limits
        if begin.num_tensors and self.num_tensors > begin.num_tensors:
            raise InvalidArgument(f"more tensors than the {begin.num_tensors} announced", field="begin.num_tensors")
        if begin.num_bytes and self.num_bytes > begin.num_bytes:
            raise InvalidArgument(
                f"tensor {header.name!r} brings the publish to {self.num_bytes} bytes, more than the "
                f"{begin.num_bytes} announced",
                field="begin.num_bytes",
            )
        check_limit(
            self.num_tensors,
            limits.max_tensors,
            field="chunk.header",
            config_field="publish.max_tensors",
            what="tensors",
        )
        check_limit(
            self.num_bytes,
            limits.max_bytes,
            field="chunk.header.num_bytes",
            config_field="publish.max_bytes",
            what="bytes",
        )


@dataclasses.dataclass(frozen=True)
class _Received:
    """A publish stream's tensors, and where they lie in shared memory when received there."""

    tensors: dict[str, torch.Tensor]
    placement: ShmPlacement | None = None


async def _receive(
    requests: AsyncIterator[pb2.PublishWeightsRequest], budget: _Budget, shm: ShmReceiver | None = None
) -> _Received:
    """The tensors of a publish stream, each counted in `budget` from its header; written
    straight into shared memory with `shm` (shm.py), else held in RAM."""
    assembler = TensorAssembler() if shm is None else shm.assembler
    tensors: dict[str, torch.Tensor] = {}
    try:
        async for request in requests:
            if not request.HasField("chunk"):
                raise InvalidArgument("only chunks may follow `begin`", field="begin")
            if request.chunk.HasField("header"):
                budget.start(request.chunk.header)
            if (item := assembler.feed(request.chunk)) is not None:
                name, tensor = item
                tensors[name] = tensor
        assembler.finish()
        if shm is None:
            return _Received(tensors)
        return _Received(*shm.finish(tensors))
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="chunk") from None
    except OSError as exc:  # shared memory full after all (another process took it meanwhile)
        raise Unavailable(f"receiving into shared memory failed: {exc}", retry_after_s=1.0) from None
    finally:
        if shm is not None:
            shm.close()


def _joined(parts: list[_Received], begin: pb2.PublishBegin) -> _Received:
    """The tensors of a publish's streams (one, or its stripes), checked against the counts
    `begin` announced."""
    tensors = {name: tensor for part in parts for name, tensor in part.tensors.items()}
    placements = [part.placement for part in parts]
    placement = ShmPlacement.joined(placements) if all(placements) else None  # type: ignore[arg-type]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if begin.num_tensors and len(tensors) != begin.num_tensors:
        raise InvalidArgument(f"{len(tensors)} tensors arrived, begin announced {begin.num_tensors}", field="begin")
    if begin.num_bytes and num_bytes != begin.num_bytes:
        raise InvalidArgument(f"{num_bytes} bytes arrived, begin announced {begin.num_bytes}", field="begin")
    if not tensors:
        raise FailedPrecondition("a publish must carry at least one tensor", subject="chunk")
    return _Received(tensors, placement)
