"""The weight broadcaster client: one PublishWeights stream per policy version.

`publish_requests` makes the stream (PublishBegin, then the tensors as TensorChunk messages);
`WeightPublisher.send` streams it, striped over `streams` streams on connections of their own
when more than one (each tensor on the stream with the least queued, the version stored by the
broadcaster only when every stripe arrived: primerl_common.stripes), so that TLS encryption
runs on several cores at once. The tensors are produced while the stream is sent, one at a
time, by collectives every rank takes part in (export.py), so `send` always consumes the whole
stream, also after the call failed: the other ranks are waiting in those collectives.

`WeightPublisher.send_collective` publishes over a collective group instead (TRANSPORT_NCCL
replicas, primerl_common.weights.collective): the broadcaster gets the tensor list, names the group,
and the trainer broadcasts the tensors to the replicas in it as rank 0; it streams them to the
broadcaster as well, in the same pass, when the broadcaster asks for the data.

`WeightPublisher.remove_adapter` removes a deleted run's LoRA adapter from the broadcaster,
which unloads it from every replica.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from google.rpc import error_details_pb2

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common import security
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.sealed_streams import SealedCallerSync
from primerl_common.security.sealed import SealBroken, StreamKey
from primerl_common.server import channel_options
from primerl_common.stripes import PUBLISH_STRIPED, stripe_channel_options
from primerl_common.tensors import DEFAULT_CHUNK_BYTES, dtype_from_proto, dtype_to_proto, iter_tensor_chunks
from primerl_common.weights.collective import GroupCache, GroupSpec, TensorSpec, send_tensors
from primerl_trainer.export import PublishKind

__all__ = [
    "AdapterInfo",
    "BroadcasterWatch",
    "PublishError",
    "WeightPublisher",
    "publish_requests",
    "tensor_headers",
]

logger = logging.getLogger(__name__)

_KINDS = {
    "full": weight_broadcaster_pb2.PUBLISH_KIND_FULL,
    "adapter": weight_broadcaster_pb2.PUBLISH_KIND_ADAPTER,
}
# A retry cannot fix these: the broadcaster refused the version itself.
_PERMANENT = {
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
# Chunks buffered between the producer and gRPC's sending thread (a few MiB each).
_QUEUED_CHUNKS = 4
_END = object()
_PUBLISH_METHOD = "/primerl.weight_broadcaster.v1.WeightBroadcasterService/PublishWeights"


class PublishError(Exception):
    """A publish that did not complete; `retryable` is False when the broadcaster refused it.
    `reason` and `metadata`: the ErrorInfo of the refusal, if any."""

    def __init__(
        self, message: str, *, retryable: bool, reason: str = "", metadata: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.reason = reason
        self.metadata = dict(metadata or {})

    def holds(self, policy_version: int) -> bool:
        """The broadcaster refused `policy_version` because it holds that very version already
        (a resumed trainer republishing what the broadcaster kept)."""
        return self.reason == "POLICY_VERSION_NOT_NEWER" and self.metadata.get("latest_policy_version") == str(
            policy_version
        )


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    rank: int
    alpha: float
    # The identity the adapter belongs to (a run's owner); "": served to any caller.
    owner: str = ""


def publish_requests(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    policy_version: int,
    kind: PublishKind,
    num_tensors: int,
    num_bytes: int,
    adapter: AdapterInfo | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    model_type: str = "",
) -> Iterator[weight_broadcaster_pb2.PublishWeightsRequest]:
    """PublishBegin, then each tensor's chunks, read lazily from `named_tensors`.
    `model_type`: the HF config's, which decides the broadcaster's kernel layout."""
    begin = _begin(policy_version, kind, num_tensors, num_bytes, adapter, model_type)
    yield weight_broadcaster_pb2.PublishWeightsRequest(begin=begin)
    for chunk in iter_tensor_chunks(named_tensors, chunk_bytes=chunk_bytes):
        yield weight_broadcaster_pb2.PublishWeightsRequest(chunk=chunk)


def _begin(
    policy_version: int,
    kind: PublishKind,
    num_tensors: int,
    num_bytes: int,
    adapter: AdapterInfo | None,
    model_type: str = "",
) -> weight_broadcaster_pb2.PublishBegin:
    begin = weight_broadcaster_pb2.PublishBegin(
        policy_version=policy_version,
        kind=_KINDS[kind],
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        trainer_step=policy_version,
        model_type=model_type,
    )
    if adapter is not None:
        begin.adapter_name, begin.adapter_rank, begin.adapter_alpha = adapter.name, adapter.rank, adapter.alpha
        begin.adapter_owner = adapter.owner
    return begin


def tensor_headers(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tensor_pb2.TensorHeader]:
    """Name, dtype and shape of each tensor a publish sends, in order (meta tensors do: no data
    is read), as PublishCollective announces them."""
    return [
        tensor_pb2.TensorHeader(
            name=name, dtype=dtype_to_proto(t.dtype), shape=list(t.shape), num_bytes=t.numel() * t.element_size()
        )
        for name, t in named_tensors
    ]


def _publish_error(exc: grpc.RpcError, what: str) -> PublishError:
    code = exc.code()  # type: ignore[attr-defined]
    infos = [d for d in error_details(exc) if isinstance(d, error_details_pb2.ErrorInfo)]
    return PublishError(
        f"{what} failed: {code.name}: {exc.details()}",  # type: ignore[attr-defined]
        retryable=code not in _PERMANENT,
        reason=infos[0].reason if infos else "",
        metadata=dict(infos[0].metadata) if infos else {},
    )


class WeightPublisher:
    """Sends publish streams to one weight broadcaster (blocking; call from the training thread),
    each over `streams` parallel streams (1: one stream, as brokers without striping take)."""

    def __init__(
        self, address: str, *, timeout_s: float, max_message_bytes: int = 64 * 1024 * 1024, streams: int = 1
    ) -> None:
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self.address = address
        self._timeout_s = timeout_s
        self._channels = [
            security.secure_channel(
                address,
                options=[*channel_options(max_message_bytes), *(stripe_channel_options(index) if streams > 1 else [])],
            )
            for index in range(streams)
        ]
        self._stubs = [weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel) for channel in self._channels]
        self._stub = self._stubs[0]
        # Publishes as sealed streams where the broadcaster serves a sealed port (else over mTLS).
        self._sealed = SealedCallerSync(
            self._channels[0], address.rpartition(":")[0], options=channel_options(max_message_bytes)
        )
        # The collective group of the latest generation (send_collective).
        self._groups = GroupCache()
        # The latest version send_collective broadcast (or tried to): publishing it again sends its data.
        self._broadcast_version: int | None = None
        # Whether the broadcaster joins striped publishes; asked again after a failed publish (a
        # restarted broadcaster may be another build).
        self._broadcaster_stripes: bool | None = None

    def _stripes(self) -> int:
        """How many streams the next publish takes: the publisher's, where the broadcaster lists
        `publish.striped`, else one (a broadcaster built before striping)."""
        if len(self._stubs) == 1:
            return 1
        if self._broadcaster_stripes is None:
            try:
                info = self._stub.GetServiceInfo(
                    weight_broadcaster_pb2.GetServiceInfoRequest(), timeout=min(self._timeout_s, 10.0)
                ).info
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                    # Not reachable now: one stream, whose call says why (and consumes `requests`,
                    # which other ranks' gathers may wait on); asked again at the next publish.
                    return 1
                info = None
            self._broadcaster_stripes = info is not None and PUBLISH_STRIPED in info.capabilities
        return len(self._stubs) if self._broadcaster_stripes else 1

    def _open_sealed(self, streams: int) -> tuple[int, list[StreamKey]] | None:
        """Sessions for a publish of `streams` streams as sealed streams, or None: the broadcaster
        serves no sealed port, or cannot be asked now (the mTLS call then says why)."""
        try:
            return self._sealed.open(_PUBLISH_METHOD, streams, timeout_s=min(self._timeout_s, 10.0))
        except grpc.RpcError:
            return None

    def send(
        self, requests: Iterable[weight_broadcaster_pb2.PublishWeightsRequest]
    ) -> weight_broadcaster_pb2.PublishWeightsResponse:
        """Stream `requests` (`begin` first) to PublishWeights, striped over the publisher's
        streams (an adapter, a few MB, takes one); raises PublishError. `requests` is consumed to
        its end whatever happens."""
        requests = iter(requests)
        first = next(requests, None)
        if first is None or not first.HasField("begin"):
            raise ValueError("a publish stream starts with `begin`")
        begins = [first]
        stripes = 1 if first.begin.kind == weight_broadcaster_pb2.PUBLISH_KIND_ADAPTER else self._stripes()
        if stripes > 1:
            session, begins = uuid.uuid4().hex, []
            for index in range(stripes):
                begin = weight_broadcaster_pb2.PublishWeightsRequest()
                begin.CopyFrom(first)
                begin.begin.stripe_session, begin.begin.num_stripes = session, stripes
                begin.begin.stripe_index = index
                begins.append(begin)
        buffers: list[queue.Queue[object]] = [queue.Queue(maxsize=_QUEUED_CHUNKS) for _ in begins]
        abandoned = threading.Event()
        sealed = self._open_sealed(len(begins))
        calls = [
            self._sealed.call(
                sealed[0],
                sealed[1][index],
                index,
                _outgoing(begin, buffer, abandoned),
                weight_broadcaster_pb2.PublishWeightsResponse,
                timeout_s=self._timeout_s,
                serialize=weight_broadcaster_pb2.PublishWeightsRequest.SerializeToString,
            )
            if sealed
            else stub.PublishWeights.future(
                _outgoing(begin, buffer, abandoned), timeout=self._timeout_s, wait_for_ready=False
            )
            for index, (stub, begin, buffer) in enumerate(zip(self._stubs[: len(begins)], begins, buffers, strict=True))
        ]

        def failed() -> bool:  # a stripe's call ends early only when it failed (stripes.py)
            return any(call.done() for call in calls)

        try:
            target = 0
            for request in requests:
                if len(buffers) > 1 and request.chunk.HasField("header"):
                    target = min(range(len(buffers)), key=lambda index: buffers[index].qsize())
                _put(buffers[target], request, failed)
            for buffer in buffers:
                _put(buffer, _END, failed)
            errors: list[grpc.RpcError] = []
            responses = []
            for call in calls:
                try:
                    responses.append(call.result())
                except grpc.RpcError as exc:
                    errors.append(exc)
                except SealBroken as exc:  # an answer altered on the sealed port's connection
                    raise PublishError(f"PublishWeights to {self.address}: {exc}", retryable=True) from None
            if errors:
                self._broadcaster_stripes = None
                # The stripe that failed says why; the others only that another one failed.
                errors.sort(key=lambda exc: exc.code() == grpc.StatusCode.ABORTED)  # type: ignore[attr-defined]
                raise _publish_error(errors[0], f"PublishWeights to {self.address}") from None
            return responses[0]
        finally:
            abandoned.set()
            for call in calls:
                call.cancel()

    def send_collective(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        headers: list[tensor_pb2.TensorHeader],
        policy_version: int,
        kind: PublishKind,
        adapter: AdapterInfo | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        model_type: str = "",
    ) -> weight_broadcaster_pb2.PublishCollectiveResponse:
        """Publishes over a collective group: announces `headers` (`tensor_headers` of what
        `named_tensors` yields), broadcasts the tensors to the group the broadcaster names,
        and streams them to it too when it asks for the data. Raises PublishError;
        `named_tensors` is consumed to its end whatever happens (see `send`).

        A version is broadcast once. Publishing it again (a retry of a failed attempt, announced
        or not, or because the broadcaster lost it: a member failed to load it, or it restarted)
        streams its data to the broadcaster instead, and the reply names no group: the
        broadcaster pushes it over gRPC to every replica that lacks it (a member that died
        mid-broadcast and restarts, or one the failure left behind)."""
        num_bytes = sum(header.num_bytes for header in headers)

        def data_requests(tensors: Iterable[tuple[str, torch.Tensor]]):
            return publish_requests(
                tensors,
                policy_version=policy_version,
                kind=kind,
                num_tensors=len(headers),
                num_bytes=num_bytes,
                adapter=adapter,
                chunk_bytes=chunk_bytes,
                model_type=model_type,
            )

        if self._broadcast_version == policy_version:
            self.send(data_requests(named_tensors))
            return weight_broadcaster_pb2.PublishCollectiveResponse(send_data=True)
        self._broadcast_version = policy_version
        named_tensors = iter(named_tensors)
        begin = _begin(policy_version, kind, len(headers), num_bytes, adapter, model_type)
        request = weight_broadcaster_pb2.PublishCollectiveRequest(
            begin=begin, tensors=headers, new_group=not self._groups.holds_group
        )
        try:
            response = self._stub.PublishCollective(request, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            for _ in named_tensors:
                pass
            raise _publish_error(exc, f"PublishCollective to {self.address}") from None
        failures: list[str] = []
        tensors = self._broadcast(response.group, headers, named_tensors, failures)
        if response.send_data:
            self.send(data_requests(tensors))
        else:
            for _ in tensors:
                pass
        if failures and not response.send_data:
            raise PublishError(
                f"broadcasting policy version {policy_version} in group {response.group.group_name!r} failed: "
                f"{failures[0]}; a retry sends its data to the broadcaster",
                retryable=True,
                reason="COLLECTIVE_FAILED",
            )
        if failures:
            logger.warning(
                "broadcasting policy version %d in group %s failed (%s); the broadcaster has its data and "
                "pushes it over gRPC to the replicas that missed it",
                policy_version,
                response.group.group_name,
                failures[0],
            )
        return response

    def _broadcast(
        self,
        group: inference_pb2.CollectiveGroup,
        headers: list[tensor_pb2.TensorHeader],
        named_tensors: Iterator[tuple[str, torch.Tensor]],
        failures: list[str],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`named_tensors`, broadcast to `group` as they pass (nothing when no replica is in it).
        A failed broadcast is put in `failures`; the tensors still pass (the broadcaster may
        need them, the export's collectives must finish), and the group is dropped (its
        connections close, so members still waiting fail at once rather than at the timeout)."""
        if group.world_size <= 1:
            yield from named_tensors
            return
        spec = GroupSpec.from_proto(group)
        specs = [TensorSpec(h.name, dtype_from_proto(h.dtype), tuple(h.shape)) for h in headers]
        try:
            yield from send_tensors(self._groups.get(spec), spec, specs, named_tensors)
        except (RuntimeError, ValueError) as exc:
            # Its text only: the exception's traceback holds the group (through the frames), which
            # must close now, and a log record may outlive this call.
            failures.append(str(exc))
            logger.warning("broadcasting in collective group %s failed: %s", spec.group_name, failures[-1])
            self._groups.drop()
        else:
            return
        yield from named_tensors

    def remove_adapter(self, name: str) -> int:
        """Removes adapter `name` from the broadcaster, which unloads it from every replica (a
        deleted run's). The latest version it held; -1 when it held none (nothing to remove).
        Raises PublishError."""
        request = weight_broadcaster_pb2.RemoveAdapterRequest(adapter_name=name)
        try:
            response = self._stub.RemoveAdapter(request, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                return -1
            raise _publish_error(exc, f"RemoveAdapter {name!r} at {self.address}") from None
        return response.policy_version

    def close(self) -> None:
        self._groups.drop()
        for channel in self._channels:
            channel.close()
        self._sealed.close()


def _outgoing(
    begin: weight_broadcaster_pb2.PublishWeightsRequest, buffer: queue.Queue[object], abandoned: threading.Event
) -> Iterator[weight_broadcaster_pb2.PublishWeightsRequest]:
    """`begin`, then what `buffer` brings until _END (read on gRPC's sending thread)."""
    yield begin
    while not abandoned.is_set():
        try:
            item = buffer.get(timeout=0.1)
        except queue.Empty:
            continue
        if item is _END:
            return
        yield item  # type: ignore[misc]


def _put(buffer: queue.Queue[object], item: object, failed: Callable[[], bool]) -> None:
    """Puts `item` once there is room, unless the publish failed meanwhile (then drops it)."""
    while not failed():
        try:
            buffer.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


class BroadcasterWatch:
    """Asks the broadcaster for its status every `interval_s` (on the event loop) and reports it
    with what was published before asking: `on_status(status, published_before)`, where
    `published_before` is what `published()` returned. A broadcaster that restarted holds
    nothing (its versions live in RAM, unless it spills them to disk) until the trainer
    publishes again, and until then no replica gets the latest weights."""

    def __init__(
        self,
        address: str,
        *,
        interval_s: float,
        published: Callable[[], Any],
        on_status: Callable[[weight_broadcaster_pb2.GetStatusResponse, Any], None],
    ) -> None:
        self.address = address
        self._interval_s = interval_s
        self._published = published
        self._on_status = on_status

    async def run(self) -> None:
        async with make_channel(self.address, max_attempts=1) as channel:
            stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
            while True:
                await asyncio.sleep(self._interval_s)
                # Read before asking: a publish that completes meanwhile is not mistaken for a loss.
                published = self._published()
                try:
                    status = await stub.GetStatus(weight_broadcaster_pb2.GetStatusRequest(), timeout=self._interval_s)
                except grpc.aio.AioRpcError:
                    continue  # away (restarting): asked again next time
                self._on_status(status, published)
