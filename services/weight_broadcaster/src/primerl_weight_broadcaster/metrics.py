"""The weight broadcaster's Prometheus metrics (served on observability.metrics_port): which
transport each replica's pushes take, and the same-host pushes that fell back to gRPC."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2

__all__ = ["adapter_push_failed", "adapter_pushed", "forget_replica", "pushed", "shm_fallback", "transport_name"]

_TRANSPORTS = {
    pb2.TRANSPORT_GRPC: "grpc",
    pb2.TRANSPORT_SHARED_FS: "shared_fs",
    pb2.TRANSPORT_NCCL: "nccl",
    pb2.TRANSPORT_SHM: "shm",
}

_pushes = Counter(
    "primerl_weight_broadcaster_pushes", "Versions that landed on a replica, by the transport they took.",
    ("replica_id", "transport"),
)  # fmt: skip
_replica_transport = Gauge(
    "primerl_weight_broadcaster_replica_transport",
    "1 for the transport of the replica's last push (for transport auto: the one the broadcaster picked), else 0.",
    ("replica_id", "transport"),
)
_shm_fallbacks = Counter(
    "primerl_weight_broadcaster_shm_fallbacks",
    "Pushes over shared memory that failed and were made again over gRPC.",
    ("replica_id",),
)

_adapter_pushes = Counter(
    "primerl_weight_broadcaster_adapter_pushes", "LoRA adapter versions that landed on a replica.", ("replica_id",)
)
_adapter_push_failures = Counter(
    "primerl_weight_broadcaster_adapter_push_failures",
    "LoRA adapter pushes (or unloads, or listings of a replica's adapters) that failed and are retried.",
    ("replica_id",),
)


def transport_name(transport: int) -> str:
    """ "grpc", "shared_fs", "nccl" or "shm"."""
    return _TRANSPORTS.get(transport) or pb2.Transport.Name(transport)


def pushed(replica_id: str, transport: int) -> None:
    name = transport_name(transport)
    _pushes.labels(replica_id, name).inc()
    for other in _TRANSPORTS.values():
        _replica_transport.labels(replica_id, other).set(1 if other == name else 0)


def shm_fallback(replica_id: str) -> None:
    _shm_fallbacks.labels(replica_id).inc()


def adapter_pushed(replica_id: str) -> None:
    _adapter_pushes.labels(replica_id).inc()


def adapter_push_failed(replica_id: str) -> None:
    _adapter_push_failures.labels(replica_id).inc()


def forget_replica(replica_id: str) -> None:
    """Removes a deregistered replica's series."""
    for name in _TRANSPORTS.values():
        for metric in (_pushes, _replica_transport):
            with contextlib.suppress(KeyError):
                metric.remove(replica_id, name)
    for metric in (_shm_fallbacks, _adapter_pushes, _adapter_push_failures):
        with contextlib.suppress(KeyError):
            metric.remove(replica_id)
