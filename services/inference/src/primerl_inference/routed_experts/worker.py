"""The worker methods that serve the routed-experts capture to `RoutedExpertsClient`
(engine process; see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from primerl_inference.routed_experts import RoutedExpertsUnavailableError
from primerl_inference.routed_experts.capture import RoutedExpertsCapture

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = ["RoutedExpertsWorkerExtension"]


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
        """(start, data, shape, dtype) of the routing (`RoutedExpertsCapture.pop`); the
        message of a RoutedExpertsUnavailableError; None for an unknown request."""
        try:
            start, rows = self._primerl_routed_experts_capture().pop(request_id, starts)
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
