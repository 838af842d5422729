"""The routed-experts capture inside vLLM's V1 model runner (engine process; see the
package docstring)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from primerl_inference.routed_experts import RoutedExpertsUnavailableError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = ["RoutedExpertsCapture", "routed_experts_dtype"]

logger = logging.getLogger(__name__)

# vLLM's InputProcessor.assign_request_id turns the caller's id X into "X-" + 8 random
# characters; the worker only sees the latter.
_REQUEST_ID_SUFFIX_LEN = 9


def routed_experts_dtype(num_experts: int) -> np.dtype[Any]:
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def _with_last_token_row(rows: np.ndarray, num_tokens: int) -> np.ndarray:
    num_missing = num_tokens - len(rows)
    if num_missing == 0:
        return rows
    if num_missing != 1 or len(rows) == 0:
        raise RoutedExpertsUnavailableError(f"routing of {len(rows)} tokens captured, the request has {num_tokens}")
    return np.concatenate([rows, rows[-1:]])


@dataclass
class _Captured:
    """What the capture holds of a request: a row per forwarded token, and which of them
    hold routing written for that token (by a forward of this engine, or `fill_block`)."""

    label: str
    num_tokens: int
    rows: np.ndarray
    written: np.ndarray

    def rows_from(self, starts: Sequence[int]) -> tuple[int, np.ndarray]:
        """(start, rows of tokens start..) for the first of `starts` from which every token
        has routing."""
        for start in starts:
            if self.written[start:].all():
                return start, _with_last_token_row(self.rows, self.num_tokens)[start:]
        raise RoutedExpertsUnavailableError(
            f"request {self.label!r}: no routing for {int((~self.written).sum())} of its {self.num_tokens} tokens "
            "(KV not computed by this engine)"
        )


@dataclass
class _Request:
    # The model runner's own state of the request (block ids, token ids); kept after the
    # runner drops it so a finished request can still be read.
    state: CachedRequestState
    num_forwarded: int = 0
    # Its routing by position, when the engine has no full-attention KV cache group.
    rows: _RoutingRows | None = None


class _RoutingRows:
    """Routing rows by key (a KV slot, or a position of one request), each with the position
    and token whose routing it holds (-1: none)."""

    def __init__(self, num_rows: int, num_layers: int, top_k: int, dtype: np.dtype[Any]) -> None:
        self.rows = np.zeros((num_rows, num_layers, top_k), dtype)
        self.positions = np.full(num_rows, -1, np.int32)
        self.tokens = np.full(num_rows, -1, np.int32)

    def reserve(self, num_rows: int) -> None:
        """Room for keys below `num_rows` (grown by doubling)."""
        if num_rows <= len(self.rows):
            return
        grown = _RoutingRows(max(num_rows, 2 * len(self.rows)), *self.rows.shape[1:], self.rows.dtype)
        for name in ("rows", "positions", "tokens"):
            getattr(grown, name)[: len(self.rows)] = getattr(self, name)
        self.rows, self.positions, self.tokens = grown.rows, grown.positions, grown.tokens

    def write(self, keys: np.ndarray, positions: np.ndarray, tokens: Sequence[int], rows: np.ndarray) -> None:
        self.rows[keys] = rows
        self.positions[keys] = positions
        self.tokens[keys] = tokens

    def read(self, keys: np.ndarray, positions: np.ndarray, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(rows, which of them hold the routing of `tokens` at `positions`)."""
        written = (self.positions[keys] == positions) & (self.tokens[keys] == tokens)
        return self.rows[keys], written


class RoutedExpertsCapture:
    """Captures routed experts inside a vLLM V1 model runner (see the package docstring).

    Per finished request, call `pop` (routing wanted) or `discard` (not wanted, or aborted)
    once with the caller's request id. For `n > 1`, completion i is keyed `f"{i}_{id}"`.
    Requests are captured from the first forward after `attach` on. Finished
    requests wait for their `pop` up to `max_unclaimed` of them, the oldest dropped first
    (raise it to pop after an `LLM.generate` over more prompts)."""

    def __init__(self, model_runner: GPUModelRunner, *, max_unclaimed: int = 1024) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        model_config = model_runner.model_config
        if model_runner.scheduler_config.async_scheduling:
            # Tokens of an asynchronously scheduled step are not on the host when it runs.
            raise ValueError("routed-experts capture needs async_scheduling=False")
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.top_k = model_config.get_num_experts_per_tok()
        self.dtype = routed_experts_dtype(model_config.get_num_experts())
        self._runner = model_runner
        self._max_unclaimed = max_unclaimed
        kv_cache_config = model_runner.kv_cache_config
        # Routing is kept by the KV slots of a full-attention group (see the package
        # docstring), else per request.
        self._kv_group = _full_attention_group(kv_cache_config.kv_cache_groups)
        self._slot_rows: _RoutingRows | None = None
        self._block_size = 0
        if self._kv_group is not None:
            self._block_size = kv_cache_config.kv_cache_groups[self._kv_group].kv_cache_spec.block_size
            num_slots = kv_cache_config.num_blocks * self._block_size
            self._slot_rows = _RoutingRows(num_slots, self.num_layers, self.top_k, self.dtype)
        else:
            logger.info("no full-attention KV cache group: routed experts are kept per request")
        # Filled layer by layer during a forward, on the model's device; vLLM never runs
        # more than max_num_batched_tokens tokens in one forward.
        self._step_rows = torch.zeros(
            (model_runner.scheduler_config.max_num_batched_tokens, self.num_layers, self.top_k),
            dtype=torch.int32,
            device=model_runner.device,
        )
        self._requests: dict[str, _Request] = {}
        self._finished: OrderedDict[str, _Captured] = OrderedDict()
        # pop/discard may come from another thread than the one stepping the engine.
        self._lock = threading.Lock()

        bind_routed_experts_capturer(model_runner.get_model(), self)
        forward = model_runner._model_forward

        # The runner calls _model_forward once per scheduled step (dummy runs call the model
        # directly), with the step's batch layout already in place.
        def model_forward(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._keep_finished()
            output = forward(*args, **kwargs)
            with self._lock:
                self._store_step()
            return output

        model_runner._model_forward = model_forward

    @classmethod
    def attach(cls, model_runner: GPUModelRunner, *, max_unclaimed: int = 1024) -> RoutedExpertsCapture | None:
        """The capture of this model runner (made on first call); None for a model without
        experts."""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not model_runner.model_config.is_moe:
            return None
        if not isinstance(model_runner, GPUModelRunner):
            raise ValueError(
                f"{type(model_runner).__name__} is not vLLM's V1 model runner: use vLLM's own capture "
                "(enable_return_routed_experts=True)"
            )
        capture = getattr(model_runner, "primerl_routed_experts_capture", None)
        if capture is None:
            capture = cls(model_runner, max_unclaimed=max_unclaimed)
            model_runner.primerl_routed_experts_capture = capture
            _bind_kv_connector(capture)
        return capture

    def pop(self, request_id: str, starts: Sequence[int] = (0,)) -> tuple[int, np.ndarray]:
        """The routing of a finished request, `[num_prompt_tokens + num_completion_tokens,
        num_layers, top_k]` from token `start` on; forgets the request. `start` is the first
        of `starts` from which every token has routing: a request some of whose first tokens
        may lack it (the decode half of a hand-off, whose prompt blocks may come from the pool
        without it) passes more than one.

        Raises KeyError for an unknown (or discarded, or long unclaimed) request and
        RoutedExpertsUnavailableError when no start has routing for every token after it."""
        with self._lock:
            captured = self._finished.pop(request_id, None)
            if captured is None:
                request = self._requests.pop(request_id, None)
                if request is None:
                    raise KeyError(f"no routed experts held for request {request_id!r}")
                captured = self._read(request)
        return captured.rows_from(starts)

    def discard(self, request_id: str) -> None:
        """Forgets a request (aborted, or its routing is not wanted); unknown ids are ignored."""
        with self._lock:
            self._requests.pop(request_id, None)
            self._finished.pop(request_id, None)

    def __len__(self) -> int:
        """Number of requests whose routing is held."""
        with self._lock:
            return len(self._requests) + len(self._finished)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Called by vLLM's router in each MoE layer with the experts of every token."""
        self._step_rows[: len(topk_ids), layer_id] = topk_ids

    def block_rows(self, block_id: int, first_position: int, token_ids: Sequence[int]) -> np.ndarray | None:
        """The routing held in KV block `block_id` for `token_ids` at positions
        `first_position..`, `[block_size, num_layers, top_k]`; None unless every slot of the
        block holds exactly those tokens (a forward of this engine, or `fill_block`, wrote it),
        or when routing is not kept by the slots of the blocks a KV connector names."""
        block = self._connector_block(block_id, first_position)
        if block is None:
            return None
        table, slots, positions = block
        with self._lock:
            rows, written = table.read(slots, positions, token_ids)
            return rows if written.all() else None

    def fill_block(self, block_id: int, first_position: int, token_ids: Sequence[int], rows: np.ndarray) -> None:
        """Puts the routing of a KV block loaded from elsewhere into its slots (before the
        forward that reads the block, as the KV itself)."""
        block = self._connector_block(block_id, first_position)
        if block is None:
            raise ValueError("routed experts are not kept by the slots of the first KV cache group's blocks")
        table, slots, positions = block
        if rows.shape != (len(slots), self.num_layers, self.top_k):
            raise ValueError(f"routing of shape {rows.shape} for a block of {len(slots)} tokens")
        with self._lock:
            # Requests that finished in the last step may still own these slots' routing.
            self._keep_finished()
            table.write(slots, positions, token_ids, rows)

    @property
    def keyed_by_connector_blocks(self) -> bool:
        """Whether routing is kept by the slots of the blocks a KV connector names: those of
        the first KV cache group (vLLM gives an engine whose connector does not support hybrid
        KV cache groups one group, full attention)."""
        return self._kv_group == 0

    def _connector_block(
        self, block_id: int, first_position: int
    ) -> tuple[_RoutingRows, np.ndarray, np.ndarray] | None:
        """(table, slots, positions) of a block a KV connector names; None unless
        `keyed_by_connector_blocks`."""
        if not self.keyed_by_connector_blocks:
            return None
        assert self._slot_rows is not None
        offsets = np.arange(self._block_size)
        return self._slot_rows, block_id * self._block_size + offsets, first_position + offsets

    def _store_step(self) -> None:
        runner = self._runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        query_start = runner.query_start_loc.np[: num_reqs + 1]
        num_tokens = int(query_start[-1])
        rows = self._step_rows[:num_tokens].cpu().numpy()
        tokens = runner.input_ids.cpu[:num_tokens].numpy()
        for index, internal_id in enumerate(batch.req_ids[:num_reqs]):
            state = runner.requests[internal_id]
            request_id = _caller_request_id(internal_id)
            request = self._requests.get(request_id)
            if request is None or request.state is not state:
                request = self._requests[request_id] = _Request(state)
                self._finished.pop(request_id, None)  # an earlier request under the same id
            start, end = int(query_start[index]), int(query_start[index + 1])
            first_position = int(batch.num_computed_tokens_cpu[index])
            positions = np.arange(first_position, first_position + end - start)
            table, keys = self._table(request, positions)
            table.write(keys, positions, tokens[start:end], rows[start:end])
            request.num_forwarded = first_position + end - start

    def _keep_finished(self) -> None:
        """Reads requests the runner has dropped (finished or aborted) before this step's
        forward can reuse their KV slots."""
        runner_states = self._runner.requests
        for request_id, request in list(self._requests.items()):
            if runner_states.get(request.state.req_id) is request.state:
                continue
            del self._requests[request_id]
            self._finished[request_id] = self._read(request)
            while len(self._finished) > self._max_unclaimed:
                dropped, _ = self._finished.popitem(last=False)
                logger.debug("dropped the unclaimed routed experts of request %s", dropped)

    def _read(self, request: _Request) -> _Captured:
        state = request.state
        token_ids = [*(state.prompt_token_ids or ()), *state.output_token_ids]
        # The last token, sampled, was never forwarded (a rejected draft token may have been).
        positions = np.arange(min(request.num_forwarded, len(token_ids) - 1))
        table, keys = self._table(request, positions)
        rows, written = table.read(keys, positions, token_ids[: len(positions)])
        return _Captured(state.req_id, len(token_ids), rows, written)

    def _table(self, request: _Request, positions: np.ndarray) -> tuple[_RoutingRows, np.ndarray]:
        """Where the routing of `request`'s tokens at `positions` is kept, and their keys there."""
        if self._slot_rows is not None:
            blocks = np.asarray(request.state.block_ids[self._kv_group], dtype=np.int64)[positions // self._block_size]
            return self._slot_rows, blocks * self._block_size + positions % self._block_size
        if request.rows is None:
            request.rows = _RoutingRows(0, self.num_layers, self.top_k, self.dtype)
        request.rows.reserve(int(positions.max(initial=-1)) + 1)
        return request.rows, positions


def _full_attention_group(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> int | None:
    """The first KV cache group whose blocks hold every token of a request for as long as the
    request runs and its prefix stays cached (full attention; not sliding-window or other
    groups that free blocks behind a window); None if there is none."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, HiddenStateCacheSpec, RSWASpec

    for index, group in enumerate(kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and not isinstance(spec, RSWASpec | HiddenStateCacheSpec):
            return index
    return None


def _bind_kv_connector(capture: RoutedExpertsCapture) -> None:
    """Hands the capture to the engine's KV connector when it carries routing with its blocks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return
    bind = getattr(get_kv_transfer_group(), "bind_routed_experts", None)
    if bind is None:
        return
    if not capture.keyed_by_connector_blocks:
        logger.warning(
            "routed experts do not travel with KV blocks: the KV cache groups are not one full-attention group"
        )
        return
    bind(capture)


def _caller_request_id(internal_id: str) -> str:
    import vllm.envs

    if vllm.envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:
        return internal_id
    return internal_id[:-_REQUEST_ID_SUFFIX_LEN]
