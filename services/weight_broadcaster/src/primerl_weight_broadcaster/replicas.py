"""The weight broadcaster's record of each registered inference replica (`Replica`), the push
settings, and the pure decisions a push makes from them: the transport a TRANSPORT_AUTO replica
takes (`pick_transport`) and the split of a version's tensors over the streams of a striped push
(`split_stripes`). The task that pushes to each replica is pusher.py's; the set of them,
replica_set.py's."""

from __future__ import annotations

import dataclasses

import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.stripes import DEFAULT_STREAMS
from primerl_weight_broadcaster.collective import CollectiveHost
from primerl_weight_broadcaster.shm import SharedMemory

__all__ = [
    "CAPABILITY_REPLICA_DELTA",
    "PushSettings",
    "Replica",
    "UnsupportedByReplica",
    "pick_transport",
    "split_stripes",
]

# What an inference replica lists in its capabilities when it accepts delta updates, and
# each weight format it loads ("weights.format.<name>", see formats.FORMAT_NAMES).
CAPABILITY_REPLICA_DELTA = "weights.delta"
CAPABILITY_REPLICA_FORMAT = "weights.format.{}"
CAPABILITY_REPLICA_SHARED_FS = "weights.shared_fs"
CAPABILITY_REPLICA_SHM = "weights.shm"
CAPABILITY_REPLICA_STRIPED = "weights.striped"


class UnsupportedByReplica(Exception):
    """The replica lacks a capability its registration asks for (retried: it may be upgraded)."""


@dataclasses.dataclass(frozen=True)
class PushSettings:
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 5.0
    push_timeout_s: float = 600.0
    streams: int = DEFAULT_STREAMS


@dataclasses.dataclass
class Replica:
    replica_id: str
    address: str
    delta: bool
    format: int = tensor_pb2.WEIGHT_FORMAT_HF
    transport: int = pb2.TRANSPORT_GRPC
    state: int = pb2.REPLICA_STATE_BEHIND
    policy_version: int = -1
    target_policy_version: int = -1
    last_error: str = ""
    num_consecutive_failures: int = 0
    next_retry_at: float = 0.0  # wall clock; 0 when no retry is planned
    last_push_s: float = 0.0
    num_bytes_sent_total: int = 0
    num_tensors_last_push: int = 0
    num_bytes_last_push: int = 0
    last_push_delta: bool = False
    instance_id: str = ""
    capabilities: frozenset[str] = frozenset()
    # (instance id, version) of the last push: a delta is sent only on top of weights this
    # broadcaster pushed to this very process, never on top of a checkpoint it did not write.
    pushed: tuple[str, int] | None = None
    # Whether its last probe was answered (a TRANSPORT_NCCL replica joins groups only then).
    reachable: bool = False
    # Its GetServiceInfo attributes (host and shared-memory identity, shm.py).
    attributes: dict[str, str] = dataclasses.field(default_factory=dict)
    # Why this process of the replica gets no shared-memory pushes (it could not load one).
    shm_failed: str = ""
    last_push_transport: int = pb2.TRANSPORT_UNSPECIFIED
    transport_reason: str = ""
    # The version of each LoRA adapter its process holds (adapters.py).
    adapter_versions: dict[str, int] = dataclasses.field(default_factory=dict)
    # The owners of those that have one.
    adapter_owners: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_proto(self) -> pb2.ReplicaStatus:
        status = pb2.ReplicaStatus(
            replica_id=self.replica_id,
            address=self.address,
            state=self.state,
            policy_version=self.policy_version,
            target_policy_version=self.target_policy_version,
            last_error=self.last_error,
            num_consecutive_failures=self.num_consecutive_failures,
            last_push_s=self.last_push_s,
            num_bytes_sent_total=self.num_bytes_sent_total,
            format=self.format,
            transport=self.transport,
            delta=self.delta,
            num_tensors_last_push=self.num_tensors_last_push,
            num_bytes_last_push=self.num_bytes_last_push,
            last_push_delta=self.last_push_delta,
            last_push_transport=self.last_push_transport,
            transport_reason=self.transport_reason,
            adapter_versions=self.adapter_versions,
            adapter_owners=self.adapter_owners,
        )
        if self.next_retry_at:
            status.next_retry_at.FromNanoseconds(int(self.next_retry_at * 1e9))
        return status


def pick_transport(replica: Replica, shm: SharedMemory | None, collective: CollectiveHost | None) -> tuple[int, str]:
    """The transport a push to `replica` takes: the registered one, unless TRANSPORT_AUTO, for
    which one is picked from what the replica's last probe said (its capabilities and
    attributes), and why: shared memory when it shares the broadcaster's (`shm.route`), else
    the collective group where there is one it can join, else gRPC."""
    if replica.transport != pb2.TRANSPORT_AUTO:
        return replica.transport, ""
    reasons = []
    if shm is None:
        reasons.append("the broadcaster has no shm.folder")
    elif CAPABILITY_REPLICA_SHM not in replica.capabilities:
        reasons.append(f"no capability {CAPABILITY_REPLICA_SHM}")
    elif replica.shm_failed:
        reasons.append(replica.shm_failed)
    else:
        folder, why = shm.route(replica.attributes)
        if folder is not None:
            return pb2.TRANSPORT_SHM, why
        reasons.append(why)
    if (
        collective is not None
        and replica.format == tensor_pb2.WEIGHT_FORMAT_HF
        and collective.capability in replica.capabilities
    ):
        return pb2.TRANSPORT_NCCL, "; ".join([*reasons, "a collective group"])
    return pb2.TRANSPORT_GRPC, "; ".join(reasons)


def split_stripes(tensors: list[tuple[str, torch.Tensor]], num_stripes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`tensors` dealt to at most `num_stripes` stripes of about equal bytes (largest first,
    each to the lightest stripe), in their order within each stripe; the same split for the
    same tensors, so that the replicas pushed at once share each stripe's serialization."""
    num_stripes = min(num_stripes, len(tensors))
    loads = [0] * num_stripes
    owner = [0] * len(tensors)
    for position in sorted(range(len(tensors)), key=lambda i: -tensors[i][1].numel() * tensors[i][1].element_size()):
        lightest = min(range(num_stripes), key=loads.__getitem__)
        owner[position] = lightest
        loads[lightest] += tensors[position][1].numel() * tensors[position][1].element_size()
    return [
        [tensor for position, tensor in enumerate(tensors) if owner[position] == stripe]
        for stripe in range(num_stripes)
    ]
