"""The worker thread of a trainer with runs (run_service.py): the runs, their turns, and the one
thread that touches the model.

The worker does everything that touches the model, one thing at a time, in this order: a control
task (create, delete, resume from a checkpoint, a checkpoint asked for: RunService's admission
hands them to `submit`), the next step of the run whose turn it is, a publish retry that is due, a
removal retry that is due. Turns go round: after a step its run goes to the back of the line, so a
run with batches queued waits for at most one step of each other run (none starves, whatever the
others push). A run's failure (an error in its step) fails that run alone: its queue is dropped,
the others keep stepping.

A deleted run's adapter is removed from the weight broadcaster (RemoveAdapter, which has every
replica unload it). Until the broadcaster confirms, the removal is pending: retried by the worker
with the publish retries' backoff (publish.initial_backoff_s doubling up to max_backoff_s), and
at once when the broadcaster answers again after a failure it could not reach. Pending removals
are kept in checkpoint.dir/runs/.pending_removals.json (run_checkpoint.py), so that a restarted
trainer goes on with them; without checkpoint.dir they are in memory only, and a restart forgets
them.

The seam with run_service.py: RunService decides (admission, ownership, quotas, views) and reads
`runs`, `removals` and `running` under `cond`; everything that changes a run's adapter,
checkpoints, publishes or removals happens here, on the worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl_common.errors import FailedPrecondition
from primerl_trainer import metrics as prometheus
from primerl_trainer.loop import QueuedBatch, StepRecord
from primerl_trainer.publish import PublishError, WeightPublisher
from primerl_trainer.run_ops import RunOps
from primerl_trainer.run_settings import RunSettings, RunState
from primerl_trainer.runtime import TrainingRuntime

__all__ = ["Removal", "Run", "RunWorker", "wake"]

logger = logging.getLogger(__name__)


@dataclass
class Run:
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


@dataclass
class Removal:
    """A deleted run's adapter that the weight broadcaster has not confirmed removed yet."""

    deleted_at: float
    due_at: float  # monotonic: when the worker tries (again)
    backoff_s: float
    num_failures: int = 0
    error: str = ""
    # The last failure may pass when the broadcaster answers again (UNAVAILABLE, a timeout).
    retryable: bool = True


class RunWorker:
    """The runs and the thread that trains, checkpoints, publishes and removes them (rank 0's;
    on several ranks each operation on the model goes through RunOps to the others)."""

    def __init__(self, runtime: TrainingRuntime) -> None:
        """Restores the runs and the pending removals checkpoint.dir/runs holds (blocking)."""
        self.config = runtime.config
        self.runtime = runtime
        self._ops = RunOps(runtime)
        # Read anywhere; changed through self._ops alone.
        self.run_set = self._ops.run_set
        self.checkpoints = self._ops.checkpoints
        self.runs: dict[str, Run] = {}
        # Deleted runs' adapters still to be removed from the weight broadcaster, by run id.
        self.removals: dict[str, Removal] = {}
        # Runs in the order their turns come (the one that stepped last at the back).
        self.turns: collections.deque[str] = collections.deque()
        # Guards runs, removals, turns, running and each run's fields.
        self.cond = threading.Condition()
        # The run whose step is under way.
        self.running: str | None = None
        # Why the worker stopped, if it stopped on an internal error.
        self.failure: BaseException | None = None
        self._tasks: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = collections.deque()
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._publisher = None
        publish = self.config.publish
        if publish.weight_broadcaster is not None:
            self._publisher = WeightPublisher(
                publish.weight_broadcaster,
                timeout_s=publish.timeout_s,
                max_message_bytes=self.config.server.max_message_bytes,
                streams=1,
            )
        self._restore()

    def start(self) -> None:
        """Starts the thread; its deliveries go to the running event loop."""
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="trainer-runs", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Once the tasks given are done: saves what save_on_stop asks, and ends the thread."""
        with self.cond:
            self._stop_requested = True
            self.cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def submit(self, task: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        """Under `cond`: `task` runs on the thread between steps; its result or error goes to `future`."""
        self._tasks.append((task, future))
        self.cond.notify()

    # Control tasks (on the worker thread).

    def create(self, run: Run) -> None:
        """A new run: its adapter made (on every rank), its metadata written, its turn given; its
        adapter published (version 0) next."""
        self._ops.create(run.run_id, _meta(run))
        with self.cond:
            self.runs[run.run_id] = run
            self.turns.append(run.run_id)
            if self._publisher is not None:
                # Replicas start without the adapter; rollouts that name it wait for version 0.
                run.publish_due_at = time.monotonic()
        self.states_changed()

    def resume(self, run: Run) -> None:
        """A paused or failed run active again; one whose update broke off half done restored from
        its latest checkpoint (FailedPrecondition when it has none)."""
        run_id = run.run_id
        if self.run_set.failure_of(run_id) is not None:
            # Its update broke off half done: its adapter and moments are not to be trusted.
            step = self._ops.load(run_id) if self.checkpoints else None
            if step is None:
                raise FailedPrecondition(
                    f"run {run_id!r} failed during an update and has no checkpoint to resume from; "
                    "delete it and create it again",
                    subject=run_id,
                )
            run.last_checkpoint_step = step
        with self.cond:
            run.step = self.run_set.step_of(run_id)
            if run.state == "failed":
                run.next_step = run.step + 1
                run.error = ""
            run.state = "active"
            self.states_changed()
            self.cond.notify()

    def delete(self, run: Run) -> None:
        """The run gone (its queue, adapter, checkpoints), and its adapter's removal from the
        weight broadcaster pending until it goes through (tried at once)."""
        run_id = run.run_id
        with self.cond:
            self.runs.pop(run_id, None)
            self.states_changed()
            with contextlib.suppress(ValueError):
                self.turns.remove(run_id)
        if self._publisher is not None:
            # Recorded before the run's folder goes: a restart in between finds one or the other.
            with self.cond:
                self.removals[run_id] = Removal(time.time(), time.monotonic(), self.config.publish.initial_backoff_s)
            self._save_removals()
        self._ops.delete(run_id)
        prometheus.forget_run(run_id)
        self.deliver(run)
        logger.info("deleted run %s (%d queued batches dropped)", run_id, len(run.queue), extra={"run_id": run_id})
        if self._publisher is not None:
            # No publish of it can be under way: this worker makes them, one thing at a time.
            self.remove_adapter(run_id)

    # The broadcaster watch's (on the event loop).

    def published_versions(self) -> dict[str, int]:
        with self.cond:
            return {run_id: run.published_version for run_id, run in self.runs.items()}

    def broadcaster_holds(self, status: wb_pb2.GetStatusResponse, published_before: dict[str, int]) -> None:
        """Publish a run's adapter at once, instead of at its next step or retry, when the
        broadcaster lacks what was published (it restarted) or a failed publish is waiting and
        the broadcaster is back; and try again at once a removal that failed for want of it."""
        with self.cond:
            now = time.monotonic()
            for removal in self.removals.values():
                if removal.num_failures and removal.retryable and removal.due_at > now:
                    removal.due_at = now  # it answers again
                    self.cond.notify()
            for run_id, published in published_before.items():
                run = self.runs.get(run_id)
                latest = status.latest_adapter_versions.get(run_id, -1)
                if run is None or self.running == run_id or latest >= max(published, run.step):
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
                    self.cond.notify()

    # The worker thread.

    def new_run(self, run_id: str, owner: str, settings: RunSettings, created_at: float) -> Run:
        return Run(
            run_id,
            owner,
            settings,
            created_at,
            history=collections.deque(maxlen=self.config.metrics_history),
            publish_backoff_s=self.config.publish.initial_backoff_s,
        )

    def _restore(self) -> None:
        """The runs checkpoint.dir/runs holds, each at its latest checkpoint, and the removals
        pending there (before serving)."""
        if self.checkpoints is None:
            return
        if self.config.checkpoint.resume:
            self._restore_runs()
        self._restore_removals()

    def _restore_runs(self) -> None:
        assert self.checkpoints is not None
        for run_id, meta in sorted(self.checkpoints.saved_runs().items()):
            run = self.new_run(run_id, meta["owner"], RunSettings(**meta["settings"]), meta["created_at"])
            step = self._ops.restore(run_id, meta)
            if step is not None:
                run.step, run.next_step, run.last_checkpoint_step = step, step + 1, step
            run.publish_due_at = time.monotonic() if self._publisher is not None else None
            self.runs[run_id] = run
            self.turns.append(run_id)
            self.states_changed()
            logger.info("restored run %s at step %d", run_id, run.step, extra={"run_id": run_id})

    def _restore_removals(self) -> None:
        assert self.checkpoints is not None
        saved = self.checkpoints.pending_removals()
        if not saved:
            return
        if self._publisher is None:
            logger.warning(
                "the adapters of deleted runs %s are still to be removed from a weight broadcaster, and none is "
                "configured (publish.weight_broadcaster): left for a trainer that has one",
                ", ".join(sorted(saved)),
            )
            return
        now, backoff_s = time.monotonic(), self.config.publish.initial_backoff_s
        for run_id, record in sorted(saved.items()):
            if run_id in self.runs:  # a restart stopped its deletion before its folder went: the run is back
                continue
            self.removals[run_id] = Removal(float(record.get("deleted_at", 0.0)), now, backoff_s)
        if self.removals.keys() != saved.keys():
            self._save_removals()
        if self.removals:
            logger.warning(
                "the adapters of deleted runs %s are still to be removed from the weight broadcaster: retrying",
                ", ".join(sorted(self.removals)),
            )

    def _work(self) -> None:
        if self.runtime.device.type == "cuda":
            torch.cuda.set_device(self.runtime.device)
        try:
            while True:
                job = self._next_job()
                if job is None:
                    self._save_on_stop()
                    self._ops.stop()
                    self._log_pending_removals()
                    return
                job()
        except BaseException as exc:
            self.failure = exc
            logger.exception("the trainer's run worker stopped on an internal error")
            with self.cond:
                for _, future in self._tasks:
                    future.set_exception(exc)
                self._tasks.clear()
        finally:
            if self._publisher is not None:
                self._publisher.close()

    def _next_job(self) -> Callable[[], None] | None:
        with self.cond:
            while True:
                if self._tasks:
                    task, future = self._tasks.popleft()
                    return lambda: _settle(future, task)
                if self._stop_requested:
                    return None
                for run_id in self.turns:
                    run = self.runs[run_id]
                    if run.state == "active" and run.queue:
                        self.turns.remove(run_id)
                        self.turns.append(run_id)
                        batch = run.queue.popleft()
                        self.running = run_id
                        return lambda: self._train(run, batch)
                # Retries: the publish due first, else the removal due first.
                now = time.monotonic()
                publishes = [(run.publish_due_at, run) for run in self.runs.values() if run.publish_due_at is not None]
                if publishes:
                    due_at, run = min(publishes, key=lambda item: item[0])
                    if due_at <= now:
                        return functools.partial(self._publish, run)
                removals = [(removal.due_at, run_id) for run_id, removal in self.removals.items()]
                if removals:
                    due_at, run_id = min(removals)
                    if due_at <= now:
                        return functools.partial(self.remove_adapter, run_id)
                due = [due_at for due_at, _ in publishes] + [due_at for due_at, _ in removals]
                self.cond.wait(min(due) - now if due else None)

    def _train(self, run: Run, batch: QueuedBatch) -> None:
        run_id = run.run_id
        try:
            metrics = self._ops.train(run_id, batch)
        except Exception as exc:
            with self.cond:
                dropped = len(run.queue)
                run.queue.clear()
                run.state, run.error = "failed", f"step {batch.step}: {type(exc).__name__}: {exc}"
                self.states_changed()
                run.next_step = run.step + 1
                self.running = None
            logger.exception(
                "run %s failed at step %d (%d queued batches dropped); the other runs go on",
                run_id,
                batch.step,
                dropped,
                extra={"run_id": run_id},
            )
            self.deliver(run)
            return
        run.step = self.run_set.step_of(run_id)
        prometheus.observe_run_step(run_id, run.step, metrics)
        checkpoint = self.config.checkpoint
        if self.checkpoints is not None and checkpoint.interval and run.step % checkpoint.interval == 0:
            start = time.perf_counter()
            self.save(run)
            metrics["checkpoint_s"] = time.perf_counter() - start
        if self._publisher is not None:
            metrics |= self._publish(run)
        if batch.num_samples:
            metrics["num_samples"] = float(batch.num_samples)
        if batch.policy_versions is not None:
            metrics["min_policy_version"], metrics["max_policy_version"] = map(float, batch.policy_versions)
            metrics["off_policy_steps_max"] = float(batch.step - batch.policy_versions[0])
        with self.cond:
            self.running = None
        record = StepRecord(batch.step, metrics, time.time(), policy_version=batch.step)
        logger.info("run %s trained step %d", run_id, batch.step, extra={"run_id": run_id, "step": batch.step})
        self.deliver(run, record)

    def save(self, run: Run) -> str:
        assert self.checkpoints is not None
        path = self._ops.save(run.run_id)
        run.last_checkpoint_step = run.step
        return path

    def _save_on_stop(self) -> None:
        if self.checkpoints is None or not self.config.checkpoint.save_on_stop:
            return
        for run in list(self.runs.values()):
            if run.step > 0 and run.last_checkpoint_step != run.step and self.run_set.failure_of(run.run_id) is None:
                self.save(run)

    def _publish(self, run: Run) -> dict[str, float]:
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
                with self.cond:
                    run.error = f"publish of version {step}: {exc}"
                    run.publish_due_at = time.monotonic() + run.publish_backoff_s if exc.retryable else None
                    run.publish_backoff_s = min(2 * run.publish_backoff_s, publish.max_backoff_s)
                logger.warning("run %s: publish of version %d failed: %s", run.run_id, step, exc)
                prometheus.observe_run_publish(run.run_id, step, ok=False)
                return {"published": 0.0}
        with self.cond:
            run.published_version, run.publish_due_at = step, None
            run.publish_backoff_s = publish.initial_backoff_s
            if run.state != "failed":
                run.error = ""
        seconds = time.perf_counter() - start
        prometheus.observe_run_publish(run.run_id, step, ok=True, seconds=seconds)
        return {"published": 1.0, "publish_s": seconds}

    def remove_adapter(self, run_id: str) -> str | None:
        """A deleted run's pending removal: its adapter off the broadcaster and every replica.
        None once the broadcaster confirms (or held no such adapter); else the failure, logged
        naming the adapter, and the removal retried with a backoff."""
        assert self._publisher is not None
        try:
            version = self._publisher.remove_adapter(run_id)
        except PublishError as exc:
            publish = self.config.publish
            with self.cond:
                removal = self.removals[run_id]
                removal.num_failures += 1
                removal.error, removal.retryable = str(exc), exc.retryable
                removal.due_at = time.monotonic() + removal.backoff_s
                removal.backoff_s = min(2 * removal.backoff_s, publish.max_backoff_s)
                retry_s = removal.due_at - time.monotonic()
            logger.error(
                "run %s is deleted, but its adapter is still on the weight broadcaster (RemoveAdapter %r failed: %s; "
                "failure %d, retry in %.1fs)",
                run_id,
                run_id,
                exc,
                removal.num_failures,
                retry_s,
                extra={"run_id": run_id},
            )
            return str(exc)
        with self.cond:
            del self.removals[run_id]
        self._save_removals()
        if version >= 0:
            logger.info("removed run %s's adapter (version %d) from the weight broadcaster", run_id, version)
        return None

    def _log_pending_removals(self) -> None:
        if not self.removals:
            return
        kept = "kept for the next start" if self.checkpoints is not None else "forgotten (no checkpoint.dir)"
        logger.warning(
            "stopping with the adapters of deleted runs %s still on the weight broadcaster: %s",
            ", ".join(sorted(self.removals)),
            kept,
        )

    def _save_removals(self) -> None:
        """The pending removals to checkpoint.dir/runs (rank 0's), if there is one. A failed write
        is logged: they go on in memory."""
        if self.checkpoints is None:
            return
        with self.cond:
            records = {run_id: {"deleted_at": removal.deleted_at} for run_id, removal in self.removals.items()}
        try:
            self.checkpoints.save_pending_removals(records)
        except OSError as exc:
            logger.error("writing the pending adapter removals %s failed: %s", sorted(records), exc)

    def states_changed(self) -> None:
        with self.cond:
            prometheus.observe_runs([run.state for run in self.runs.values()])

    def deliver(self, run: Run, record: StepRecord | None = None) -> None:
        """To the event loop: the step's record (None: the run failed), and wake its watchers."""

        def deliver() -> None:
            if record is not None:
                run.history.append(record)
            wake(run)

        if self._event_loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                self._event_loop.call_soon_threadsafe(deliver)


def wake(run: Run) -> None:
    """Its watchers look again (on the event loop)."""
    run.wakeup.set()
    run.wakeup = asyncio.Event()


def _settle(future: concurrent.futures.Future[Any], task: Callable[[], Any]) -> None:
    """Run a control task; its result or its (service) error goes to whoever waits on it."""
    try:
        future.set_result(task())
    except Exception as exc:
        future.set_exception(exc)


def _meta(run: Run) -> dict[str, Any]:
    return {"owner": run.owner, "created_at": run.created_at, "settings": dataclasses.asdict(run.settings)}
