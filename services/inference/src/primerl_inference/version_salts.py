"""Prefix reuse only within one policy version.

The rule: a request is salted with the policy version the replica serves when it admits it,
before the caller's own salt (`primerl_common.kvpool.keys.served_cache_salt`); the KV pool's
namespace is that version. A request whose first token is not sampled at that version is
started again under the new version's salt, none of its tokens kept: either the update
that comes before its first token aborts it (`restart_unstarted`, while scheduling is paused)
or, where the frontend had not seen it yet, its first token's version gives it away
(`streaming.stream_chunks`).

Why no returned request reuses KV of another version. vLLM looks a request's prefix up (local
prefix cache, then the pool through the KV connector) when it first schedules it, which is
after its admission and before its first token. Weight versions only grow, and change only
while scheduling is paused (weight_updates.py: pause, load, tell the connector, stamp,
resume); the version read at admission is stamped after the weights are loaded, so it is at
most the one the weights hold at any later step. A returned request's first token was sampled
at its salt's version s, so every step from admission to first token ran s's weights: its
lookup happened at s. What it can hit under salt s was computed by requests salted s, and
those ran at s or later; at the lookup no later version had been loaded yet, so every block
hit holds s's KV. The pool namespace s holds only s's KV too: the connector moves no block of a
namespace older than its weights (a request running across an update computes its later
blocks with the newer weights under its old salt; they stay local, where no new request is
given that salt). Requests running when an update lands keep their KV and go on (their
tokens carry the versions that sampled them); that is the in-flight case, not reuse.

A request with a LoRA adapter is computed with two sets of weights, the base's and the
adapter's, and either may change (an adapter is replaced in place, adapters.py). Its policy
version is the adapter's (the pool namespace its salt names, what its tokens are tagged with),
and the rest of its salt names the base version and the adapter's load (a number that changes
with every replacement, of unversioned adapters too): a request admitted after either changed
never looks up KV computed before. The same reasoning holds with the pair in place of the one
version: both change only while scheduling is paused, before the stamp that names them, and
an update or replacement before the first token starts the request again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

from vllm.v1.engine.async_llm import AsyncLLM

from primerl_common.kvpool.keys import served_cache_salt

__all__ = ["ServedAt", "VersionSalts"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServedAt:
    """The weights a request is admitted at: the base version and, with a LoRA adapter, that
    adapter's name, version and load number (adapters.py)."""

    base: int
    adapter: str = ""
    adapter_version: int = 0
    adapter_load: int = 0

    @property
    def policy_version(self) -> int:
        """What its tokens are tagged with and its pool namespace names."""
        return self.adapter_version if self.adapter else self.base

    def cache_salt(self, caller_salt: str) -> str:
        if not self.adapter:
            return served_cache_salt(self.base, caller_salt)
        within = f"base{self.base}.load{self.adapter_load}"
        return served_cache_salt(self.adapter_version, f"{within}:{caller_salt}" if caller_salt else within)


class VersionSalts:
    """The requests in the engine (engine request ids) with the versions their salt names."""

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm
        self._salted: dict[str, ServedAt] = {}
        self._restarting: set[str] = set()

    @contextlib.contextmanager
    def attempt(self, engine_request_id: str, served: ServedAt, caller_salt: str) -> Iterator[str]:
        """The cache salt of one attempt at a request admitted at `served`, tracked while it runs."""
        self._salted[engine_request_id] = served
        try:
            yield served.cache_salt(caller_salt)
        finally:
            self._salted.pop(engine_request_id, None)
            self._restarting.discard(engine_request_id)

    def restarting(self, engine_request_id: str) -> bool:
        """True once `restart_unstarted` aborted the attempt: its outputs are dropped."""
        return engine_request_id in self._restarting

    async def restart_unstarted(self, new_version: int) -> None:
        """Aborts the attempts salted with an older base version that have no token yet, to be
        started again (called while scheduling is paused for the update): they would otherwise
        run to their end before their first token's version was seen."""
        await self._restart(lambda served: served.base < new_version, f"policy version {new_version}")

    async def restart_unstarted_with_adapter(self, name: str, load: int) -> None:
        """`restart_unstarted` for adapter `name` replaced by its load number `load`."""
        await self._restart(
            lambda served: served.adapter == name and served.adapter_load < load, f"the replacement of adapter {name!r}"
        )

    async def _restart(self, salted_before: Callable[[ServedAt], bool], change: str) -> None:
        unstarted = [
            request_id
            for request_id, served in self._salted.items()
            if salted_before(served) and self._has_no_token(request_id)
        ]
        if not unstarted:
            return
        self._restarting.update(unstarted)
        logger.info("%d requests admitted before %s start again", len(unstarted), change)
        try:
            await self._llm.abort(unstarted)
        except Exception:  # they then run on until their first token's version is seen
            logger.warning("could not abort the requests to start again", exc_info=True)

    def _has_no_token(self, engine_request_id: str) -> bool:
        """True for a request in the engine that has sampled no token the frontend has seen
        (vLLM internals: OutputProcessor.external_req_ids, RequestState.weight_version_starts).
        A token on its way is seen by the frontend before any chunk of it is sent."""
        output_processor = self._llm.output_processor
        internal_ids = output_processor.external_req_ids.get(engine_request_id, ())
        states = [output_processor.request_states.get(i) for i in internal_ids]
        return bool(states) and all(state is not None and not state.weight_version_starts for state in states)
