"""The latest published policy version, held in RAM, which tensors each version changed, and
the version converted to each format a replica asked for (once per version and format).

Version rule: a publish must carry a version greater than the latest one; anything else is
refused with FAILED_PRECONDITION. Replicas refuse versions not newer than the one they serve,
so accepting a lower version (a trainer resumed from an older checkpoint) would strand every
replica. Such a trainer must resume with versions above the latest, or the broadcaster and
replicas must be restarted together.
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.engine_modules import engine_module
from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_weight_broadcaster.formats import convert

__all__ = ["PublishedVersion", "WeightStore"]


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """One published version in one format; never modified once stored (pushes in flight keep
    reading it)."""

    policy_version: int
    tensors: dict[str, torch.Tensor]
    # Version at which each tensor, or another of its engine module, last changed value, shape
    # or dtype: a delta carries whole modules (primerl_common.engine_modules).
    last_changed: dict[str, int]
    # First version this process stored: deltas from an older base are not known.
    first_policy_version: int
    num_changed_tensors: int
    num_bytes: int
    format: int = tensor_pb2.WEIGHT_FORMAT_HF

    def tensors_since(self, base_policy_version: int | None) -> list[tuple[str, torch.Tensor]]:
        """Tensors to send a replica serving `base_policy_version` (None or unknown base: all)."""
        if base_policy_version is None or base_policy_version < self.first_policy_version:
            return list(self.tensors.items())
        return [(name, t) for name, t in self.tensors.items() if self.last_changed[name] > base_policy_version]


def _whole_modules(last_changed: dict[str, int]) -> dict[str, int]:
    """Each tensor's last change raised to its engine module's: a delta sends whole modules."""
    module_changed: dict[str, int] = {}
    for name, version in last_changed.items():
        module = engine_module(name)
        module_changed[module] = max(version, module_changed.get(module, version))
    return {name: module_changed[engine_module(name)] for name in last_changed}


def _converted(hf: PublishedVersion, weight_format: int) -> PublishedVersion:
    """`hf` in `weight_format`: a converted tensor last changed when the last of its sources did."""
    converted = convert(hf.tensors, weight_format)
    last_changed = _whole_modules(
        {name: max(hf.last_changed[source] for source in sources) for name, sources in converted.sources.items()}
    )
    return PublishedVersion(
        policy_version=hf.policy_version,
        tensors=converted.tensors,
        last_changed=last_changed,
        first_policy_version=hf.first_policy_version,
        num_changed_tensors=sum(1 for v in last_changed.values() if v == hf.policy_version),
        num_bytes=sum(t.numel() * t.element_size() for t in converted.tensors.values()),
        format=weight_format,
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


class WeightStore:
    def __init__(self) -> None:
        self.latest: PublishedVersion | None = None
        # The latest version's conversions, started by the first replica that needs each format.
        self._conversions: dict[int, asyncio.Future[PublishedVersion]] = {}

    async def in_format(self, version: PublishedVersion, weight_format: int) -> PublishedVersion:
        """`version` (HF) in `weight_format`, converted once (off the event loop) however many
        replicas ask; ValueError when the weights do not fit the format."""
        if weight_format == tensor_pb2.WEIGHT_FORMAT_HF:
            return version
        if version is not self.latest:  # superseded while a push started: not worth caching
            return await asyncio.to_thread(_converted, version, weight_format)
        conversion = self._conversions.get(weight_format)
        if conversion is None:
            conversion = asyncio.ensure_future(asyncio.to_thread(_converted, version, weight_format))
            self._conversions[weight_format] = conversion
        # Shielded: a replica task cancelled mid-wait does not cancel the others' conversion.
        return await asyncio.shield(conversion)

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
            last_changed = _whole_modules(
                {
                    name: previous.last_changed[name]
                    if name in previous.tensors and _same(previous.tensors[name], t)
                    else policy_version
                    for name, t in tensors.items()
                }
            )
            first = previous.first_policy_version
            if set(previous.tensors) - set(tensors):
                # A tensor disappeared: a delta cannot express that, so older bases get everything.
                first = policy_version
        num_changed = sum(1 for v in last_changed.values() if v == policy_version)
        self._conversions = {}
        self.latest = PublishedVersion(
            policy_version=policy_version,
            tensors=tensors,
            last_changed=last_changed,
            first_policy_version=first,
            num_changed_tensors=num_changed,
            num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        )
        return self.latest
