"""The latest published policy version, held in RAM (or, with a spill folder, mapped from its
copy on disk: spill.py), which tensors each version changed, and the version converted to
each format a replica asked for (once per version and format).

Version rule: a publish must carry a version greater than the latest one; anything else is
refused with FAILED_PRECONDITION. Replicas refuse versions not newer than the one they serve,
so accepting a lower version (a trainer resumed from an older checkpoint) would strand every
replica. Such a trainer must resume with versions above the latest, or the broadcaster and
replicas must be restarted together (and the spill folder emptied).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import pathlib
import weakref

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_common.weights.engine_modules import engine_module
from primerl_common.weights.fp8_blocks import block_pairs
from primerl_common.weights.manifest import ManifestTensor
from primerl_weight_broadcaster.formats import convert
from primerl_weight_broadcaster.spill import SpilledVersion, SpillFolder

__all__ = ["PublishedVersion", "ShmFile", "ShmPlacement", "WeightStore"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class ShmFile:
    """A raw data file in shared memory that a publish was received into (shm.py); its name is
    removed once nothing holds this (version folders that link the file keep its bytes)."""

    path: pathlib.Path

    def __post_init__(self) -> None:
        weakref.finalize(self, _unlink, self.path)


@dataclasses.dataclass(frozen=True)
class ShmPlacement:
    """Where a version's tensors lie in shared memory: its data files (by name) and each
    tensor's place in them (`ManifestTensor.file` names its file)."""

    files: dict[str, ShmFile]
    tensors: dict[str, ManifestTensor]
    # No tensor holds NaN or Inf (checked as they were received: replicas take this word for it).
    finite: bool = False

    @classmethod
    def joined(cls, parts: list[ShmPlacement]) -> ShmPlacement:
        return cls(
            {name: f for part in parts for name, f in part.files.items()},
            {name: t for part in parts for name, t in part.tensors.items()},
            all(part.finite for part in parts),
        )


def _unlink(path: pathlib.Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """One published version in one format; never modified once stored (pushes in flight keep
    reading it)."""

    policy_version: int
    tensors: dict[str, torch.Tensor]
    # Version at which each tensor, or another of its engine module, last changed value, shape
    # or dtype: a delta carries whole modules (primerl_common.weights.engine_modules).
    last_changed: dict[str, int]
    # First version since which every change is recorded (the first this process, or the one
    # whose spill it loaded, stored): deltas from an older base are not known.
    first_policy_version: int
    num_changed_tensors: int
    num_bytes: int
    format: int = tensor_pb2.WEIGHT_FORMAT_HF
    # The HF config model_type the publisher named ("": Qwen3 / Qwen3-MoE): the kernel layout.
    model_type: str = ""
    # Where the tensors were received in shared memory (shm.py), when they were.
    placement: ShmPlacement | None = None

    @functools.cached_property
    def holds_block_fp8(self) -> bool:
        """Whether some weights were published in block FP8 (then even the HF format converts)."""
        return bool(block_pairs(self.tensors))

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


def _version(
    policy_version: int,
    tensors: dict[str, torch.Tensor],
    last_changed: dict[str, int],
    first_policy_version: int,
    weight_format: int = tensor_pb2.WEIGHT_FORMAT_HF,
    model_type: str = "",
    placement: ShmPlacement | None = None,
) -> PublishedVersion:
    return PublishedVersion(
        policy_version=policy_version,
        tensors=tensors,
        last_changed=last_changed,
        first_policy_version=first_policy_version,
        num_changed_tensors=sum(1 for v in last_changed.values() if v == policy_version),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        format=weight_format,
        model_type=model_type,
        placement=placement,
    )


def _converted(hf: PublishedVersion, weight_format: int) -> PublishedVersion:
    """`hf` in `weight_format`: a converted tensor last changed when the last of its sources did."""
    converted = convert(hf.tensors, weight_format, hf.model_type)
    last_changed = _whole_modules(
        {name: max(hf.last_changed[source] for source in sources) for name, sources in converted.sources.items()}
    )
    return _version(
        hf.policy_version, converted.tensors, last_changed, hf.first_policy_version, weight_format, hf.model_type
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() == 1:  # float8: no torch.equal on the CPU; the bits
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


class WeightStore:
    def __init__(self, spill: SpillFolder | None = None) -> None:
        """With `spill`, starts on the newest version spilled there (blocking: it reads it)."""
        self._spill = spill
        self.latest: PublishedVersion | None = None
        # The latest version's conversions, started by the first replica that needs each format.
        self._conversions: dict[int, asyncio.Future[PublishedVersion]] = {}
        if spill is not None and (spilled := spill.load_latest()) is not None:
            self.latest = _version(
                spilled.policy_version,
                spilled.tensors,
                spilled.last_changed,
                spilled.first_policy_version,
                model_type=spilled.model_type,
            )

    async def in_format(self, version: PublishedVersion, weight_format: int) -> PublishedVersion:
        """`version` (HF) in `weight_format`, converted once (off the event loop) however many
        replicas ask; ValueError when the weights do not fit the format."""
        if weight_format == tensor_pb2.WEIGHT_FORMAT_HF and not version.holds_block_fp8:
            return version
        # Superseded while a push started: not worth caching. (Compared by version: the latest
        # may since be held as views of its spilled files, the same data.)
        if version.policy_version != self.latest_policy_version:
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

    def publish(self, policy_version: int, tensors: dict[str, torch.Tensor], model_type: str = "") -> PublishedVersion:
        """Stores `tensors` as the latest version, spilled when the store spills, and returns it
        (blocking: the servicer runs the steps apart, see PublishWeights)."""
        version = self.make_latest(self.prepare(policy_version, tensors, model_type))
        self.hold_spilled(version, self.spill(version))
        return self.latest

    def prepare(
        self,
        policy_version: int,
        tensors: dict[str, torch.Tensor],
        model_type: str = "",
        placement: ShmPlacement | None = None,
    ) -> PublishedVersion:
        """The version `tensors` (of a `model_type` model; views of shared memory where
        `placement` says) make on top of the latest (it compares them: blocking, so run off the
        event loop, one at a time, and `make_latest` it before the next)."""
        self.check_version(policy_version)
        try:
            block_pairs(tensors)  # block-FP8 weights come with scales that fit them
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="chunk") from None
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
        return _version(policy_version, tensors, last_changed, first, model_type=model_type, placement=placement)

    def make_latest(self, version: PublishedVersion) -> PublishedVersion:
        """Stores a version `prepare` returned (on the event loop: pushes read `latest`)."""
        self.check_version(version.policy_version)
        self._conversions = {}
        self.latest = version
        return version

    def spill(self, version: PublishedVersion) -> PublishedVersion | None:
        """`version` written to the spill folder, with its tensors views of the files; None
        without a spill folder, or when the write failed (logged: the version stays in RAM, and
        a restart loads an older one, which the trainer notices and publishes again). Blocking."""
        if self._spill is None:
            return None
        spilled = SpilledVersion(
            version.policy_version,
            version.tensors,
            version.last_changed,
            version.first_policy_version,
            version.model_type,
        )
        try:
            return dataclasses.replace(version, tensors=self._spill.write(spilled).tensors)
        except (OSError, RuntimeError) as exc:  # disk full, folder gone; torch's mapping failed
            logger.error("spilling policy version %d to store.spill_folder failed: %s", version.policy_version, exc)
            return None

    def hold_spilled(self, version: PublishedVersion, spilled: PublishedVersion | None) -> None:
        """Holds `spilled` instead of `version` (RAM copies), if that is still the latest (on
        the event loop). Its conversions stay: they are of the same data."""
        if spilled is not None and self.latest is version:
            self.latest = spilled
