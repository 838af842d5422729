"""The training loop: one worker thread on rank 0, `follow` on every other rank.

Rank 0's worker takes the next thing to do, in this order of priority: a checkpoint someone
asked for, the oldest queued batch (or the SFT dataset's next batch), a publish retry that is
due. It broadcasts that command to the other ranks (commands.py) and does its own part; they do
theirs. A batch's step is: train it (Trainer.train_step), checkpoint when the interval says so,
publish the new weights (policy version = step; the gathers are collective, the stream leaves
from rank 0 only). Checkpoint first: a trainer killed between the two resumes from that step
and publishes it again, whereas one killed after a publish but before its checkpoint would
train the step again while the replicas serve the first attempt's weights under the same
version. The gRPC event loop never waits on any of it.

A publish that fails is logged and retried with an exponential backoff while no batch comes;
the next step's publish supersedes it (it carries newer weights), and the step is never undone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from primerl_common.errors import FailedPrecondition
from primerl_trainer import metrics as prometheus
from primerl_trainer.batch import MicroBatch
from primerl_trainer.commands import Command, CommandKind
from primerl_trainer.export import exported_tensors, gather_state_dict, meta_state_dict, published_tensors
from primerl_trainer.hf_export import export_dtype, export_hf_model
from primerl_trainer.models import read_hf_config
from primerl_trainer.peft_export import check_peft_exportable, export_peft_adapter
from primerl_trainer.publish import AdapterInfo, PublishError, WeightPublisher, publish_requests, tensor_headers
from primerl_trainer.runtime import TrainingRuntime
from primerl_trainer.sft_data import SFTDataset

__all__ = ["QueuedBatch", "StepExecutor", "StepRecord", "TrainingLoop", "follow"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class QueuedBatch:
    step: int
    micro_batches: list[MicroBatch]
    num_loss_tokens: int
    num_samples: int = 0
    # (oldest, newest) policy version that sampled a loss token; None: not known.
    policy_versions: tuple[int, int] | None = None


@dataclass(frozen=True)
class StepRecord:
    step: int
    metrics: dict[str, float]
    # Unix time.
    finished_at: float
    policy_version: int


class StepExecutor:
    """One rank's part of each command; rank 0 also streams publishes (`publisher`).

    Every method is collective: all ranks call the same ones in the same order. A TRAIN command
    is `train`, then `maybe_save`, then `publish` when publishing is configured."""

    def __init__(self, runtime: TrainingRuntime, publisher: WeightPublisher | None = None) -> None:
        self.runtime = runtime
        self.trainer = runtime.trainer
        self.publisher = publisher
        self.publishing = runtime.config.publish.weight_broadcaster is not None
        export = runtime.config.export
        self.exporting = export.hf_dir is not None or export.adapter_dir is not None
        if export.adapter_dir is not None:  # refused now rather than when the trainer stops
            model_type = str(read_hf_config(runtime.config.model.path).get("model_type", ""))
            check_peft_exportable(self.trainer.model, model_type=model_type)

    def train(self, command: Command) -> dict[str, float]:
        expected = self.trainer.step + 1
        assert command.step == expected, f"batch for step {command.step}, the trainer is at step {expected}"
        return self.trainer.train_step(command.micro_batches, num_loss_tokens=command.num_loss_tokens)

    def maybe_save(self) -> dict[str, float]:
        checkpointer = self.runtime.checkpointer
        start = time.perf_counter()
        if checkpointer is None or checkpointer.maybe_save(self.trainer) is None:
            return {}
        return {"checkpoint_s": time.perf_counter() - start}

    def publish(self) -> dict[str, float]:
        """Gather and stream the current weights as policy version = step; on rank 0 raises
        PublishError when the stream failed (after the gathers are all done)."""
        runtime = self.runtime
        is_rank0 = runtime.rank == 0
        start = time.perf_counter()
        source = gather_state_dict(self.trainer.model, kind=runtime.publish_kind, is_destination=is_rank0)
        tensors = exported_tensors(
            self.trainer.model,
            source,
            kind=runtime.publish_kind,
            dtype=runtime.publish_dtype,
            lora_scale=runtime.lora_scale,
        )
        if not is_rank0:
            for _ in tensors:
                pass
            return {}
        assert self.publisher is not None
        lora = runtime.config.lora
        adapter = AdapterInfo(runtime.config.publish.adapter_name, lora.rank, lora.alpha)
        # The broadcaster's kernel layout depends on the family.
        model_type = str(read_hf_config(runtime.config.model.path).get("model_type", ""))
        if runtime.config.publish.transport == "collective":
            model = self.trainer.model
            planned = exported_tensors(
                model,
                meta_state_dict(model, kind=runtime.publish_kind),
                kind=runtime.publish_kind,
                dtype=runtime.publish_dtype,
                lora_scale=runtime.lora_scale,
            )
            self.publisher.send_collective(
                tensors,
                headers=tensor_headers(planned),
                policy_version=self.trainer.step,
                kind=runtime.publish_kind,
                chunk_bytes=runtime.config.publish.chunk_bytes,
                model_type=model_type,
            )
            return {"publish_s": time.perf_counter() - start}
        requests = publish_requests(
            published_tensors(tensors, fp8_blocks=runtime.config.publish.fp8_blocks),
            policy_version=self.trainer.step,
            kind=runtime.publish_kind,
            num_tensors=runtime.num_published_tensors,
            num_bytes=runtime.num_published_bytes,
            adapter=adapter if runtime.publish_kind == "adapter" else None,
            chunk_bytes=runtime.config.publish.chunk_bytes,
            model_type=model_type,
        )
        self.publisher.send(requests)
        return {"publish_s": time.perf_counter() - start}

    def save(self) -> str:
        assert self.runtime.checkpointer is not None
        return str(self.runtime.checkpointer.save(self.trainer))

    def export(self) -> None:
        """Write the current weights as a Hugging Face folder (export.hf_dir) and the LoRA adapter
        as a PEFT folder (export.adapter_dir), whichever are set; rank 0 writes."""
        config = self.runtime.config
        dtype = export_dtype(config.export.dtype, read_hf_config(config.model.path))
        is_rank0 = self.runtime.rank == 0
        if config.export.hf_dir is not None:
            export_hf_model(
                self.trainer.model,
                source_dir=config.model.path,
                out_dir=config.export.hf_dir,
                dtype=dtype,
                lora_scale=self.runtime.lora_scale,
                is_destination=is_rank0,
                step=self.trainer.step,
                max_shard_bytes=config.export.max_shard_bytes,
            )
        if config.export.adapter_dir is not None:
            export_peft_adapter(
                self.trainer.model,
                source_dir=config.model.path,
                out_dir=config.export.adapter_dir,
                rank=config.lora.rank,
                alpha=config.lora.alpha,
                dtype=dtype,
                is_destination=is_rank0,
                step=self.trainer.step,
            )


def follow(runtime: TrainingRuntime) -> None:
    """Ranks other than 0: do each command rank 0 sends until it says stop."""
    executor = StepExecutor(runtime)
    while True:
        command = runtime.channel.receive()
        if command.kind == CommandKind.STOP:
            if executor.exporting:
                executor.export()
            return
        if command.kind == CommandKind.TRAIN:
            executor.train(command)
            executor.maybe_save()
            if executor.publishing:
                executor.publish()
        elif command.kind == CommandKind.SAVE:
            executor.save()
        elif command.kind == CommandKind.PUBLISH:
            executor.publish()


class TrainingLoop:
    """Rank 0's worker thread and the queue it drains. Thread-safe: `submit`, `save_checkpoint`
    and the properties are called from the gRPC event loop."""

    def __init__(
        self,
        runtime: TrainingRuntime,
        *,
        on_step: Callable[[StepRecord], None],
        sft_dataset: SFTDataset | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """`on_done` is called (from the worker thread) once there is nothing left to do: the SFT
        dataset is trained and checkpointed, or training failed."""
        config = runtime.config
        self.runtime = runtime
        self._on_step = on_step
        self._sft = sft_dataset
        # sft.stop_at_loss: the last steps' losses (worker thread only) and whether their mean got there.
        self._sft_losses: collections.deque[float] = collections.deque(maxlen=config.sft.stop_loss_window)
        self._sft_loss_reached = False
        self._on_done = on_done
        self._done_reported = False
        address = config.publish.weight_broadcaster
        publisher = None
        if address is not None:
            publisher = WeightPublisher(
                address,
                timeout_s=config.publish.timeout_s,
                max_message_bytes=config.server.max_message_bytes,
                streams=config.publish.streams,
            )
        self._executor = StepExecutor(runtime, publisher)
        self._cond = threading.Condition()
        self._batches: collections.deque[QueuedBatch] = collections.deque()
        self._saves: collections.deque[concurrent.futures.Future[tuple[int, str]]] = collections.deque()
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self.completed_step = runtime.trainer.step
        self.running_step: int | None = None
        self.failure: BaseException | None = None
        self.last_checkpoint_step = -1 if runtime.restored_step is None else runtime.restored_step
        self._final_save_step: int | None = None
        self.published_version = -1
        self.last_publish_error = ""
        # A resumed run republishes its weights: the broadcaster may have lost them, or never had them.
        # An adapter is published at once even at step 0: replicas start with the base model alone,
        # and rollouts that name the adapter wait for it.
        self._publish_due_at: float | None = None
        self._backoff_s = config.publish.initial_backoff_s
        if publisher is not None and (runtime.restored_step or runtime.publish_kind == "adapter"):
            self._publish_due_at = time.monotonic()

    # Called from the event loop.

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainer-loop", daemon=True)
        self._thread.start()

    def submit(self, batch: QueuedBatch) -> int:
        """Queue a validated batch (the caller checked the step and the capacity); returns the
        queue's length."""
        with self._cond:
            self._batches.append(batch)
            self._cond.notify()
            prometheus.queued_batches.set(len(self._batches))
            return len(self._batches)

    def broadcaster_holds(self, latest: int, *, published_before: int) -> None:
        """The broadcaster answered that it holds version `latest` (asked when `published_before`
        was published). Publish at once, instead of waiting for the next step or a retry's
        backoff, when it lacks what was published (it restarted: versions live in its RAM) or a
        failed publish is waiting to be retried (it was away and is back)."""
        with self._cond:
            if self._executor.publisher is None or self.running_step is not None:
                return
            lost = latest < published_before
            retry_waiting = self._publish_due_at is not None and latest < self.completed_step
            if lost or retry_waiting:
                logger.warning(
                    "the weight broadcaster holds policy version %d, the latest is %d: publishing it now",
                    latest,
                    self.completed_step,
                )
                self._publish_due_at = time.monotonic()
                self._cond.notify()

    def save_checkpoint(self) -> concurrent.futures.Future[tuple[int, str]]:
        """A checkpoint of the step reached when the worker gets to it: (step, folder)."""
        future: concurrent.futures.Future[tuple[int, str]] = concurrent.futures.Future()
        with self._cond:
            self._saves.append(future)
            self._cond.notify()
        return future

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish the step in progress (and any asked-for checkpoint), save when configured,
        stop the other ranks and the thread. Queued batches are dropped: a restarted trainer
        asks for them again (GetBatchSpec.next_step). Blocking."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def num_queued(self) -> int:
        return len(self._batches)

    @property
    def training(self) -> bool:
        if self.failure is not None:
            return False
        sft_left = self._sft is not None and not self._sft_done()
        return self.running_step is not None or bool(self._batches) or sft_left

    def _sft_done(self) -> bool:
        """Nothing left of the SFT dataset to train: its last step is trained, or sft.stop_at_loss
        was reached. False without an SFT dataset (RL)."""
        if self._sft is None:
            return False
        return self._sft_loss_reached or self.completed_step >= self._sft.num_steps

    # The worker thread.

    def _run(self) -> None:
        if self.runtime.device.type == "cuda":
            torch.cuda.set_device(self.runtime.device)
        try:
            while True:
                command, batch = self._next_command()
                self.runtime.channel.send(command)
                if command.kind == CommandKind.STOP:
                    if self._executor.exporting:
                        self._executor.export()
                    return
                self._execute(command, batch)
        except BaseException as exc:
            self.failure = exc
            logger.exception("the training loop stopped on an internal error at step %d", self.completed_step + 1)
            with self._cond:
                for future in self._saves:
                    future.set_exception(exc)
                self._saves.clear()
            self._report_done()
        finally:
            if self._executor.publisher is not None:
                self._executor.publisher.close()

    def _next_command(self) -> tuple[Command, QueuedBatch | None]:
        with self._cond:
            while True:
                if self._saves and not self.runtime.trainer.optimizer.state:
                    # Refused here, before the other ranks are told to save.
                    error = FailedPrecondition(
                        f"nothing to checkpoint at step {self.completed_step}: no optimizer step has been taken yet",
                        subject="trainer.step",
                    )
                    for future in self._saves:
                        future.set_exception(error)
                    self._saves.clear()
                if self._saves:
                    return Command(CommandKind.SAVE, step=self.completed_step), None
                if self._final_save_due():
                    self._final_save_step = self.completed_step
                    return Command(CommandKind.SAVE, step=self.completed_step), None
                if self._stop_requested:
                    self._log_dropped()
                    return Command(CommandKind.STOP), None
                batch = self._batches.popleft() if self._batches else self._next_sft_batch()
                if batch is not None:
                    prometheus.queued_batches.set(len(self._batches))
                    self.running_step = batch.step
                    command = Command(CommandKind.TRAIN, batch.step, batch.micro_batches, batch.num_loss_tokens)
                    return command, batch
                if self._sft_done():
                    self._report_done()
                wait_s = None
                if self._publish_due_at is not None:
                    wait_s = self._publish_due_at - time.monotonic()
                    if wait_s <= 0:
                        return Command(CommandKind.PUBLISH, step=self.completed_step), None
                self._cond.wait(wait_s)

    def _report_done(self) -> None:
        if self._on_done is not None and not self._done_reported:
            self._done_reported = True
            self._on_done()

    def _next_sft_batch(self) -> QueuedBatch | None:
        if self._sft is None or self._sft_done():
            return None
        batch = self._sft.batch(self.completed_step)
        return QueuedBatch(self.completed_step + 1, batch.micro_batches, batch.num_loss_tokens, batch.num_samples)

    def _final_save_due(self) -> bool:
        """A checkpoint of the last step, once: on a graceful stop (checkpoint.save_on_stop) and
        when the SFT dataset is done."""
        if (
            self.runtime.checkpointer is None
            or self._final_save_step == self.completed_step
            or self.last_checkpoint_step == self.completed_step
            or not self.runtime.trainer.optimizer.state
        ):
            return False
        return self._sft_done() or (self._stop_requested and self.runtime.config.checkpoint.save_on_stop)

    def _log_dropped(self) -> None:
        if self._batches:
            steps = [batch.step for batch in self._batches]
            logger.warning("stopping with %d queued batches untrained (steps %s)", len(steps), steps)
            self._batches.clear()

    def _execute(self, command: Command, batch: QueuedBatch | None) -> None:
        if command.kind == CommandKind.SAVE:
            self._save()
        elif command.kind == CommandKind.PUBLISH:
            self._publish_or_schedule_retry()
        else:
            assert batch is not None
            self._train(command, batch)

    def _train(self, command: Command, batch: QueuedBatch) -> None:
        # The same calls, in the same order, as `follow` makes on the other ranks.
        executor = self._executor
        try:
            metrics = executor.train(command)
            if self._sft is not None:
                self._note_sft_loss(metrics["loss"])
            self.completed_step = executor.trainer.step
            prometheus.observe_step(self.completed_step, metrics)
            saved = executor.maybe_save()
            if executor.publishing:
                metrics |= self._publish_or_schedule_retry()
        finally:
            self.running_step = None
        if saved:
            self.last_checkpoint_step = executor.trainer.step
        metrics |= saved
        if batch.num_samples:
            metrics["num_samples"] = float(batch.num_samples)
        if batch.policy_versions is not None:
            oldest, newest = batch.policy_versions
            metrics["min_policy_version"] = float(oldest)
            metrics["max_policy_version"] = float(newest)
            # As the orchestrator counts it (staleness.off_policy_steps): step n trains on
            # tokens of versions o >= n - max_off_policy_steps; on-policy is 1.
            metrics["off_policy_steps_max"] = float(batch.step - oldest)
        self._on_step(StepRecord(batch.step, metrics, time.time(), policy_version=batch.step))

    def _note_sft_loss(self, loss: float) -> None:
        target = self.runtime.config.sft.stop_at_loss
        if target is None:
            return
        self._sft_losses.append(loss)
        mean = sum(self._sft_losses) / len(self._sft_losses)
        if len(self._sft_losses) == self._sft_losses.maxlen and mean <= target:
            self._sft_loss_reached = True
            logger.info(
                "SFT loss %.4f (mean of the last %d steps) reached sft.stop_at_loss %g at step %d: SFT is done",
                mean,
                len(self._sft_losses),
                target,
                self.runtime.trainer.step,
            )

    def _publish_or_schedule_retry(self) -> dict[str, float]:
        step = self.runtime.trainer.step
        try:
            metrics = self._executor.publish()
        except PublishError as exc:
            if exc.holds(step):
                # A resumed trainer republishing what the broadcaster kept: nothing is missing.
                logger.info("the weight broadcaster holds policy version %d already", step)
                self.published_version = step
                self.last_publish_error = ""
                self._publish_due_at = None
                return {"published": 1.0}
            self.last_publish_error = str(exc)
            if exc.retryable:
                self._publish_due_at = time.monotonic() + self._backoff_s
                logger.warning(
                    "publish of policy version %d failed; retrying in %.1fs unless a newer one comes first: %s",
                    step,
                    self._backoff_s,
                    exc,
                )
                self._backoff_s = min(2 * self._backoff_s, self.runtime.config.publish.max_backoff_s)
            else:
                self._publish_due_at = None
                logger.error("publish of policy version %d refused, not retried: %s", step, exc)
            prometheus.observe_publish(step, ok=False)
            return {"published": 0.0}
        prometheus.observe_publish(step, ok=True, seconds=metrics["publish_s"])
        self.published_version = step
        self.last_publish_error = ""
        self._publish_due_at = None
        self._backoff_s = self.runtime.config.publish.initial_backoff_s
        logger.info("published policy version %d", step, extra={"policy_version": step})
        return metrics | {"published": 1.0}

    def _save(self) -> None:
        with self._cond:
            futures = list(self._saves)
            self._saves.clear()
        trainer = self.runtime.trainer
        try:
            path = self._executor.save()
        except Exception as exc:
            for future in futures:
                future.set_exception(exc)
            if not futures:
                logger.exception("checkpoint of the last step failed")
            return
        self.last_checkpoint_step = trainer.step
        for future in futures:
            future.set_result((trainer.step, path))
