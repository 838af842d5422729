"""cache_aware: the candidate where the request is cheapest to serve, counting
the prompt tokens it would have to prefill (those not in that replica's prefix
cache) and the requests already queued or running there, the way KV-aware
routers score workers.

The router cannot see a replica's cache; it remembers what it sent where. Each
prompt is cut into blocks of `block_bytes` of its wire encoding, each block
hashed together with all blocks before it (and the cache salt and LoRA
adapter, which partition the engine's cache too), so a block hash stands for a
whole prefix. A replica's recent blocks are kept in an LRU of
`max_blocks_per_replica` (roughly its KV capacity); a request's cached prefix
on a replica is the run of its leading block hashes found there.

    cost = uncached prompt tokens + load_cost_tokens * outstanding requests
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from primerl_router.policies.base import RoutingPolicy

if TYPE_CHECKING:
    from primerl_router.replica import Replica
    from primerl_router.request import RouteRequest


def prefix_block_hashes(request: RouteRequest, block_bytes: int) -> list[int]:
    """Chained hashes of the request's full prompt blocks (a trailing partial
    block is left out: the engine caches only full blocks as well)."""
    prompt = request.prompt
    digest = hash((request.cache_salt, request.lora_adapter))
    hashes = []
    for start in range(0, len(prompt) - block_bytes + 1, block_bytes):
        digest = hash((digest, prompt[start : start + block_bytes]))
        hashes.append(digest)
    return hashes


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    class Options(RoutingPolicy.Options):
        block_bytes: int = Field(default=128, ge=8, description="prefix block size, in bytes of the encoded prompt")
        max_blocks_per_replica: int = Field(default=1 << 16, ge=1, description="blocks remembered per replica")
        load_cost_tokens: float = Field(
            default=256.0, ge=0, description="one request queued or running costs as much as prefilling these tokens"
        )

    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        # Block hashes of the request being routed, computed once for choose and on_routed.
        self._last: tuple[RouteRequest, list[int]] | None = None
        self._turn = 0

    def _hashes(self, request: RouteRequest) -> list[int]:
        if self._last is None or self._last[0] is not request:
            self._last = (request, prefix_block_hashes(request, self.options.block_bytes))
        return self._last[1]

    def cached_blocks(self, request: RouteRequest, replica: Replica) -> int:
        blocks = self._blocks.get(replica.replica_id)
        if not blocks:
            return 0
        matched = 0
        for digest in self._hashes(request):
            if digest not in blocks:
                break
            matched += 1
        return matched

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        num_tokens = request.num_prompt_tokens
        tokens_per_byte = num_tokens / len(request.prompt) if request.prompt else 0.0
        tokens_per_block = self.options.block_bytes * tokens_per_byte
        self._turn += 1
        best, best_key = candidates[0], None
        for position, replica in enumerate(candidates):
            uncached = num_tokens - self.cached_blocks(request, replica) * tokens_per_block
            cost = uncached + self.options.load_cost_tokens * replica.outstanding
            # Ties: fewer outstanding requests first, then round robin.
            key = (cost, replica.outstanding, (position - self._turn) % len(candidates))
            if best_key is None or key < best_key:
                best, best_key = replica, key
        return best

    def on_routed(self, request: RouteRequest, replica: Replica) -> None:
        blocks = self._blocks.setdefault(replica.replica_id, OrderedDict())
        for digest in self._hashes(request):
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.options.max_blocks_per_replica:
            blocks.popitem(last=False)

    def on_membership_change(self, replicas: Sequence[Replica]) -> None:
        registered = {replica.replica_id for replica in replicas}
        for replica_id in list(self._blocks):
            if replica_id not in registered:
                del self._blocks[replica_id]

    def on_prefix_cache_reset(self, replica: Replica) -> None:
        self._blocks.pop(replica.replica_id, None)
