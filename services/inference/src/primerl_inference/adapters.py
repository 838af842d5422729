"""LoRA adapters known to the engine, by name.

An adapter is loaded from a PEFT folder: one the replica can read (`AdapterSpec.path`) or
one written here from tensors that came with the request. vLLM selects an adapter per
request with a `LoRARequest`; the registry hands those out and counts the requests that
use each adapter, so that one in use is never unloaded or replaced under them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import pathlib
import shutil
from collections.abc import AsyncIterable, Iterator

import torch
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument, NotFound
from primerl_common.tensors import TensorAssembler

__all__ = ["AdapterRegistry", "AdapterSpec", "receive_adapter_tensors"]


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str = ""  # a PEFT folder; empty when the tensors come with the request
    rank: int = 0
    alpha: float = 0.0
    target_modules: tuple[str, ...] = ()
    policy_version: int = 0  # informational


@dataclasses.dataclass
class _Adapter:
    spec: AdapterSpec
    lora_request: LoRARequest
    owned_folder: pathlib.Path | None  # written here, deleted with the adapter
    num_users: int = 0


class AdapterRegistry:
    def __init__(self, root: pathlib.Path, *, max_rank: int) -> None:
        self._root = root
        self._max_rank = max_rank
        self._adapters: dict[str, _Adapter] = {}
        self._lora_ids = itertools.count(1)  # vLLM adapter ids must be > 0
        self._folder_numbers = itertools.count()

    def specs(self) -> list[AdapterSpec]:
        return [adapter.spec for adapter in self._adapters.values()]

    @contextlib.contextmanager
    def in_use(self, name: str) -> Iterator[LoRARequest]:
        """The LoRARequest of adapter `name`, counted as used until the block exits."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(f"no LoRA adapter named {name!r} is loaded", reason="ADAPTER_NOT_FOUND")
        adapter.num_users += 1
        try:
            yield adapter.lora_request
        finally:
            adapter.num_users -= 1

    def prepare(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> tuple[LoRARequest, pathlib.Path | None]:
        """Checks `spec`, writes the PEFT folder when `tensors` are given, and returns the
        LoRARequest that loads it (replacing an adapter of the same name, in place) with the
        folder written, if any. Nothing is registered until `commit`."""
        if not spec.name:
            raise InvalidArgument("must not be empty", field="spec.name")
        current = self._adapters.get(spec.name)
        if current is not None and current.num_users:
            raise FailedPrecondition(
                f"adapter {spec.name!r} is used by {current.num_users} running requests", subject=spec.name
            )
        if spec.path:
            if tensors:
                raise InvalidArgument("either a path or tensors, not both", field="spec.path")
            if not (pathlib.Path(spec.path) / "adapter_config.json").is_file():
                raise InvalidArgument(f"{spec.path} has no adapter_config.json (not PEFT)", field="spec.path")
            folder, owned = pathlib.Path(spec.path), None
        else:
            folder = owned = self._write_peft_folder(spec, tensors)
        lora_id = current.lora_request.lora_int_id if current else next(self._lora_ids)
        request = LoRARequest(spec.name, lora_id, str(folder), load_inplace=current is not None)
        return request, owned

    def commit(self, spec: AdapterSpec, request: LoRARequest, owned_folder: pathlib.Path | None) -> bool:
        """Registers a loaded adapter; True when it replaced one of the same name."""
        previous = self._adapters.pop(spec.name, None)
        if previous is not None and previous.owned_folder not in (None, owned_folder):
            shutil.rmtree(previous.owned_folder, ignore_errors=True)
        self._adapters[spec.name] = _Adapter(spec, request, owned_folder)
        return previous is not None

    def remove(self, name: str) -> LoRARequest | None:
        """Forgets adapter `name` (None if unknown); refuses one that running requests use."""
        adapter = self._adapters.get(name)
        if adapter is None:
            return None
        if adapter.num_users:
            raise FailedPrecondition(f"adapter {name!r} is used by {adapter.num_users} running requests", subject=name)
        del self._adapters[name]
        if adapter.owned_folder is not None:
            shutil.rmtree(adapter.owned_folder, ignore_errors=True)
        return adapter.lora_request

    def discard(self, owned_folder: pathlib.Path | None) -> None:
        """Deletes a folder `prepare` wrote for an adapter that then failed to load."""
        if owned_folder is not None and all(a.owned_folder != owned_folder for a in self._adapters.values()):
            shutil.rmtree(owned_folder, ignore_errors=True)

    def _write_peft_folder(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> pathlib.Path:
        if not tensors:
            raise InvalidArgument("no path and no tensors: nothing to load", field="spec.path")
        if not 0 < spec.rank <= self._max_rank:
            raise InvalidArgument(f"must be in 1..{self._max_rank} (max_lora_rank), got {spec.rank}", field="spec.rank")
        if spec.alpha <= 0:
            raise InvalidArgument(f"must be > 0, got {spec.alpha}", field="spec.alpha")
        if not spec.target_modules:
            raise InvalidArgument("must name the adapted modules (e.g. q_proj)", field="spec.target_modules")
        folder = self._root / f"{next(self._folder_numbers)}-{spec.name.replace('/', '_')}"
        folder.mkdir(parents=True)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "target_modules": list(spec.target_modules),
            "bias": "none",
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
        return folder


async def receive_adapter_tensors(chunks: AsyncIterable[tensor_pb2.TensorChunk]) -> dict[str, torch.Tensor]:
    """The tensors (PEFT names) that follow an adapter's spec."""
    assembler = TensorAssembler()
    tensors: dict[str, torch.Tensor] = {}
    try:
        async for chunk in chunks:
            if (item := assembler.feed(chunk)) is not None:
                name, tensor = item
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears twice")
                tensors[name] = tensor
        assembler.finish()
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="chunk") from None
    return tensors
