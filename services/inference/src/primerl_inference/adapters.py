"""LoRA adapters known to the engine, by name, and their loading, replacing and unloading.

An adapter is loaded from a PEFT folder: one the replica can read (`AdapterSpec.path`) or
one written here from tensors that came with the request. vLLM selects an adapter per
request with a `LoRARequest`; the registry hands those out and counts the requests that
use each adapter, so that one in use is never unloaded.

Replacing an adapter (a newer policy version of it, from a run that trains it) lands in place
while requests use it, the way weight_updates.py swaps full weights: scheduling pauses with
running requests kept, vLLM loads the new tensors under the same adapter id
(`LoRARequest.load_inplace`), the engine's version stamp names the new version
(engine_versions.py), scheduling resumes. Running requests go on with the new adapter from
the next step, their later tokens tagged with its version. A load vLLM refuses leaves the old
adapter, and its version, serving.

Requests carry a LoRARequest whose path is a link this registry keeps to the current
version's folder: vLLM reloads an adapter from the path a running request carries when it
dropped it from its cache (more adapters loaded than `max_loras`), and must then load the
version the stamp names, not the one the request started with.

An adapter may have an owner (a tenant's run): requests naming it are served only to that
identity or an operator (`check_user`), and a replacement must keep it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pathlib
import shutil
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator

import torch
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from primerl.common.v1 import tensor_pb2
from primerl_common import security
from primerl_common.errors import FailedPrecondition, InvalidArgument, NotFound
from primerl_common.lora import check_adapter_name
from primerl_common.tensors import TensorAssembler
from primerl_inference.engine_versions import engine_version_stamp
from primerl_inference.liveness import EngineLiveness
from primerl_inference.version_salts import ServedAt, VersionSalts

__all__ = ["AdapterRegistry", "AdapterSpec", "LoadedAdapter", "receive_adapter_tensors"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str = ""  # a PEFT folder; empty when the tensors come with the request
    rank: int = 0
    alpha: float = 0.0
    target_modules: tuple[str, ...] = ()
    # Tokens sampled with the adapter are tagged with it; a replacement needs a greater one
    # (0 and 0: unversioned adapters, replaced at will).
    policy_version: int = 0
    owner: str = ""  # the identity requests with it are served to (and operators); "": any caller


@dataclasses.dataclass
class LoadedAdapter:
    spec: AdapterSpec
    lora_request: LoRARequest  # what requests run with; its path is the link to `folder`
    load: int  # numbers every load of every adapter, replacements included (version_salts.py)
    folder: pathlib.Path
    owned: bool  # `folder` was written here, deleted with the adapter
    num_users: int = 0

    def served_at(self, base_version: int) -> ServedAt:
        return ServedAt(base_version, self.spec.name, self.spec.policy_version, self.load)


class AdapterRegistry:
    """The adapters of one engine. Loads and unloads hold `control_lock`, the engine's lock over
    what changes its state; `base_version()` is the base weights' policy version (for the
    engine's version stamp), `may_resume()` whether scheduling resumes after a replacement
    (not while the engine's caller paused it, nor while the weights are incomplete)."""

    def __init__(
        self,
        llm: AsyncLLM,
        root: pathlib.Path,
        *,
        max_rank: int,
        control_lock: asyncio.Lock,
        liveness: EngineLiveness,
        salts: VersionSalts,
        base_version: Callable[[], int],
        may_resume: Callable[[], bool],
    ) -> None:
        self._llm = llm
        self._root = root
        self._links = root / "current"
        self._links.mkdir(parents=True, exist_ok=True)
        self._max_rank = max_rank
        self._control_lock = control_lock
        self._liveness = liveness
        self._salts = salts
        self._base_version = base_version
        self._may_resume = may_resume
        self._adapters: dict[str, LoadedAdapter] = {}
        self._lora_ids = itertools.count(1)  # vLLM adapter ids must be > 0
        self._loads = itertools.count(1)
        self._folder_numbers = itertools.count()

    def specs(self) -> list[AdapterSpec]:
        return [adapter.spec for adapter in self._adapters.values()]

    def versions(self) -> dict[str, int]:
        """The policy version of each loaded adapter, by name."""
        return {name: adapter.spec.policy_version for name, adapter in self._adapters.items()}

    def owners(self) -> dict[str, str]:
        """The owner of each loaded adapter that has one, by name."""
        return {name: adapter.spec.owner for name, adapter in self._adapters.items() if adapter.spec.owner}

    def policy_version(self, name: str) -> int:
        return self._get(name).spec.policy_version

    def check_user(self, name: str, caller: security.Caller) -> None:
        """Refuses `caller` a request with adapter `name` (PERMISSION_DENIED) unless it is the
        adapter's owner or an operator, or the adapter has no owner; NOT_FOUND if not loaded.
        A router is trusted: it calls under its own identity for its callers, and refuses them
        an adapter that is not theirs itself (primerl_router.pool, from the replicas' load
        reports), before it forwards anything."""
        owner = self._get(name).spec.owner
        if security.ROUTER in caller.roles:
            return
        try:
            security.check_owner(caller, owner, what=f"adapter {name!r}", reason="NOT_ADAPTER_OWNER")
        except security.PermissionDenied:
            logger.warning(
                "refused adapter %r to %s: owned by %r",
                name,
                caller.describe(),
                owner,
                extra={"caller": caller.name, "refusal": "NOT_ADAPTER_OWNER"},
            )
            raise

    @contextlib.contextmanager
    def in_use(self, name: str, caller: security.Caller) -> Iterator[LoadedAdapter]:
        """Adapter `name`, for `caller` (`check_user`), counted as used until the block exits
        (a replacement keeps the count: the requests go on with the new version)."""
        self.check_user(name, caller)
        adapter = self._get(name)
        adapter.num_users += 1
        try:
            yield adapter
        finally:
            adapter.num_users -= 1

    def check(self, spec: AdapterSpec) -> None:
        """Refuses `spec` before its tensors are received: a bad name, another owner than the
        loaded one's, or a version not newer than the loaded one's."""
        check_adapter_name(spec.name, field="spec.name")
        if spec.policy_version < 0:
            raise InvalidArgument(f"must be >= 0, got {spec.policy_version}", field="spec.policy_version")
        current = self._adapters.get(spec.name)
        if current is None:
            return
        if spec.owner != current.spec.owner:
            raise FailedPrecondition(
                f"adapter {spec.name!r} is owned by {_shown(current.spec.owner)}; "
                f"a replacement owned by {_shown(spec.owner)} would change its owner",
                subject="spec.owner",
                reason="ADAPTER_OWNER_MISMATCH",
                metadata={"owner": current.spec.owner, "requested_owner": spec.owner},
            )
        old, new = current.spec.policy_version, spec.policy_version
        if not (new > old or new == old == 0):
            raise FailedPrecondition(
                f"adapter {spec.name!r} policy version {new} is not newer than the loaded {old}",
                subject="spec.policy_version",
                reason="ADAPTER_VERSION_NOT_NEWER",
            )

    async def load(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> bool:
        """Loads adapter `spec.name` from spec.path or `tensors` (PEFT names), in place of a
        loaded one of the same name while requests use it; True when it replaced one."""
        async with self._control_lock:
            self.check(spec)  # again: another load may have come first
            current = self._adapters.get(spec.name)
            folder, owned = self._folder_of(spec, tensors)
            lora_id = current.lora_request.lora_int_id if current is not None else next(self._lora_ids)
            load = next(self._loads)
            registered = False
            try:
                async with self._scheduling_paused():
                    try:
                        await self._llm.add_lora(
                            LoRARequest(spec.name, lora_id, str(folder), load_inplace=current is not None)
                        )
                    except Exception as exc:
                        self._liveness.check()
                        # vLLM reports a malformed adapter (unknown module, rank above the limit,
                        # mismatched shapes) as an error of the call, having kept the one it had.
                        raise InvalidArgument(f"vLLM could not load the adapter: {exc}", field="spec") from None
                    await self._stamp({**self.versions(), spec.name: spec.policy_version})
                    self._register(spec, lora_id, load, folder, owned)
                    registered = True
                    # Those admitted before that have no token yet start again under the new load.
                    await self._salts.restart_unstarted_with_adapter(spec.name, load)
            except BaseException:
                if owned and not registered:
                    shutil.rmtree(folder, ignore_errors=True)
                raise
            done = "replaced in place" if current is not None else "loaded"
            logger.info("LoRA adapter %r at policy version %d %s", spec.name, spec.policy_version, done)
            return current is not None

    @contextlib.asynccontextmanager
    async def _scheduling_paused(self) -> AsyncIterator[None]:
        """Running requests stay and go on, from the next step, with what changed meanwhile."""
        with self._liveness.translated():
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                yield
            finally:
                if self._may_resume():
                    await self._llm.resume_generation()

    def _register(self, spec: AdapterSpec, lora_id: int, load: int, folder: pathlib.Path, owned: bool) -> None:
        """Makes what vLLM loaded from `folder` adapter `spec.name`: new, or in place of the one
        loaded (its users and its LoRARequest kept, the link pointed at the new folder)."""
        link = self._links / str(lora_id)
        _point(link, folder)
        current = self._adapters.get(spec.name)
        if current is None:
            lora_request = LoRARequest(spec.name, lora_id, str(link))
            self._adapters[spec.name] = LoadedAdapter(spec, lora_request, load, folder, owned)
            return
        if current.owned:
            shutil.rmtree(current.folder, ignore_errors=True)
        current.spec, current.load, current.folder, current.owned = spec, load, folder, owned

    async def unload(self, name: str) -> bool:
        """Forgets adapter `name` (False if unknown); refuses one that running requests use."""
        async with self._control_lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                return False
            if adapter.num_users:
                raise FailedPrecondition(
                    f"adapter {name!r} is used by {adapter.num_users} running requests", subject=name
                )
            with self._liveness.translated():
                await self._llm.remove_lora(adapter.lora_request.lora_int_id)
                del self._adapters[name]
                await self._stamp(self.versions())
            self._delete_files(adapter)
            return True

    @staticmethod
    def _delete_files(adapter: LoadedAdapter) -> None:
        pathlib.Path(adapter.lora_request.lora_path).unlink(missing_ok=True)
        if adapter.owned:
            shutil.rmtree(adapter.folder, ignore_errors=True)

    async def _stamp(self, versions: dict[str, int]) -> None:
        await self._llm.update_weight_version(engine_version_stamp(self._base_version(), versions))

    def _get(self, name: str) -> LoadedAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(f"no LoRA adapter named {name!r} is loaded", reason="ADAPTER_NOT_FOUND")
        return adapter

    def _folder_of(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> tuple[pathlib.Path, bool]:
        """The PEFT folder to load `spec` from, and whether it was written here."""
        if not spec.path:
            return self._write_peft_folder(spec, tensors), True
        if tensors:
            raise InvalidArgument("either a path or tensors, not both", field="spec.path")
        folder = pathlib.Path(spec.path).absolute()
        if not (folder / "adapter_config.json").is_file():
            raise InvalidArgument(f"{spec.path} has no adapter_config.json (not PEFT)", field="spec.path")
        return folder, False

    def _write_peft_folder(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> pathlib.Path:
        if not tensors:
            raise InvalidArgument("no path and no tensors: nothing to load", field="spec.path")
        if not 0 < spec.rank <= self._max_rank:
            raise InvalidArgument(f"must be in 1..{self._max_rank} (max_lora_rank), got {spec.rank}", field="spec.rank")
        if spec.alpha <= 0:
            raise InvalidArgument(f"must be > 0, got {spec.alpha}", field="spec.alpha")
        if not spec.target_modules:
            raise InvalidArgument("must name the adapted modules (e.g. q_proj)", field="spec.target_modules")
        folder = self._root / f"{next(self._folder_numbers)}"
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


def _shown(owner: str) -> str:
    return repr(owner) if owner else "no one"


def _point(link: pathlib.Path, folder: pathlib.Path) -> None:
    """Makes `link` a symbolic link to `folder`, in one step for a reader (a rename)."""
    staged = link.with_name(f"{link.name}.new")
    staged.unlink(missing_ok=True)
    staged.symlink_to(folder, target_is_directory=True)
    os.replace(staged, link)


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
