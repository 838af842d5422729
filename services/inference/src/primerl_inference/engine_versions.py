"""The weight-version stamp of the engine: the policy version of the base weights and of
every loaded LoRA adapter, in one string.

vLLM's engine core stamps every step's outputs with one string (`AsyncLLM.update_weight_version`,
`EngineCore._attach_weight_version`) and the frontend keeps, per request, where each stamp's
span of output tokens starts. One string for the whole engine is enough for exact per-token
versions of every request, adapter or not, when it names all the versions the step ran with:
`"7"` (base weights at 7, no adapter), `"7;math=3;code=12"`. It is set while scheduling is
paused, after the weights or adapter it names are in place (weight_updates.py, adapters.py),
so each step's outputs carry the versions that sampled them.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping

__all__ = ["EngineVersions", "engine_version_stamp", "parse_engine_version_stamp"]

_ENTRY_SEPARATOR = ";"
_VERSION_SEPARATOR = "="


@dataclasses.dataclass(frozen=True)
class EngineVersions:
    base: int
    adapters: Mapping[str, int]

    def policy_version(self, adapter: str = "") -> int:
        """The version a token of a request with `adapter` ("" for none) is tagged with."""
        if not adapter:
            return self.base
        version = self.adapters.get(adapter)
        if version is None:
            raise RuntimeError(f"the engine's weight version names no adapter {adapter!r}")
        return version


def engine_version_stamp(base: int, adapters: Mapping[str, int]) -> str:
    return _ENTRY_SEPARATOR.join(
        [str(base), *(f"{name}{_VERSION_SEPARATOR}{version}" for name, version in sorted(adapters.items()))]
    )


@functools.lru_cache(maxsize=256)  # every chunk of every request reads a stamp; few are distinct
def parse_engine_version_stamp(stamp: str) -> EngineVersions:
    base, *entries = stamp.split(_ENTRY_SEPARATOR)
    adapters = {}
    for entry in entries:
        name, version = entry.rsplit(_VERSION_SEPARATOR, 1)
        adapters[name] = int(version)
    return EngineVersions(int(base), types.MappingProxyType(adapters))
