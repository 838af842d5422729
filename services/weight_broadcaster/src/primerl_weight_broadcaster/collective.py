"""The TRANSPORT_NCCL side of the broadcaster: it hosts the TCPStore every member of a
collective group connects to, decides who joins each version's broadcast, and names the
group (primerl_common.weights.collective has the plumbing the trainer and the replicas share).

Membership: every TRANSPORT_NCCL replica that answered its last probe and lists the
capability "weights.collective.<backend>", in registration order, ranks 1..N after the
trainer (rank 0). A group keeps its name, and members keep the group they built, while the
membership stays the same; a change (a replica registers, leaves, stops answering), any
failed broadcast, or a trainer that holds no group (restarted) makes the next version form a
new generation under a new name. The
broadcaster receives no tensor data for a version broadcast to every replica; it asks the
trainer for the data too (`send_data`) when some replica is not in the group. A member that
fails to load the latest version undoes its announcement (`CollectiveHost.member_failed`), so
that the trainer publishes it again.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Sequence

import torch.distributed as dist

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_common.tensors import dtype_from_proto

__all__ = [
    "CAPABILITY_REPLICA_COLLECTIVE",
    "CollectiveHost",
    "CollectiveSettings",
    "check_tensor_list",
    "replica_update",
]

CAPABILITY_REPLICA_COLLECTIVE = "weights.collective.{}"


@dataclasses.dataclass(frozen=True)
class CollectiveSettings:
    backend: str
    store_host: str = "127.0.0.1"
    store_port: int = 0
    timeout_s: float = 120.0
    bucket_mib: int = 256
    keep_data: bool = False


class CollectiveHost:
    def __init__(self, settings: CollectiveSettings) -> None:
        self.settings = settings
        # Only the broadcaster's address is ever handed out: members connect as clients.
        self._store = dist.TCPStore(settings.store_host, settings.store_port, is_master=True, wait_for_workers=False)
        self.store_address = f"{settings.store_host}:{self._store.port}"
        # Group names of an earlier broadcaster process never come back.
        self._session = uuid.uuid4().hex[:12]
        self._generation = 0
        self._members: tuple[str, ...] | None = None
        # The latest version announced by PublishCollective (-1: none), and the one before it.
        self.announced_policy_version = -1
        self._announced_before = -1

    @property
    def capability(self) -> str:
        return CAPABILITY_REPLICA_COLLECTIVE.format(self.settings.backend)

    def announce(self, policy_version: int) -> None:
        self._announced_before, self.announced_policy_version = self.announced_policy_version, policy_version

    def member_failed(self, policy_version: int) -> None:
        """A member did not load `policy_version` from its group: the next version forms a new
        generation, and the announcement of the latest one is undone. The broadcaster has no data of
        an announced version unless the trainer sent it too; undone, the version counts as not
        published: the trainer's watch of GetStatus sees the broadcaster behind what it published
        and publishes it again, with its data, which the broadcaster pushes over gRPC to the
        replicas that lack it, instead of leaving the failed member behind until the next version."""
        self._members = None
        if policy_version == self.announced_policy_version:
            self.announced_policy_version = self._announced_before

    def check_version(self, policy_version: int, *, data: bool) -> None:
        """Refuses a version not newer than the announced one; `data`: the PublishWeights of
        the announced version itself is accepted."""
        announced = self.announced_policy_version
        if policy_version < announced or (policy_version == announced and not data):
            raise FailedPrecondition(
                f"policy version {policy_version} is not newer than the latest published {announced}; "
                "a resumed trainer must publish versions above it",
                subject="begin.policy_version",
                reason="POLICY_VERSION_NOT_NEWER",
                metadata={"latest_policy_version": str(announced)},
            )

    def group(self, members: Sequence[str], *, new: bool = False) -> tuple[str, int]:
        """The name of the group of `members` (a new generation when they changed, or when `new`)
        and its size."""
        if new or self._members != tuple(members):
            self._generation += 1
            self._members = tuple(members)
        return f"primerl/weights/{self._session}/gen{self._generation}", len(members) + 1

    def member_group(self, name: str, rank: int, world_size: int) -> inference_pb2.CollectiveGroup:
        return inference_pb2.CollectiveGroup(
            store_address=self.store_address,
            group_name=name,
            rank=rank,
            world_size=world_size,
            backend=self.settings.backend,
            timeout_ms=int(self.settings.timeout_s * 1000),
            bucket_bytes=self.settings.bucket_mib * 2**20,
        )


def check_tensor_list(request: pb2.PublishCollectiveRequest) -> None:
    """Refuses a tensor list that does not match its `begin` or names a tensor twice."""
    field = "tensors"
    names: set[str] = set()
    num_bytes = 0
    for header in request.tensors:
        if not header.name or header.name in names:
            raise InvalidArgument(f"tensor names must be set and unique ({header.name!r})", field=f"{field}.name")
        names.add(header.name)
        try:
            dtype = dtype_from_proto(header.dtype)
        except ValueError as exc:
            raise InvalidArgument(f"tensor {header.name!r}: {exc}", field=f"{field}.dtype") from None
        if any(dim < 0 for dim in header.shape):
            raise InvalidArgument(f"tensor {header.name!r} has a negative dimension", field=f"{field}.shape")
        size = dtype.itemsize * math.prod(header.shape)
        if header.num_bytes != size:
            raise InvalidArgument(
                f"tensor {header.name!r}: num_bytes {header.num_bytes}, its shape and dtype make {size}",
                field=f"{field}.num_bytes",
            )
        num_bytes += size
    if not names:
        raise InvalidArgument("a publish must carry at least one tensor", field=field)
    begin = request.begin
    if (begin.num_tensors, begin.num_bytes) != (len(names), num_bytes):
        raise InvalidArgument(
            f"the list holds {len(names)} tensors of {num_bytes} bytes, "
            f"begin announced {begin.num_tensors} and {begin.num_bytes}",
            field="begin",
        )


def replica_update(
    request: pb2.PublishCollectiveRequest, group: inference_pb2.CollectiveGroup
) -> inference_pb2.WeightUpdateBegin:
    """The UpdateWeights `begin` that makes a replica join `group` for this version."""
    begin = request.begin
    return inference_pb2.WeightUpdateBegin(
        policy_version=begin.policy_version,
        format=tensor_pb2.WEIGHT_FORMAT_HF,
        num_tensors=begin.num_tensors,
        num_bytes=begin.num_bytes,
        collective=group,
        collective_tensors=request.tensors,
    )
