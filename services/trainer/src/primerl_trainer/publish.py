"""The weight broadcaster client: one PublishWeights stream per policy version.

`publish_requests` makes the stream (PublishBegin, then the tensors as TensorChunk messages);
`WeightPublisher.send` streams it. The tensors are produced while the stream is sent, one at a
time, by collectives every rank takes part in (export.py), so `send` always consumes the whole
stream, also after the call failed: the other ranks are waiting in those collectives.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
import torch
from google.rpc import error_details_pb2

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.server import channel_options
from primerl_common.tensors import DEFAULT_CHUNK_BYTES, iter_tensor_chunks
from primerl_trainer.export import PublishKind

__all__ = ["AdapterInfo", "BroadcasterWatch", "PublishError", "WeightPublisher", "publish_requests"]

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


def publish_requests(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    policy_version: int,
    kind: PublishKind,
    num_tensors: int,
    num_bytes: int,
    adapter: AdapterInfo | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[weight_broadcaster_pb2.PublishWeightsRequest]:
    """PublishBegin, then each tensor's chunks, read lazily from `named_tensors`."""
    begin = weight_broadcaster_pb2.PublishBegin(
        policy_version=policy_version,
        kind=_KINDS[kind],
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        trainer_step=policy_version,
    )
    if adapter is not None:
        begin.adapter_name, begin.adapter_rank, begin.adapter_alpha = adapter.name, adapter.rank, adapter.alpha
    yield weight_broadcaster_pb2.PublishWeightsRequest(begin=begin)
    for chunk in iter_tensor_chunks(named_tensors, chunk_bytes=chunk_bytes):
        yield weight_broadcaster_pb2.PublishWeightsRequest(chunk=chunk)


class WeightPublisher:
    """Sends publish streams to one weight broadcaster (blocking; call from the training thread)."""

    def __init__(self, address: str, *, timeout_s: float, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes))
        self._stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(self._channel)

    def send(
        self, requests: Iterable[weight_broadcaster_pb2.PublishWeightsRequest]
    ) -> weight_broadcaster_pb2.PublishWeightsResponse:
        """Stream `requests` to PublishWeights; raises PublishError. `requests` is consumed to
        its end whatever happens to the call."""
        buffer: queue.Queue[object] = queue.Queue(maxsize=_QUEUED_CHUNKS)
        abandoned = threading.Event()

        def outgoing() -> Iterator[weight_broadcaster_pb2.PublishWeightsRequest]:
            while not abandoned.is_set():
                try:
                    item = buffer.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is _END:
                    return
                yield item  # type: ignore[misc]

        call = self._stub.PublishWeights.future(outgoing(), timeout=self._timeout_s, wait_for_ready=False)
        try:
            for request in requests:
                while not call.done():
                    try:
                        buffer.put(request, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            while not call.done():
                try:
                    buffer.put(_END, timeout=0.1)
                    break
                except queue.Full:
                    continue
            try:
                return call.result()
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                infos = [d for d in error_details(exc) if isinstance(d, error_details_pb2.ErrorInfo)]
                raise PublishError(
                    f"PublishWeights to {self.address} failed: {code.name}: {exc.details()}",  # type: ignore[attr-defined]
                    retryable=code not in _PERMANENT,
                    reason=infos[0].reason if infos else "",
                    metadata=dict(infos[0].metadata) if infos else {},
                ) from None
        finally:
            abandoned.set()
            call.cancel()

    def close(self) -> None:
        self._channel.close()


class BroadcasterWatch:
    """Asks the broadcaster for its latest version every `interval_s` (on the event loop) and
    reports it with the version published before asking: `on_status(latest, published_before=)`.
    A broadcaster that restarted holds nothing (its versions live in RAM) until the trainer
    publishes again, and until then no replica gets the latest weights."""

    def __init__(
        self,
        address: str,
        *,
        interval_s: float,
        published_version: Callable[[], int],
        on_status: Callable[..., None],
    ) -> None:
        self.address = address
        self._interval_s = interval_s
        self._published_version = published_version
        self._on_status = on_status

    async def run(self) -> None:
        async with make_channel(self.address, max_attempts=1) as channel:
            stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
            while True:
                await asyncio.sleep(self._interval_s)
                # Read before asking: a publish that completes meanwhile is not mistaken for a loss.
                published = self._published_version()
                try:
                    status = await stub.GetStatus(weight_broadcaster_pb2.GetStatusRequest(), timeout=self._interval_s)
                except grpc.aio.AioRpcError:
                    continue  # away (restarting): asked again next time
                self._on_status(status.latest_policy_version, published_before=published)
