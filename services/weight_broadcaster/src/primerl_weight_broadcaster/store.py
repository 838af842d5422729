"""The latest published policy version, held in RAM, and which tensors each version changed.

Version rule: a publish must carry a version greater than the latest one; anything else is
refused with FAILED_PRECONDITION. Replicas refuse versions not newer than the one they serve,
so accepting a lower version (a trainer resumed from an older checkpoint) would strand every
replica. Such a trainer must resume with versions above the latest, or the broadcaster and
replicas must be restarted together.
"""

from __future__ import annotations

import dataclasses

import torch

from primerl_common.errors import FailedPrecondition, InvalidArgument

__all__ = ["PublishedVersion", "WeightStore"]


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """One published version; never modified once stored (pushes in flight keep reading it)."""

    policy_version: int
    tensors: dict[str, torch.Tensor]
    # Version at which each tensor last changed value, shape or dtype.
    last_changed: dict[str, int]
    # First version this process stored: deltas from an older base are not known.
    first_policy_version: int
    num_changed_tensors: int
    num_bytes: int

    def tensors_since(self, base_policy_version: int | None) -> list[tuple[str, torch.Tensor]]:
        """Tensors to send a replica serving `base_policy_version` (None or unknown base: all)."""
        if base_policy_version is None or base_policy_version < self.first_policy_version:
            return list(self.tensors.items())
        return [(name, t) for name, t in self.tensors.items() if self.last_changed[name] > base_policy_version]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


class WeightStore:
    def __init__(self) -> None:
        self.latest: PublishedVersion | None = None

    @property
    def latest_policy_version(self) -> int:
        return -1 if self.latest is None else self.latest.policy_version

    def check_version(self, policy_version: int) -> None:
        if policy_version < 0:
            raise InvalidArgument(f"must be >= 0, got {policy_version}", field="begin.policy_version")
        if policy_version <= self.latest_policy_version:
            raise FailedPrecondition(
                f"policy version {policy_version} is not newer than the latest published "
                f"{self.latest_policy_version}; a resumed trainer must publish versions above it",
                subject="begin.policy_version",
                reason="POLICY_VERSION_NOT_NEWER",
                metadata={"latest_policy_version": str(self.latest_policy_version)},
            )

    def publish(self, policy_version: int, tensors: dict[str, torch.Tensor]) -> PublishedVersion:
        """Stores `tensors` as the latest version and returns it."""
        self.check_version(policy_version)
        previous = self.latest
        if previous is None:
            last_changed = dict.fromkeys(tensors, policy_version)
            first = policy_version
        else:
            last_changed = {
                name: previous.last_changed[name]
                if name in previous.tensors and _same(previous.tensors[name], t)
                else policy_version
                for name, t in tensors.items()
            }
            first = previous.first_policy_version
            if set(previous.tensors) - set(tensors):
                # A tensor disappeared: a delta cannot express that, so older bases get everything.
                first = policy_version
        num_changed = sum(1 for v in last_changed.values() if v == policy_version)
        self.latest = PublishedVersion(
            policy_version=policy_version,
            tensors=tensors,
            last_changed=last_changed,
            first_policy_version=first,
            num_changed_tensors=num_changed,
            num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        )
        return self.latest
