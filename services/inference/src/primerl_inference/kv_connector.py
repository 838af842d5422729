"""`PrimerlKVConnector`: a vLLM v1 KV connector backed by the primerl-kvstore pool, so one
replica reuses a prefix another replica computed.

vLLM loads it by name (`kv_transfer_config`: `kv_connector="PrimerlKVConnector"`,
`kv_connector_module_path="primerl_inference.kv_connector"`; `kv_transfer_config()` below
builds that from the `[kv_cache_pool]` section). It has vLLM's two halves:

- scheduler side: for a new request, how many whole blocks past its local prefix-cache hit
  the pool holds (`BatchExists` on the metadata role); after allocation, which of its
  blocks to fill from the pool; each step, which blocks became whole and are to be saved.
- worker side: before the forward pass, the planned blocks are read from the pool (located
  and leased through the metadata role, read from their holders over the bulk channel,
  leases released) into the paged KV cache; after it, the blocks that became whole are
  copied out and put on a storage node.

Keys: (model, parallel rank, namespace, content hash). The namespace is the policy version
the request's `cache_salt` names (the service salts each request with the version it serves,
kvpool.keys.served_cache_salt), so a new policy never reads KV of an old one and a
version's blocks leave the pool with one `RemoveNamespace`. The content hash chains over
the block's token ids from a seed of the KV layout (device type, attention shapes and
dtype, block size), the whole salt (the caller's part too) and the LoRA adapter, so a hash
names one prefix computed by one kind of engine.

The worker side is told the version its weights hold (`set_policy_version`, at start and by
every weight update while scheduling is paused) and moves no block of an older version's
namespace: a request that runs across an update computes its later blocks with the newer
weights, and those must not be pooled (nor read) under its older salt.

Whole blocks only; a block holds the block's slice of every layer, in the cache's own
layout, one layer after the other.

Router replay: where the engine captures routed experts (`RoutedExpertsCapture` binds itself
here), a saved block's header carries the experts its tokens were routed to, and a loaded
block's routing goes back into the capture for the slots it fills, so a request whose prefix
came from the pool still returns routing for every token. A block stored without routing
(saved by an engine without capture) loads as KV only; the capture then reports the
request's routing as unavailable rather than guess it (the decode half of a prefill/decode
hand-off returns its completion's routing only, and the router takes the prompt's from the
prefill half). The pool stores a block once: one first stored without routing keeps none.

Loads and saves are synchronous (a miss at load time, e.g. a block evicted since the
lookup, is reported to vLLM, which recomputes those tokens).
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import logging
import threading
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.kvpool.keys import BlockKey, namespace_of_salt, policy_version_of_namespace
from primerl_common.tensors import tensor_from_proto, tensor_to_proto

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from primerl_inference.config import KvCachePoolConfig
    from primerl_inference.routed_experts.capture import RoutedExpertsCapture

__all__ = ["PrimerlKVConnector", "kv_transfer_config"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_KV_ROLES = {"both": "kv_both", "save": "kv_producer", "load": "kv_consumer"}


def kv_transfer_config(pool: KvCachePoolConfig, *, model: str) -> KVTransferConfig | None:
    """The engine's kv_transfer_config for a `[kv_cache_pool]` section; None when it is off."""
    if not pool.enabled:
        return None
    return KVTransferConfig(
        kv_connector=PrimerlKVConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role=_KV_ROLES[pool.mode],
        # A block that left the pool between lookup and load is recomputed, not an error.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "metadata_address": pool.metadata_address,
            "storage_address": pool.storage_address or "",
            "model": pool.model or model,
            "lease_ms": pool.lease_ms,
            "timeout_s": pool.timeout_s,
        },
    )


class _PoolLink:
    """A KvStoreClient on an event loop of its own thread, for vLLM's synchronous calls."""

    def __init__(self, metadata_address: str, storage_address: str, timeout_s: float) -> None:
        self.client = KvStoreClient(metadata_address)
        self._storage_address = storage_address
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="primerl-kvpool", daemon=True)
        self._thread.start()
        self._target: kvstore_pb2.NodeInfo | None = None

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(self._timeout_s)

    def close(self) -> None:
        if self._loop.is_running():
            self.run(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self._timeout_s)

    async def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        reply = await self.client.stub().BatchExists(
            kvstore_pb2.BatchExistsRequest(keys=[key.to_proto() for key in keys]), timeout=self._timeout_s
        )
        return list(reply.exists)

    async def put(self, blocks: Sequence[tuple[kvstore_pb2.BlockHeader, memoryview]]) -> kvstore_pb2.PutBlocksResponse:
        """Puts on the configured storage node, else on the pool's node with the most free DRAM."""
        if self._target is None:
            stats = await self.client.stub().GetStats(kvstore_pb2.GetStatsRequest(), timeout=self._timeout_s)
            nodes = [n for n in stats.nodes if not self._storage_address or n.address == self._storage_address]
            if not nodes:
                wanted = f"node {self._storage_address}" if self._storage_address else "storage node"
                raise RuntimeError(f"the kvstore pool at {self.client.metadata_address} has no live {wanted}")
            self._target = max(nodes, key=lambda n: n.dram_capacity_bytes - n.dram_used_bytes)
        target = self._target
        try:
            if target.bulk_address:
                return await self.client.put_bulk(target.bulk_address, blocks)
            return await self.client.put(target.address, blocks, timeout_s=self._timeout_s)
        except BaseException:
            self._target = None  # ask the pool again next time
            raise


def _layout_fingerprint(kv_cache_config: KVCacheConfig) -> bytes:
    """What must match for a block's bytes to mean the same KV in another engine."""
    (group,) = kv_cache_config.kv_cache_groups
    spec = group.kv_cache_spec
    shape = [getattr(spec, name, None) for name in ("block_size", "num_kv_heads", "head_size", "dtype")]
    facts = (current_platform.device_type, type(spec).__name__, spec.page_size_bytes, shape, group.layer_names)
    return repr(facts).encode()


@dataclass
class _Transfer:
    """Blocks of one request to load or save: pool content hashes, the engine's block ids,
    and the blocks' tokens from block `first_block` of the request on (for their routing)."""

    request_id: str
    namespace: str
    content_hashes: list[bytes]
    block_ids: list[int]
    first_block: int
    token_ids: list[int]

    def blocks(self, block_size: int) -> Iterator[tuple[bytes, int, int, list[int]]]:
        """(content hash, block id, first position, token ids) of each block."""
        for index, (content_hash, block_id) in enumerate(zip(self.content_hashes, self.block_ids, strict=True)):
            tokens = self.token_ids[index * block_size : (index + 1) * block_size]
            yield content_hash, block_id, (self.first_block + index) * block_size, tokens


@dataclass
class PrimerlKVMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    request: Request
    seed: bytes
    content_hashes: list[bytes] = field(default_factory=list)
    lookup_start_block: int = 0  # first block past the local hit, at the last lookup
    num_saved_blocks: int = 0  # blocks that are in the pool or planned to be
    pending_load: _Transfer | None = None

    def hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """The content hashes of the request's first `num_blocks` blocks (extended as needed)."""
        tokens = self.request.all_token_ids
        while len(self.content_hashes) < num_blocks:
            index = len(self.content_hashes)
            previous = self.content_hashes[-1] if self.content_hashes else self.seed
            block = array.array("q", tokens[index * block_size : (index + 1) * block_size])
            self.content_hashes.append(hashlib.sha256(previous + block.tobytes()).digest())
        return self.content_hashes[:num_blocks]

    def transfer(self, start: int, end: int, block_ids: Sequence[int], block_size: int) -> _Transfer:
        """Blocks `start..end` of the request, held in `block_ids`."""
        request = self.request
        hashes = self.hashes(end, block_size)[start:]
        tokens = list(request.all_token_ids[start * block_size : end * block_size])
        namespace = namespace_of_salt(request.cache_salt or "")
        return _Transfer(request.request_id, namespace, hashes, list(block_ids), start, tokens)


class PrimerlKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra = transfer.kv_connector_extra_config
        if not extra.get("metadata_address"):
            raise ValueError("PrimerlKVConnector needs kv_connector_extra_config.metadata_address")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                f"PrimerlKVConnector supports models with one KV cache group (full attention); this one has "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        self._model = str(extra["model"])
        self._lease_ms = int(extra.get("lease_ms", 30_000))
        self._load = transfer.is_kv_consumer
        self._save = transfer.is_kv_producer
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._layout = _layout_fingerprint(kv_cache_config)
        self._pool = _PoolLink(
            str(extra["metadata_address"]), str(extra.get("storage_address") or ""), float(extra.get("timeout_s", 30.0))
        )
        # Scheduler side.
        self._requests: dict[str, _Tracked] = {}
        # Worker side.
        self._rank = vllm_config.parallel_config.rank
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._routed_experts: RoutedExpertsCapture | None = None
        # The policy version the weights hold; None until told (then every namespace is moved).
        self._policy_version: int | None = None

    # ------------------------------------------------------------------ scheduler side

    def _tracked(self, request: Request) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            lora = request.lora_request.lora_name if request.lora_request is not None else ""
            seed = hashlib.sha256(b"\0".join((self._layout, (request.cache_salt or "").encode(), lora.encode())))
            tracked = self._requests[request.request_id] = _Tracked(request, seed.digest())
        return tracked

    def _key(self, namespace: str, content_hash: bytes, rank: int) -> BlockKey:
        return BlockKey(self._model, rank, namespace, content_hash)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._tracked(request)
        start = num_computed_tokens // self._block_size
        tracked.lookup_start_block = tracked.num_saved_blocks = start
        # At least one token is left to compute: the engine needs its logits.
        num_blocks = (request.num_tokens - 1) // self._block_size
        if not self._load or request.mm_features or num_blocks <= start:
            return 0, False
        namespace = namespace_of_salt(request.cache_salt or "")
        hashes = tracked.hashes(num_blocks, self._block_size)[start:]
        try:
            exists = self._pool.run(self._pool.exists([self._key(namespace, h, 0) for h in hashes]))
        except Exception as exc:  # the pool is an optimisation: without it, compute
            logger.warning("kvstore lookup failed, computing the prefix: %s", exc)
            return 0, False
        num_hits = next((i for i, hit in enumerate(exists) if not hit), len(exists))
        return num_hits * self._block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked(request)
        if num_external_tokens == 0:
            return
        start = tracked.lookup_start_block
        end = start + num_external_tokens // self._block_size
        block_ids = blocks.get_block_ids()[0][start:end]
        tracked.pending_load = tracked.transfer(start, end, block_ids, self._block_size)
        tracked.num_saved_blocks = end  # they come from the pool

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrimerlKVMetadata:
        meta = PrimerlKVMetadata()
        computed_before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        block_state = scheduler_output.kv_connector_block_state
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            if tracked.pending_load is not None:
                meta.loads.append(tracked.pending_load)
                tracked.pending_load = None
            # Speculative tokens may be rejected: their KV is not the request's.
            if not self._save or request_id in scheduler_output.scheduled_spec_decode_tokens:
                continue
            num_whole = (computed_before[request_id] + num_scheduled) // self._block_size
            if num_whole <= tracked.num_saved_blocks or block_state is None:
                continue
            block_ids = block_state.get_block_ids(request_id)
            if block_ids is None:
                continue
            start = tracked.num_saved_blocks
            meta.saves.append(tracked.transfer(start, num_whole, block_ids[0][start:num_whole], self._block_size))
            tracked.num_saved_blocks = num_whole
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def set_policy_version(self, policy_version: int) -> None:
        """The version the weights hold from the next forward pass on (called while paused)."""
        self._policy_version = policy_version

    def _older_version(self, namespace: str) -> bool:
        """True for the namespace of a version older than the weights'."""
        version = policy_version_of_namespace(namespace)
        return self._policy_version is not None and version is not None and version < self._policy_version

    def bind_routed_experts(self, capture: RoutedExpertsCapture) -> None:
        """Saved blocks carry the routing `capture` holds for them; loaded blocks fill it."""
        self._routed_experts = capture

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keeps each distinct layer cache, in layer-name order (the same on every replica)."""
        seen: set[int] = set()
        self._layers = []
        for name in sorted(kv_caches):
            cache = kv_caches[name]
            if cache.data_ptr() in seen:  # layers that share another layer's KV
                continue
            seen.add(cache.data_ptr())
            if cache.shape[0] % self._num_blocks:
                raise ValueError(
                    f"KV cache of {name} has {cache.shape[0]} blocks, not a multiple of {self._num_blocks}"
                )
            self._layers.append(cache)

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        """Block `block_id` of every layer (several kernel blocks when the kernel splits it)."""
        views = []
        for cache in self._layers:
            ratio = cache.shape[0] // self._num_blocks
            views.append(cache[block_id * ratio : (block_id + 1) * ratio])
        return views

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrimerlKVMetadata)
        for load in meta.loads:
            if self._older_version(load.namespace):
                self._load_errors.update(load.block_ids)  # recomputed with the weights it runs on
                continue
            keys = [self._key(load.namespace, h, self._rank) for h in load.content_hashes]
            try:
                fetched = self._pool.run(self._pool.client.get(keys, lease_ms=self._lease_ms, bulk=True))
            except Exception as exc:
                logger.warning("kvstore read failed for %s; recomputing: %s", load.request_id, exc)
                self._load_errors.update(load.block_ids)
                continue
            for (_, block_id, first_position, tokens), block in zip(
                load.blocks(self._block_size), fetched, strict=True
            ):
                if block.data is None or not self._write_block(block_id, block.data):
                    self._load_errors.add(block_id)
                elif self._routed_experts is not None and block.header.HasField("routed_experts"):
                    rows = tensor_from_proto(block.header.routed_experts).numpy()
                    self._routed_experts.fill_block(block_id, first_position, tokens, rows)

    def _write_block(self, block_id: int, data: bytearray) -> bool:
        views = self._block_views(block_id)
        if len(data) != sum(v.numel() * v.element_size() for v in views):
            return False
        source = torch.frombuffer(data, dtype=torch.uint8)
        offset = 0
        for view in views:
            num_bytes = view.numel() * view.element_size()
            piece = source[offset : offset + num_bytes].view(view.dtype).view(view.shape)
            view.copy_(piece, non_blocking=False)
            offset += num_bytes
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # wait_for_save copies whole blocks of every layer once the step is computed

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrimerlKVMetadata)
        blocks: list[tuple[kvstore_pb2.BlockHeader, memoryview]] = []
        for save in meta.saves:
            if self._older_version(save.namespace):
                continue  # computed (at least in part) by newer weights than its namespace's
            for content_hash, block_id, first_position, tokens in save.blocks(self._block_size):
                flat = [v.reshape(-1).view(torch.uint8) for v in self._block_views(block_id)]
                data = torch.cat(flat).cpu()
                header = kvstore_pb2.BlockHeader(key=self._key(save.namespace, content_hash, self._rank).to_proto())
                rows = self._block_routing(block_id, first_position, tokens)
                if rows is not None:
                    header.routed_experts.CopyFrom(tensor_to_proto(torch.from_numpy(rows), "routed_experts"))
                blocks.append((header, memoryview(data.numpy())))
        if not blocks:
            return
        try:
            self._pool.run(self._pool.put(blocks))
        except Exception as exc:  # a block not saved is only a future miss
            logger.warning("kvstore put of %d blocks failed: %s", len(blocks), exc)

    def _block_routing(self, block_id: int, first_position: int, tokens: list[int]) -> np.ndarray | None:
        if self._routed_experts is None:
            return None
        rows = self._routed_experts.block_rows(block_id, first_position, tokens)
        if rows is None:
            logger.warning("block %d has no complete routing captured; saved without it", block_id)
        return rows

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._pool.close()
