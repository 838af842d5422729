"""The trainer as the gRPC side sees it (rank 0): which batches it takes, its status, the steps
it finished. Runs on the event loop; the training itself runs in TrainingLoop's thread.

Steps are taken strictly in order. A batch is admitted only for the next step: that is the
trainer's completed steps, plus the one in progress and those queued, plus one. Its header is
checked as it arrives (so a wrong step or a full queue is refused before its micro-batches are
read) and again when the whole batch has been read and validated, just before it is queued:
a batch is either queued whole or not at all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl_common.admission import check_limit
from primerl_common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from primerl_trainer.batch import BatchSpec, MicroBatch, TrainingMode, validate_batch
from primerl_trainer.config import BatchLimitsConfig
from primerl_trainer.loop import QueuedBatch, StepRecord, TrainingLoop
from primerl_trainer.publish import BroadcasterWatch
from primerl_trainer.runtime import TrainingRuntime
from primerl_trainer.sft_data import SFTDataset

__all__ = [
    "BatchHeader",
    "IncomingBatch",
    "QueueInfo",
    "TrainerStatus",
    "TrainingService",
    "check_next_step",
    "follow_steps",
    "log_queued",
    "queued_batch",
    "training_failed",
]

logger = logging.getLogger(__name__)

# Set when a service stops after its training loop failed: the process then exits non-zero (__main__).
training_failed = threading.Event()


@dataclass(frozen=True)
class BatchHeader:
    step: int
    num_micro_batches: int
    num_samples: int = 0
    # 0: not announced.
    num_loss_tokens: int = 0
    min_policy_version: int = 0
    max_policy_version: int = 0


@dataclass(frozen=True)
class QueueInfo:
    """GetBatchSpec's answer beyond the BatchSpec."""

    mode: TrainingMode
    max_queued_batches: int
    next_step: int


@dataclass(frozen=True)
class TrainerStatus:
    mode: TrainingMode
    step: int
    published_policy_version: int
    num_queued_batches: int
    training: bool
    last_step: StepRecord | None
    last_checkpoint_step: int
    last_publish_error: str


class IncomingBatch:
    """A batch being read from a PushBatch stream, admitted by its header."""

    def __init__(
        self,
        header: BatchHeader,
        limits: BatchLimitsConfig | None = None,
        *,
        token_quota: tuple[int, str] | None = None,
    ) -> None:
        """`token_quota`: (most tokens, the config field that sets it) of a tenant's run's batch."""
        self.header = header
        self.limits = limits or BatchLimitsConfig()
        self.token_quota = token_quota
        self.micro_batches: list[MicroBatch] = []
        self.num_tokens = 0
        self.num_bytes = 0

    def account(self, *, num_tokens: int, num_bytes: int) -> None:
        """Counts the next micro-batch's tokens and serialized bytes before it is decoded;
        LimitExceeded once the batch passes batch_limits."""
        self.num_tokens += num_tokens
        self.num_bytes += num_bytes
        check_limit(
            self.num_tokens,
            self.limits.max_tokens,
            field="micro_batch.input_ids",
            config_field="batch_limits.max_tokens",
            what=f"tokens up to micro-batch {self.next_index}",
        )
        check_limit(
            self.num_bytes,
            self.limits.max_bytes,
            field="micro_batch",
            config_field="batch_limits.max_bytes",
            what=f"bytes up to micro-batch {self.next_index}",
        )
        if self.token_quota is not None:
            limit, config_field = self.token_quota
            check_limit(
                self.num_tokens,
                limit,
                field="micro_batch.input_ids",
                config_field=config_field,
                what=f"tokens of the run's step up to micro-batch {self.next_index}",
            )

    def add(self, micro_batch: MicroBatch) -> None:
        if len(self.micro_batches) >= self.header.num_micro_batches:
            raise InvalidArgument(
                f"more micro-batches than the {self.header.num_micro_batches} announced",
                field="begin.num_micro_batches",
            )
        self.micro_batches.append(micro_batch)

    @property
    def next_index(self) -> int:
        return len(self.micro_batches)


class TrainingService:
    def __init__(self, runtime: TrainingRuntime, *, sft_dataset: SFTDataset | None = None) -> None:
        config = runtime.config
        self.runtime = runtime
        self.spec: BatchSpec = runtime.spec
        self.mode: TrainingMode = config.mode
        self.max_queued_batches = config.max_queued_batches
        self.batch_limits = config.batch_limits
        self._self_fed = sft_dataset is not None
        self._loop = TrainingLoop(
            runtime,
            on_step=self._step_finished_threadsafe,
            sft_dataset=sft_dataset,
            on_done=self._exit if config.sft.exit_when_done else None,
        )
        self._history: collections.deque[StepRecord] = collections.deque(maxlen=config.metrics_history)
        # Set (and replaced) whenever a step finishes or the service drains.
        self._wakeup = asyncio.Event()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._next_step = runtime.trainer.step + 1
        self._accepting = True
        self._closed = False
        self._broadcaster_watch: asyncio.Task[None] | None = None

    # Lifecycle (ServiceDefinition hooks).

    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._loop.start()
        publish = self.runtime.config.publish
        if publish.weight_broadcaster is not None:
            adapter = publish.adapter_name if publish.kind == "adapter" else None

            def on_status(status: wb_pb2.GetStatusResponse, published_before: int) -> None:
                if adapter is None:
                    latest = status.latest_policy_version
                else:
                    latest = status.latest_adapter_versions.get(adapter, -1)
                self._loop.broadcaster_holds(latest, published_before=published_before)

            watch = BroadcasterWatch(
                publish.weight_broadcaster,
                interval_s=publish.check_interval_s,
                published=lambda: self._loop.published_version,
                on_status=on_status,
            )
            self._broadcaster_watch = asyncio.create_task(watch.run(), name="weight-broadcaster watch")

    async def drain(self) -> None:
        """No new batches; WatchSteps streams end."""
        self._accepting = False
        self._closed = True
        self._wake_watchers()

    async def stop(self) -> None:
        self._accepting = False
        if self._broadcaster_watch is not None:
            self._broadcaster_watch.cancel()
        await asyncio.to_thread(self._loop.stop)
        if self._loop.failure is not None:
            training_failed.set()

    def _exit(self) -> None:
        """sft.exit_when_done: the SFT dataset is trained (or training failed); the process stops as
        on SIGTERM: drain, stop the loop (which exports, export.hf_dir), exit."""
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
            # Not the service's own process (it handles SIGTERM): an embedding program stops it.
            logger.warning("sft.exit_when_done: nothing handles SIGTERM in this process, not stopping it")
            return
        if self._loop.failure is None:
            logger.info("the SFT dataset is trained: stopping (sft.exit_when_done)")
        os.kill(os.getpid(), signal.SIGTERM)

    # PushBatch.

    def begin_batch(self, header: BatchHeader) -> IncomingBatch:
        """Admit a batch by its header, before its micro-batches are read."""
        check_limit(
            header.num_micro_batches,
            self.batch_limits.max_micro_batches,
            field="begin.num_micro_batches",
            config_field="batch_limits.max_micro_batches",
            what="micro-batches",
        )
        self._check_admission(header)
        if header.num_micro_batches <= 0:
            raise InvalidArgument("a batch needs at least one micro-batch", field="begin.num_micro_batches")
        return IncomingBatch(header, self.batch_limits)

    def commit_batch(self, batch: IncomingBatch) -> tuple[int, int]:
        """Validate the whole batch and queue it; returns (step, queued batches)."""
        queued = queued_batch(batch, self.spec, mode=self.mode)
        # Again: another stream may have queued this step, or the loop may have failed, meanwhile.
        self._check_admission(batch.header)
        num_queued = self._loop.submit(queued)
        self._next_step += 1
        log_queued(queued, num_queued)
        return queued.step, num_queued

    def _check_admission(self, header: BatchHeader) -> None:
        if not self._accepting:
            raise Unavailable("the trainer is shutting down", retry_after_s=1.0)
        if self._loop.failure is not None:
            raise Unavailable(
                f"training stopped on an internal error after step {self._loop.completed_step}; restart the trainer "
                "(see its log)"
            )
        if self._self_fed:
            raise FailedPrecondition(
                "the trainer trains on its SFT dataset (sft.dataset) and takes no pushed batches",
                reason="SELF_FED",
                subject="sft.dataset",
            )
        check_next_step(
            header.step,
            expected=self._next_step,
            completed=self._loop.completed_step,
            num_queued=self._loop.num_queued,
            max_queued=self.max_queued_batches,
        )

    # Queries.

    def queue_info(self) -> QueueInfo:
        return QueueInfo(self.mode, self.max_queued_batches, self._next_step)

    def status(self) -> TrainerStatus:
        loop = self._loop
        return TrainerStatus(
            mode=self.mode,
            step=loop.completed_step,
            published_policy_version=loop.published_version,
            num_queued_batches=loop.num_queued,
            training=loop.training,
            last_step=self._history[-1] if self._history else None,
            last_checkpoint_step=loop.last_checkpoint_step,
            last_publish_error=loop.last_publish_error,
        )

    async def save_checkpoint(self) -> tuple[int, str]:
        if self.runtime.checkpointer is None:
            raise FailedPrecondition("no checkpoint folder is configured (checkpoint.dir)", subject="checkpoint.dir")
        if self._loop.failure is not None:
            raise Unavailable("training stopped on an internal error; restart the trainer (see its log)")
        return await asyncio.wrap_future(self._loop.save_checkpoint())

    async def watch_steps(self, after_step: int) -> AsyncIterator[StepRecord]:
        """The finished steps after `after_step` the history still holds, then each new one,
        until the service drains."""
        async for record in follow_steps(
            self._history, after_step, ended=lambda: self._closed, wakeup=lambda: self._wakeup
        ):
            yield record

    # From the training thread.

    def _step_finished_threadsafe(self, record: StepRecord) -> None:
        assert self._event_loop is not None
        # RuntimeError: the event loop is closed, nobody is watching any more.
        with contextlib.suppress(RuntimeError):
            self._event_loop.call_soon_threadsafe(self._step_finished, record)

    def _step_finished(self, record: StepRecord) -> None:
        self._history.append(record)
        self._wake_watchers()

    def _wake_watchers(self) -> None:
        self._wakeup.set()
        self._wakeup = asyncio.Event()


async def follow_steps(
    history: Iterable[StepRecord],
    after_step: int,
    *,
    ended: Callable[[], bool],
    wakeup: Callable[[], asyncio.Event],
) -> AsyncIterator[StepRecord]:
    """WatchSteps: the records of `history` after `after_step`, then each new one as it comes
    (`wakeup()` is the event set, and replaced, when one comes), until `ended()`."""
    next_step = after_step + 1
    while True:
        records = [record for record in history if record.step >= next_step]
        for record in records:
            yield record
            next_step = record.step + 1
        if records:
            continue
        if ended():
            return
        await wakeup().wait()


def queued_batch(batch: IncomingBatch, spec: BatchSpec, *, mode: TrainingMode) -> QueuedBatch:
    """The whole batch read from a PushBatch stream, validated (InvalidArgument naming the field),
    as the training loop takes it."""
    header = batch.header
    if len(batch.micro_batches) != header.num_micro_batches:
        raise InvalidArgument(
            f"{len(batch.micro_batches)} micro-batches arrived, {header.num_micro_batches} were announced",
            field="begin.num_micro_batches",
        )
    num_loss_tokens = validate_batch(
        batch.micro_batches, spec, mode=mode, num_loss_tokens=header.num_loss_tokens or None
    )
    if header.num_samples:
        num_samples = sum(int((mb.position_ids == 0).sum()) for mb in batch.micro_batches)
        if num_samples != header.num_samples:
            raise InvalidArgument(
                f"announced {header.num_samples} samples, the micro-batches' position_ids start {num_samples}",
                field="begin.num_samples",
            )
    if header.min_policy_version > header.max_policy_version:
        raise InvalidArgument(
            f"min_policy_version {header.min_policy_version} > max_policy_version {header.max_policy_version}",
            field="begin.min_policy_version",
        )
    return QueuedBatch(
        step=header.step,
        micro_batches=batch.micro_batches,
        num_loss_tokens=num_loss_tokens,
        num_samples=header.num_samples,
        policy_versions=_policy_versions(batch.micro_batches, header),
    )


def log_queued(batch: QueuedBatch, num_queued: int, *, run_id: str = "") -> None:
    extra = {"step": batch.step, "num_micro_batches": len(batch.micro_batches), "num_queued": num_queued}
    if run_id:
        extra["run_id"] = run_id
    logger.info("queued the batch of step %d%s", batch.step, f" of run {run_id}" if run_id else "", extra=extra)


def check_next_step(step: int, *, expected: int, completed: int, num_queued: int, max_queued: int) -> None:
    """A batch for `step` is taken only as the next one expected (`expected`: the completed steps,
    plus the one in progress and those queued, plus one), and while the queue has room."""
    if step < expected:
        trained = step <= completed
        raise FailedPrecondition(
            f"the batch of step {step} was pushed before and is "
            f"{'trained' if trained else 'queued'} (trained steps: {completed}, next expected step {expected}); "
            "refused so that no step is trained twice",
            reason="STEP_ALREADY_TRAINED" if trained else "STEP_ALREADY_QUEUED",
            subject="begin.step",
            metadata={"next_step": str(expected)},
        )
    if step > expected:
        raise FailedPrecondition(
            f"expected the batch of step {expected}, got step {step}: steps are trained in order",
            reason="STEP_OUT_OF_ORDER",
            subject="begin.step",
            metadata={"next_step": str(expected)},
        )
    if num_queued >= max_queued:
        raise ResourceExhausted(
            f"{num_queued} batches are queued, the most the trainer holds (max_queued_batches); "
            "nothing was queued, push again later",
            retry_after_s=1.0,
        )


def _policy_versions(micro_batches: list[MicroBatch], header: BatchHeader) -> tuple[int, int] | None:
    """(oldest, newest) policy version of the batch's loss tokens: from the per-token versions the
    micro-batches carry, else as the sender announced them (a header of zeros announces nothing)."""
    if all(mb.policy_versions is not None for mb in micro_batches):
        versions = torch.cat([mb.policy_versions[mb.loss_mask] for mb in micro_batches])  # type: ignore[index]
        if versions.numel():
            return int(versions.min()), int(versions.max())
    if header.max_policy_version:
        return header.min_policy_version, header.max_policy_version
    return None
