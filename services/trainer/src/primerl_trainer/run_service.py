"""The trainer's runs (runs.max_concurrent_runs > 0): many tenants' LoRA runs on one backbone.

A run is created, paused, resumed and deleted through trainer.v1; it belongs to the identity
that created it, and only that identity (or an operator) may read, steer or feed it. Each run has
its own queue of pushed batches, step count, adapter (RunSet: its own LoRA tensors, optimizer
and schedule), checkpoints (checkpoint.dir/runs/<run id>) and published adapter (named by the
run id, version = the run's step).

This module admits: who may do what to which run, quotas, the views the RPCs answer with, and the
batch RPCs' side of a run (RunFeed). One worker thread (run_worker.py) does everything that
touches the model, one thing at a time; the control tasks (create, resume, delete, a checkpoint
asked for) are handed to it, checked here first.

A deleted run's adapter is removed from the weight broadcaster; until the broadcaster confirms,
the removal is pending (retried by the worker, kept across restarts under checkpoint.dir: see
run_worker.py), named in the trainer's GetStatus (`last_publish_error`) and logged. A run being
removed is no longer a run (ListRuns leaves it out); CreateRun of its id first removes the old
adapter (so that no copy of it is taken for the new run's), and is refused UNAVAILABLE naming the
pending removal while that fails.

On several ranks (torchrun, FSDP2) everything the worker does to the model is collective: it goes
through RunOps (run_ops.py), which tells the other ranks each operation before doing it, and they
(`run_ops.follow_runs`) do the same; only rank 0 serves, decides and streams publishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

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
from primerl_trainer.batch import BatchSpec, TrainingMode
from primerl_trainer.loop import StepRecord
from primerl_trainer.publish import BroadcasterWatch
from primerl_trainer.run_settings import RunSettings, RunView, run_config
from primerl_trainer.run_worker import Removal, Run, RunWorker, wake
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


class RunService:
    """Rank 0's side of a trainer with runs: the runs' admission, over the worker (run_worker.py)."""

    def __init__(self, runtime: TrainingRuntime) -> None:
        config = runtime.config
        self.runtime = runtime
        self.config = config
        self.spec: BatchSpec = runtime.spec
        self._worker = RunWorker(runtime)
        # The worker's, read here (under its lock); changed on the worker thread alone.
        self.run_set = self._worker.run_set
        self._checkpoints = self._worker.checkpoints
        self._runs = self._worker.runs
        self._cond = self._worker.cond
        self._accepting = True
        self._closed = False
        self._broadcaster_watch: asyncio.Task[None] | None = None

    @property
    def failure(self) -> BaseException | None:
        """The internal error the worker stopped on, if it did."""
        return self._worker.failure

    # Lifecycle.

    async def start(self) -> None:
        self._worker.start()
        publish = self.config.publish
        if publish.weight_broadcaster is not None:
            watch = BroadcasterWatch(
                publish.weight_broadcaster,
                interval_s=publish.check_interval_s,
                published=self._worker.published_versions,
                on_status=self._worker.broadcaster_holds,
            )
            self._broadcaster_watch = asyncio.create_task(watch.run(), name="weight-broadcaster watch")

    async def drain(self) -> None:
        self._accepting = False
        self._closed = True
        for run in list(self._runs.values()):
            wake(run)

    async def stop(self) -> None:
        self._accepting = False
        if self._broadcaster_watch is not None:
            self._broadcaster_watch.cancel()
        await self._worker.stop()

    # Runs (trainer.v1 CreateRun, GetRun, ListRuns, PauseRun, ResumeRun, DeleteRun).

    async def create_run(self, run_id: str, settings: RunSettings, caller: security.Caller, owner: str = "") -> RunView:
        check_adapter_name(run_id, field="run_id")
        if owner and owner != caller.name and not _is_operator(caller):
            raise security.PermissionDenied(f"{caller.describe()} may create runs for itself only, not for {owner!r}")
        owner = owner or caller.name
        run_config(settings, self.config, owner)  # refuses the settings, here rather than on every rank
        self._check_open()
        worker = self._worker

        def create() -> RunView:
            with self._cond:
                self._admit_new_run(run_id, owner)
                pending = worker.removals.get(run_id)
            if pending is not None and (error := worker.remove_adapter(run_id)) is not None:
                # Published anew over the old adapter, a replica still holding it could take it for the new.
                raise Unavailable(
                    f"run {run_id!r} was deleted and its adapter is not removed from the weight broadcaster "
                    f"yet ({error}); CreateRun it again once the removal is through",
                    retry_after_s=max(0.0, pending.due_at - time.monotonic()),
                    reason="ADAPTER_REMOVAL_PENDING",
                    metadata={"run_id": run_id},
                )
            run = worker.new_run(run_id, owner, settings, time.time())
            worker.create(run)
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
            self._worker.states_changed()
        logger.info("paused run %s", run_id, extra={"run_id": run_id})
        return self._view(run)

    async def resume_run(self, run_id: str, caller: security.Caller) -> RunView:
        run = self._run(run_id, caller)

        def resume() -> RunView:
            self._worker.resume(run)
            logger.info("resumed run %s at step %d", run_id, run.step, extra={"run_id": run_id})
            return self._view(run)

        return await self._call(resume)

    async def delete_run(self, run_id: str, caller: security.Caller) -> None:
        run = self._run(run_id, caller)
        await self._call(lambda: self._worker.delete(run))

    def feed(self, run_id: str, caller: security.Caller) -> RunFeed:
        """The run as the batch RPCs (GetBatchSpec, PushBatch, GetStatus, WatchSteps,
        SaveCheckpoint) see it, for its owner or an operator."""
        return RunFeed(self, self._run(run_id, caller))

    def status(self) -> TrainerStatus:
        """The trainer's status over all runs (GetStatus without a run_id); `last_publish_error`
        names the deleted runs whose adapters are still to be removed."""
        with self._cond:
            runs = list(self._runs.values())
            queued = sum(len(run.queue) for run in runs)
            training = self._worker.running is not None or any(run.queue and run.state == "active" for run in runs)
            removals = dict(self._worker.removals)
        return TrainerStatus(
            mode="rl",
            step=sum(run.step for run in runs),
            published_policy_version=-1,
            num_queued_batches=queued,
            training=training and self.failure is None,
            last_step=None,
            last_checkpoint_step=-1,
            last_publish_error=_pending_note(removals),
        )

    def pending_removals(self) -> list[str]:
        """The deleted runs whose adapters the weight broadcaster has not confirmed removed."""
        with self._cond:
            return sorted(self._worker.removals)

    # Shared by the feeds.

    def _run(self, run_id: str, caller: security.Caller) -> Run:
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

    def _view(self, run: Run) -> RunView:
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
            self._worker.submit(task, future)
        return await asyncio.wrap_future(future)


class RunFeed:
    """One run as the batch RPCs see it: what TrainingService is for the trainer of one run."""

    def __init__(self, service: RunService, run: Run) -> None:
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
        stepping = self._service._worker.running == view.run_id
        return TrainerStatus(
            mode=self.mode,
            step=view.step,
            published_policy_version=view.published_version,
            num_queued_batches=view.num_queued_batches,
            training=view.state == "active" and (view.num_queued_batches > 0 or stepping),
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
            return run.step, service._worker.save(run)

        return await service._call(save)

    async def watch_steps(self, after_step: int) -> AsyncIterator[StepRecord]:
        """The run's finished steps after `after_step` still remembered, then each new one, until
        the service drains or the run is deleted or fails."""
        run, service = self._run, self._service

        def ended() -> bool:
            return service._closed or run.state == "failed" or service._runs.get(run.run_id) is not run

        async for record in follow_steps(run.history, after_step, ended=ended, wakeup=lambda: run.wakeup):
            yield record


def _pending_note(removals: dict[str, Removal]) -> str:
    if not removals:
        return ""
    errors = [f"{run_id}: {removal.error}" for run_id, removal in sorted(removals.items()) if removal.error]
    note = f"adapters of deleted runs not yet removed from the weight broadcaster: {', '.join(sorted(removals))}"
    return note + (f" ({'; '.join(errors)})" if errors else "")


def _is_operator(caller: security.Caller) -> bool:
    return "*" in caller.roles or security.OPERATOR in caller.roles
