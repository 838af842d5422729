"""The registered replicas and the choice of one per request.

`check_adapter_owner` refuses, before any choice, a request for a LoRA adapter owned by
another identity than its caller. `pick` filters the replicas down to those that may take
the request and lets the routing policy choose; when none may, it waits (bounded) for one
to become eligible: a replica finishing its weight update to the version a request needs,
one coming back from a failed health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence

from primerl_common import security
from primerl_common.errors import FailedPrecondition, NotFound, Unavailable
from primerl_common.images import CAPABILITY_IMAGES
from primerl_router import metrics
from primerl_router.policies import RoutingPolicy
from primerl_router.replica import Replica
from primerl_router.request import RouteRequest

__all__ = ["ReplicaPool"]

logger = logging.getLogger(__name__)

# An open circuit turns half open with time, not with an event: waiters look again this often.
_RECHECK_S = 0.1


class ReplicaPool:
    def __init__(self, policy: RoutingPolicy, *, avoid_updating: bool = True) -> None:
        self.policy = policy
        self._avoid_updating = avoid_updating
        self._replicas: dict[str, Replica] = {}
        self._changed = asyncio.Event()
        self._num_waiters = 0

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def get(self, replica_id: str) -> Replica:
        try:
            return self._replicas[replica_id]
        except KeyError:
            raise NotFound(f"no replica {replica_id!r} is registered", reason="REPLICA_NOT_FOUND") from None

    def add(self, replica: Replica) -> None:
        self._replicas[replica.replica_id] = replica
        self.policy.on_membership_change(list(self._replicas.values()))
        self.notify()

    def remove(self, replica_id: str) -> Replica:
        replica = self.get(replica_id)
        del self._replicas[replica_id]
        self.policy.on_membership_change(list(self._replicas.values()))
        return replica

    def notify(self) -> None:
        """Something changed that may make a replica eligible: wake the waiters."""
        if self._num_waiters:
            self._changed.set()
            self._changed = asyncio.Event()

    def check_adapter_owner(self, request: RouteRequest, caller: security.Caller) -> None:
        """Raises PermissionDenied (NOT_ADAPTER_OWNER) when the request's LoRA adapter is owned, by
        any replica's report, by another identity than `caller` (operators may use any adapter).
        Replicas that name different owners leave it to operators alone."""
        if not request.lora_adapter:
            return
        owners = {
            replica.adapter_owners[request.lora_adapter]
            for replica in self._replicas.values()
            if request.lora_adapter in replica.adapter_owners
        }
        name = request.lora_adapter.decode(errors="replace")
        if len(owners) > 1:
            logger.warning("replicas disagree on the owner of adapter %r: %s", name, ", ".join(sorted(owners)))
        for owner in sorted(owners):  # the caller must be each of them: with two, only an operator is
            security.check_owner(caller, owner, what=f"adapter {name!r}", reason="NOT_ADAPTER_OWNER")

    def try_pick(self, request: RouteRequest, exclude: Sequence[Replica] = ()) -> Replica | None:
        """The replica for `request` now, or None when none may take it."""
        candidates = [r for r in self._replicas.values() if r.accepts(request) and r not in exclude]
        if self._avoid_updating and len(candidates) > 1:
            # Replicas in a weight update keep queued requests paused; use them only when no other can serve.
            settled = [replica for replica in candidates if not replica.updating]
            if settled:
                candidates = settled
        if not candidates:
            return None
        replica = candidates[0] if len(candidates) == 1 else self.policy.choose(request, candidates)
        self.policy.on_routed(request, replica)
        return replica

    async def pick(self, request: RouteRequest, exclude: Sequence[Replica] = (), *, wait_s: float = 0.0) -> Replica:
        """The replica for `request`, waiting up to `wait_s` for one to become
        eligible. Raises Unavailable, or FailedPrecondition when replicas are
        there but none serves the policy version the request needs."""
        replica = self.try_pick(request, exclude)
        if replica is not None:
            return replica
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + wait_s
        self._num_waiters += 1
        try:
            while (remaining := give_up_at - loop.time()) > 0:
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(remaining, _RECHECK_S))
                replica = self.try_pick(request, exclude)
                if replica is not None:
                    return replica
        finally:
            self._num_waiters -= 1
        raise self._no_replica_error(request, exclude)

    def _no_replica_error(self, request: RouteRequest, exclude: Sequence[Replica]) -> Exception:
        reasons = {r.replica_id: ("tried" if r in exclude else r.rejection(request)) for r in self._replicas.values()}
        summary = ", ".join(f"{replica_id}: {reason}" for replica_id, reason in sorted(reasons.items())) or "none"
        if request.min_policy_version > 0 and any(reason.startswith("policy version") for reason in reasons.values()):
            metrics.requests_without_replica.labels("policy_version").inc()
            return FailedPrecondition(
                f"no replica serves {_versioned(request)} >= {request.min_policy_version} (replicas: {summary})",
                subject="min_policy_version",
                reason="POLICY_VERSION_NOT_SERVED",
            )
        if request.lora_adapter and any(reason.startswith("no adapter") for reason in reasons.values()):
            metrics.requests_without_replica.labels("adapter").inc()
            name = request.lora_adapter.decode(errors="replace")
            return FailedPrecondition(
                f"no replica holds LoRA adapter {name!r} (replicas: {summary})",
                subject="lora_adapter",
                reason="ADAPTER_NOT_LOADED",
            )
        if request.num_images and any(reason.endswith(CAPABILITY_IMAGES) for reason in reasons.values()):
            metrics.requests_without_replica.labels("capability").inc()
            return FailedPrecondition(
                f"no replica takes images (capability {CAPABILITY_IMAGES}; replicas: {summary})",
                subject=CAPABILITY_IMAGES,
                reason="CAPABILITY_MISSING",
            )
        metrics.requests_without_replica.labels("unavailable").inc()
        return Unavailable(f"no replica can take the request (replicas: {summary})", reason="NO_REPLICA")


def _versioned(request: RouteRequest) -> str:
    if request.lora_adapter:
        return f"LoRA adapter {request.lora_adapter.decode(errors='replace')!r} at policy version"
    return "policy version"
