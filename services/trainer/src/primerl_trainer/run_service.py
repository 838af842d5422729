"""The trainer's runs (runs.max_concurrent_runs > 0): many tenants' LoRA runs on one backbone.

A run is created, paused, resumed and deleted through trainer.v1; it belongs to the identity
that created it, and only that identity (or an operator) may read, steer or feed it. Each run has
its own queue of pushed batches, step count, adapter (RunSet: its own LoRA tensors, optimizer
and schedule), checkpoints (checkpoint.dir/runs/<run id>) and published adapter (named by the
run id, version = the run's step).

One worker thread does everything that touches the model, one thing at a time, in this order:
a control task (create, delete, resume from a checkpoint, a checkpoint asked for), the next step
of the run whose turn it is, a publish retry that is due. Turns go round: after a step its run
goes to the back of the line, so a run with batches queued waits for at most one step of each
other run (none starves, whatever the others push). A run's failure (an error in its step) fails
that run alone: its queue is dropped, the others keep stepping.

On several ranks (torchrun, FSDP2) everything the worker does to the model is collective: it goes
through RunOps (run_ops.py), which tells the other ranks each operation before doing it, and they
(`run_ops.follow_runs`) do the same; only rank 0 serves, decides and streams publishes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl_common import security
from primerl_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from primerl_common.lora import check_adapter_name
from primerl_trainer import metrics as prometheus
from primerl_trainer.batch import BatchSpec, TrainingMode
from primerl_trainer.loop import QueuedBatch, StepRecord
from primerl_trainer.publish import BroadcasterWatch, PublishError, WeightPublisher
from primerl_trainer.run_ops import RunOps
from primerl_trainer.run_settings import RunSettings, RunState, RunView, run_config
from primerl_trainer.runtime import TrainingRuntime
from primerl_trainer.service import (
    BatchHeader,
    IncomingBatch,
    QueueInfo,
    TrainerStatus,
    check_next_step,
    follow_steps,
    log_queued,
    queued_batch,
)

__all__ = ["RunFeed", "RunService"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Run:
    run_id: str
    owner: str
    settings: RunSettings
    created_at: float
    state: RunState = "active"
    # Optimizer steps completed, and the next step a push may bring.
    step: int = 0
    next_step: int = 1
    queue: collections.deque[QueuedBatch] = field(default_factory=collections.deque)
    # Its finished steps WatchSteps can replay (metrics_history of them).
    history: collections.deque[StepRecord] = field(default_factory=collections.deque)
    published_version: int = -1
    last_checkpoint_step: int = -1
    # Why the run failed, or why its last publish did.
    error: str = ""
    publish_due_at: float | None = None
    publish_backoff_s: float = 0.0
    # Set (and replaced) whenever one of its steps finishes or the service drains.
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class RunService:
    """Rank 0's side of a trainer with runs: the runs, their admission and the worker thread."""

    def __init__(self, runtime: TrainingRuntime) -> None:
        config = runtime.config
        self.runtime = runtime
        self.config = config
        self.spec: BatchSpec = runtime.spec
        self._ops = RunOps(runtime)
        # Read here; changed through self._ops alone.
        self.run_set = self._ops.run_set
        self._checkpoints = self._ops.checkpoints
        self._runs: dict[str, _Run] = {}
        # Runs in the order their turns come (the one that stepped last at the back).
        self._turns: collections.deque[str] = collections.deque()
        self._tasks: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = collections.deque()
        self._cond = threading.Condition()
        self._running: str | None = None
        self._stop_requested = False
        self._accepting = True
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._broadcaster_watch: asyncio.Task[None] | None = None
        self._publisher = None
        if config.publish.weight_broadcaster is not None:
            self._publisher = WeightPublisher(
                config.publish.weight_broadcaster,
                timeout_s=config.publish.timeout_s,
                max_message_bytes=config.server.max_message_bytes,
                streams=1,
            )
        self._restore()

    # Lifecycle.

    async def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="trainer-runs", daemon=True)
        self._thread.start()
        publish = self.config.publish
        if publish.weight_broadcaster is not None:
            watch = BroadcasterWatch(
                publish.weight_broadcaster,
                interval_s=publish.check_interval_s,
                published=self._published_versions,
                on_status=self._broadcaster_holds,
            )
            self._broadcaster_watch = asyncio.create_task(watch.run(), name="weight-broadcaster watch")

    async def drain(self) -> None:
        self._accepting = False
        self._closed = True
        for run in list(self._runs.values()):
            _wake(run)

    async def stop(self) -> None:
        self._accepting = False
        if self._broadcaster_watch is not None:
            self._broadcaster_watch.cancel()
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # Runs (trainer.v1 CreateRun, GetRun, ListRuns, PauseRun, ResumeRun, DeleteRun).

    async def create_run(self, run_id: str, settings: RunSettings, caller: security.Caller, owner: str = "") -> RunView:
        check_adapter_name(run_id, field="run_id")
        if owner and owner != caller.name and not _is_operator(caller):
            raise security.PermissionDenied(f"{caller.describe()} may create runs for itself only, not for {owner!r}")
        owner = owner or caller.name
        run_config(settings, self.config, owner)  # refuses the settings, here rather than on every rank
        self._check_open()

        def create() -> RunView:
            with self._cond:
                self._admit_new_run(run_id, owner)
            run = self._new_run(run_id, owner, settings, time.time())
            self._ops.create(run_id, _meta(run))
            with self._cond:
                self._runs[run_id] = run
                self._turns.append(run_id)
                if self._publisher is not None:
                    # Replicas start without the adapter; rollouts that name it wait for version 0.
                    run.publish_due_at = time.monotonic()
            self._states_changed()
            logger.info("created run %s for %s", run_id, owner, extra={"run_id": run_id, "owner": owner})
            return self._view(run)

        return await self._call(create)

    def get_run(self, run_id: str, caller: security.Caller) -> RunView:
        return self._view(self._run(run_id, caller))

    def list_runs(self, caller: security.Caller) -> list[RunView]:
        with self._cond:
            runs = list(self._runs.values())
        return [self._view(run) for run in runs if _is_operator(caller) or run.owner == caller.name]

    def pause_run(self, run_id: str, caller: security.Caller) -> RunView:
        run = self._run(run_id, caller)
        with self._cond:
            if run.state == "failed":
                raise FailedPrecondition(f"run {run_id!r} failed: {run.error}; ResumeRun restores it", subject=run_id)
            run.state = "paused"
            self._states_changed()
        logger.info("paused run %s", run_id, extra={"run_id": run_id})
        return self._view(run)

    async def resume_run(self, run_id: str, caller: security.Caller) -> RunView:
        run = self._run(run_id, caller)

        def resume() -> RunView:
            if self.run_set.failure_of(run_id) is not None:
                # Its update broke off half done: its adapter and moments are not to be trusted.
                step = self._ops.load(run_id) if self._checkpoints else None
                if step is None:
                    raise FailedPrecondition(
                        f"run {run_id!r} failed during an update and has no checkpoint to resume from; "
                        "delete it and create it again",
                        subject=run_id,
                    )
                run.last_checkpoint_step = step
            with self._cond:
                run.step = self.run_set.step_of(run_id)
                if run.state == "failed":
                    run.next_step = run.step + 1
                    run.error = ""
                run.state = "active"
                self._states_changed()
                self._cond.notify()
            logger.info("resumed run %s at step %d", run_id, run.step, extra={"run_id": run_id})
            return self._view(run)

        return await self._call(resume)

    async def delete_run(self, run_id: str, caller: security.Caller) -> None:
        run = self._run(run_id, caller)

        def delete() -> None:
            with self._cond:
                self._runs.pop(run_id, None)
                self._states_changed()
                with contextlib.suppress(ValueError):
                    self._turns.remove(run_id)
            self._ops.delete(run_id)
            prometheus.forget_run(run_id)
            self._deliver(run)
            logger.info("deleted run %s (%d queued batches dropped)", run_id, len(run.queue), extra={"run_id": run_id})
            if self._publisher is not None:
                # No publish of it can be under way: this worker makes them, one thing at a time.
                self._remove_adapter(run_id)

        await self._call(delete)

    def feed(self, run_id: str, caller: security.Caller) -> RunFeed:
        """The run as the batch RPCs (GetBatchSpec, PushBatch, GetStatus, WatchSteps,
        SaveCheckpoint) see it, for its owner or an operator."""
        return RunFeed(self, self._run(run_id, caller))

    def status(self) -> TrainerStatus:
        """The trainer's status over all runs (GetStatus without a run_id)."""
        with self._cond:
            runs = list(self._runs.values())
            queued = sum(len(run.queue) for run in runs)
            training = self._running is not None or any(run.queue and run.state == "active" for run in runs)
        return TrainerStatus(
            mode="rl",
            step=sum(run.step for run in runs),
            published_policy_version=-1,
            num_queued_batches=queued,
            training=training and self.failure is None,
            last_step=None,
            last_checkpoint_step=-1,
            last_publish_error="",
        )

    def _published_versions(self) -> dict[str, int]:
        with self._cond:
            return {run_id: run.published_version for run_id, run in self._runs.items()}

    def _broadcaster_holds(self, status: wb_pb2.GetStatusResponse, published_before: dict[str, int]) -> None:
        """Publish a run's adapter at once, instead of at its next step or retry, when the
        broadcaster lacks what was published (it restarted) or a failed publish is waiting and
        the broadcaster is back."""
        with self._cond:
            for run_id, published in published_before.items():
                run = self._runs.get(run_id)
                latest = status.latest_adapter_versions.get(run_id, -1)
                if run is None or self._running == run_id or latest >= max(published, run.step):
                    continue
                if latest < published or run.publish_due_at is not None:
                    logger.warning(
                        "the weight broadcaster holds version %d of run %s's adapter, the latest is %d: publishing it",
                        latest,
                        run_id,
                        run.step,
                        extra={"run_id": run_id},
                    )
                    run.publish_due_at = time.monotonic()
                    self._cond.notify()

    # Shared by the feeds.

    def _run(self, run_id: str, caller: security.Caller) -> _Run:
        if not run_id:
            raise InvalidArgument("this trainer trains runs: name one (trainer.v1 CreateRun)", field="run_id")
        with self._cond:
            run = self._runs.get(run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r}")
        security.check_owner(caller, run.owner, what=f"run {run_id!r}", reason="NOT_RUN_OWNER")
        return run

    def _check_open(self) -> None:
        if not self._accepting:
            raise Unavailable("the trainer is shutting down", retry_after_s=1.0)
        if self.failure is not None:
            raise Unavailable(f"the trainer's worker stopped on an internal error ({self.failure}); restart it")

    def _admit_new_run(self, run_id: str, owner: str) -> None:
        """Under the lock: room for one more run, of this owner."""
        if run_id in self._runs:
            raise AlreadyExists(f"run {run_id!r} exists already")
        limit = self.config.runs.max_concurrent_runs
        if len(self._runs) >= limit:
            raise ResourceExhausted(
                f"the trainer holds {len(self._runs)} runs, the most it takes (runs.max_concurrent_runs = {limit})"
            )
        quota, where = self.config.runs.quota_of(owner)
        held = sum(run.owner == owner for run in self._runs.values())
        if held >= quota.max_runs:
            raise ResourceExhausted(
                f"{owner} has {held} runs, its quota ({where}.max_runs = {quota.max_runs}); delete one first",
                reason="QUOTA_EXCEEDED",
                metadata={"quota": f"{where}.max_runs"},
            )

    def _view(self, run: _Run) -> RunView:
        with self._cond:
            return RunView(
                run_id=run.run_id,
                owner=run.owner,
                settings=run.settings,
                state=run.state,
                step=run.step,
                next_step=run.next_step,
                num_queued_batches=len(run.queue),
                published_version=run.published_version,
                last_checkpoint_step=run.last_checkpoint_step,
                error=run.error,
                created_at=run.created_at,
            )

    async def _call(self, task: Callable[[], T]) -> T:
        """Run `task` on the worker thread (between steps); its result or error."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            self._check_open()
            self._tasks.append((task, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    # The worker thread.

    def _new_run(self, run_id: str, owner: str, settings: RunSettings, created_at: float) -> _Run:
        return _Run(
            run_id,
            owner,
            settings,
            created_at,
            history=collections.deque(maxlen=self.config.metrics_history),
            publish_backoff_s=self.config.publish.initial_backoff_s,
        )

    def _restore(self) -> None:
        """The runs checkpoint.dir/runs holds, each at its latest checkpoint (before serving)."""
        if self._checkpoints is None or not self.config.checkpoint.resume:
            return
        for run_id, meta in sorted(self._checkpoints.saved_runs().items()):
            run = self._new_run(run_id, meta["owner"], RunSettings(**meta["settings"]), meta["created_at"])
            step = self._ops.restore(run_id, meta)
            if step is not None:
                run.step, run.next_step, run.last_checkpoint_step = step, step + 1, step
            run.publish_due_at = time.monotonic() if self._publisher is not None else None
            self._runs[run_id] = run
            self._turns.append(run_id)
            self._states_changed()
            logger.info("restored run %s at step %d", run_id, run.step, extra={"run_id": run_id})

    def _work(self) -> None:
        if self.runtime.device.type == "cuda":
            torch.cuda.set_device(self.runtime.device)
        try:
            while True:
                job = self._next_job()
                if job is None:
                    self._save_on_stop()
                    self._ops.stop()
                    return
                job()
        except BaseException as exc:
            self.failure = exc
            logger.exception("the trainer's run worker stopped on an internal error")
            with self._cond:
                for _, future in self._tasks:
                    future.set_exception(exc)
                self._tasks.clear()
        finally:
            if self._publisher is not None:
                self._publisher.close()

    def _next_job(self) -> Callable[[], None] | None:
        with self._cond:
            while True:
                if self._tasks:
                    task, future = self._tasks.popleft()
                    return lambda: _settle(future, task)
                if self._stop_requested:
                    return None
                for run_id in self._turns:
                    run = self._runs[run_id]
                    if run.state == "active" and run.queue:
                        self._turns.remove(run_id)
                        self._turns.append(run_id)
                        batch = run.queue.popleft()
                        self._running = run_id
                        return lambda: self._train(run, batch)
                due = [run.publish_due_at for run in self._runs.values() if run.publish_due_at is not None]
                wait_s = None
                if due:
                    wait_s = min(due) - time.monotonic()
                    if wait_s <= 0:
                        run = min(
                            (run for run in self._runs.values() if run.publish_due_at is not None),
                            key=lambda run: run.publish_due_at,  # type: ignore[arg-type,return-value]
                        )
                        return lambda: self._publish(run)
                self._cond.wait(wait_s)

    def _train(self, run: _Run, batch: QueuedBatch) -> None:
        run_id = run.run_id
        try:
            metrics = self._ops.train(run_id, batch)
        except Exception as exc:
            with self._cond:
                dropped = len(run.queue)
                run.queue.clear()
                run.state, run.error = "failed", f"step {batch.step}: {type(exc).__name__}: {exc}"
                self._states_changed()
                run.next_step = run.step + 1
                self._running = None
            logger.exception(
                "run %s failed at step %d (%d queued batches dropped); the other runs go on",
                run_id,
                batch.step,
                dropped,
                extra={"run_id": run_id},
            )
            self._deliver(run)
            return
        run.step = self.run_set.step_of(run_id)
        prometheus.observe_run_step(run_id, run.step, metrics)
        checkpoint = self.config.checkpoint
        if self._checkpoints is not None and checkpoint.interval and run.step % checkpoint.interval == 0:
            start = time.perf_counter()
            self._save(run)
            metrics["checkpoint_s"] = time.perf_counter() - start
        if self._publisher is not None:
            metrics |= self._publish(run)
        if batch.num_samples:
            metrics["num_samples"] = float(batch.num_samples)
        if batch.policy_versions is not None:
            metrics["min_policy_version"], metrics["max_policy_version"] = map(float, batch.policy_versions)
            metrics["off_policy_steps_max"] = float(batch.step - batch.policy_versions[0])
        with self._cond:
            self._running = None
        record = StepRecord(batch.step, metrics, time.time(), policy_version=batch.step)
        logger.info("run %s trained step %d", run_id, batch.step, extra={"run_id": run_id, "step": batch.step})
        self._deliver(run, record)

    def _save(self, run: _Run) -> str:
        assert self._checkpoints is not None
        path = self._ops.save(run.run_id)
        run.last_checkpoint_step = run.step
        return path

    def _save_on_stop(self) -> None:
        if self._checkpoints is None or not self.config.checkpoint.save_on_stop:
            return
        for run in list(self._runs.values()):
            if run.step > 0 and run.last_checkpoint_step != run.step and self.run_set.failure_of(run.run_id) is None:
                self._save(run)

    def _publish(self, run: _Run) -> dict[str, float]:
        """Publish the run's adapter as version = its step; a failure is retried with a backoff
        (the next step's publish supersedes it)."""
        assert self._publisher is not None
        publish = self.config.publish
        step, start = run.step, time.perf_counter()
        try:
            requests = self._ops.publish_requests(run.run_id, owner=run.owner)
            assert requests is not None
            self._publisher.send(requests)
        except PublishError as exc:
            if not exc.holds(step):
                with self._cond:
                    run.error = f"publish of version {step}: {exc}"
                    run.publish_due_at = time.monotonic() + run.publish_backoff_s if exc.retryable else None
                    run.publish_backoff_s = min(2 * run.publish_backoff_s, publish.max_backoff_s)
                logger.warning("run %s: publish of version %d failed: %s", run.run_id, step, exc)
                prometheus.observe_run_publish(run.run_id, step, ok=False)
                return {"published": 0.0}
        with self._cond:
            run.published_version, run.publish_due_at = step, None
            run.publish_backoff_s = publish.initial_backoff_s
            if run.state != "failed":
                run.error = ""
        seconds = time.perf_counter() - start
        prometheus.observe_run_publish(run.run_id, step, ok=True, seconds=seconds)
        return {"published": 1.0, "publish_s": seconds}

    def _remove_adapter(self, run_id: str) -> None:
        """A deleted run's adapter off the broadcaster and every replica. A failure is logged
        naming the adapter (an operator's weight_broadcaster.v1 RemoveAdapter finishes it); the
        run is deleted all the same."""
        assert self._publisher is not None
        try:
            version = self._publisher.remove_adapter(run_id)
        except PublishError as exc:
            logger.error(
                "run %s is deleted, but its adapter is still on the weight broadcaster (RemoveAdapter %r failed: %s)",
                run_id,
                run_id,
                exc,
                extra={"run_id": run_id},
            )
            return
        if version >= 0:
            logger.info("removed run %s's adapter (version %d) from the weight broadcaster", run_id, version)

    def _states_changed(self) -> None:
        with self._cond:
            prometheus.observe_runs([run.state for run in self._runs.values()])

    def _deliver(self, run: _Run, record: StepRecord | None = None) -> None:
        """To the event loop: the step's record (None: the run failed), and wake its watchers."""

        def deliver() -> None:
            if record is not None:
                run.history.append(record)
            _wake(run)

        if self._event_loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                self._event_loop.call_soon_threadsafe(deliver)


class RunFeed:
    """One run as the batch RPCs see it: what TrainingService is for the trainer of one run."""

    def __init__(self, service: RunService, run: _Run) -> None:
        self._service = service
        self._run = run
        self.spec = dataclasses.replace(service.spec, lora_adapter=run.run_id)
        self.mode: TrainingMode = run.settings.mode

    def begin_batch(self, header: BatchHeader) -> IncomingBatch:
        service = self._service
        service._check_open()
        self._check_admission(header)
        if header.num_micro_batches <= 0:
            raise InvalidArgument("a batch needs at least one micro-batch", field="begin.num_micro_batches")
        quota, where = service.config.runs.quota_of(self._run.owner)
        return IncomingBatch(
            header, service.config.batch_limits, token_quota=(quota.max_tokens_per_step, f"{where}.max_tokens_per_step")
        )

    def commit_batch(self, batch: IncomingBatch) -> tuple[int, int]:
        queued = queued_batch(batch, self.spec, mode=self.mode)
        service, run = self._service, self._run
        with service._cond:
            self._check_admission(batch.header)
            if service._runs.get(run.run_id) is not run:
                raise NotFound(f"run {run.run_id!r} was deleted")
            run.queue.append(queued)
            run.next_step += 1
            num_queued = len(run.queue)
            service._cond.notify()
        log_queued(queued, num_queued, run_id=run.run_id)
        return queued.step, num_queued

    def _check_admission(self, header: BatchHeader) -> None:
        run = self._run
        if run.state == "failed":
            raise FailedPrecondition(
                f"run {run.run_id!r} failed: {run.error}; ResumeRun restores it",
                reason="RUN_FAILED",
                subject=run.run_id,
            )
        check_next_step(
            header.step,
            expected=run.next_step,
            completed=run.step,
            num_queued=len(run.queue),
            max_queued=self._service.config.max_queued_batches,
        )

    def queue_info(self) -> QueueInfo:
        return QueueInfo(self.mode, self._service.config.max_queued_batches, self._run.next_step)

    def status(self) -> TrainerStatus:
        view = self._service._view(self._run)
        return TrainerStatus(
            mode=self.mode,
            step=view.step,
            published_policy_version=view.published_version,
            num_queued_batches=view.num_queued_batches,
            training=view.state == "active" and (view.num_queued_batches > 0 or self._service._running == view.run_id),
            last_step=self._run.history[-1] if self._run.history else None,
            last_checkpoint_step=view.last_checkpoint_step,
            last_publish_error=view.error,
        )

    async def save_checkpoint(self) -> tuple[int, str]:
        service, run = self._service, self._run
        if service._checkpoints is None:
            raise FailedPrecondition("no checkpoint folder is configured (checkpoint.dir)", subject="checkpoint.dir")

        def save() -> tuple[int, str]:
            if run.step == 0:
                raise FailedPrecondition(f"run {run.run_id!r} has taken no step yet: nothing to checkpoint")
            if service.run_set.failure_of(run.run_id) is not None:
                raise FailedPrecondition(f"run {run.run_id!r} failed during an update: {run.error}")
            return run.step, service._save(run)

        return await service._call(save)

    async def watch_steps(self, after_step: int) -> AsyncIterator[StepRecord]:
        """The run's finished steps after `after_step` still remembered, then each new one, until
        the service drains or the run is deleted or fails."""
        run, service = self._run, self._service

        def ended() -> bool:
            return service._closed or run.state == "failed" or service._runs.get(run.run_id) is not run

        async for record in follow_steps(run.history, after_step, ended=ended, wakeup=lambda: run.wakeup):
            yield record


def _wake(run: _Run) -> None:
    run.wakeup.set()
    run.wakeup = asyncio.Event()


def _settle(future: concurrent.futures.Future[Any], task: Callable[[], Any]) -> None:
    """Run a control task; its result or its (service) error goes to whoever waits on it."""
    try:
        future.set_result(task())
    except Exception as exc:
        future.set_exception(exc)


def _is_operator(caller: security.Caller) -> bool:
    return "*" in caller.roles or security.OPERATOR in caller.roles


def _meta(run: _Run) -> dict[str, Any]:
    return {"owner": run.owner, "created_at": run.created_at, "settings": dataclasses.asdict(run.settings)}
