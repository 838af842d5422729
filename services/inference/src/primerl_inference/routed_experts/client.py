"""The service's side of the routed-experts capture: calls into the engine process through
`collective_rpc` (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from primerl_inference.routed_experts import RoutedExpertsUnavailableError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["RoutedExpertsClient"]


class RoutedExpertsClient:
    """The capture of an `AsyncLLM` whose worker extension is (or inherits)
    `primerl_inference.routed_experts.worker.RoutedExpertsWorkerExtension`, reached through
    `collective_rpc`. Same contract as `RoutedExpertsCapture`."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    async def install(self) -> bool:
        """Installs the capture in the worker; False for a model without experts."""
        return await self._call("primerl_install_routed_experts_capture")

    async def pop(self, request_id: str, starts: Sequence[int] = (0,)) -> tuple[int, np.ndarray]:
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
        results = await self._engine.collective_rpc(method, args=args)
        # Every tensor-parallel rank routes the same tokens alike: the first one answers.
        return results[0]
