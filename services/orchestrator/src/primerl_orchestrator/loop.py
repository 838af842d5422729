"""The loop that turns rollouts into trainer steps.

Startup: the trainer's batch spec (waiting for the trainer), the checkpoint, the policy
versions, the built-in players, the evaluations and the trackers. Then, per step: wait for
enough recent rollouts, pack them, checkpoint, push, write the step's metrics (with the eval
results finished since the previous step), its samples and the trackers' rows. The trainer's
next expected step is the truth about which steps exist: the loop starts there and follows
it if the trainer ever expects another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from typing import Any

import grpc
from safetensors.torch import save_file

from primerl_orchestrator.checkpoint import load_state, save_state
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.episodes import Rollout
from primerl_orchestrator.evals import EvalResult, Evaluator, follow_evals
from primerl_orchestrator.metrics import MetricsLog, mean_std
from primerl_orchestrator.packing import PackedBatch, TrainingSample, pack
from primerl_orchestrator.players import play_builtin
from primerl_orchestrator.run import Run
from primerl_orchestrator.staleness import off_policy_steps
from primerl_orchestrator.step_samples import sample_images, sample_rows, write_samples
from primerl_orchestrator.tracking import Tracker, watch_trainer_steps
from primerl_orchestrator.trainer_client import StepMismatch, TrainerFeed
from primerl_orchestrator.versions import VersionSource

__all__ = ["BatchLoop"]

logger = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 1.0
# Batches in a row with no loss token left (the trainer's seq_len below every prompt) before
# the run fails, and how often that is logged meanwhile.
_MAX_EMPTY_BATCHES = 20
_EMPTY_BATCH_LOG_INTERVAL_S = 30.0


class BatchLoop:
    def __init__(self, config: OrchestratorConfig, run: Run, trainer: TrainerFeed, versions: VersionSource) -> None:
        self._config = config
        self._run = run
        self._trainer = trainer
        self._versions = versions
        output = config.output
        self._metrics_log = MetricsLog(output.metrics_jsonl) if output.metrics_jsonl is not None else None
        evals_path = output.evals_path
        self._evals_log = MetricsLog(evals_path) if config.evals and evals_path is not None else None
        self._background: list[asyncio.Task[None]] = []
        self._tracker: Tracker | None = None
        # Eval results finished since the last step's metrics line, by eval name.
        self._new_evals: dict[str, dict[str, Any]] = {}
        self._last_off_policy: dict[str, float] = {}
        self._num_empty_batches = 0
        self._empty_batch_logged_at = -math.inf

    async def run(self) -> None:
        """The whole run; a failure is reported through the run's status, never raised."""
        try:
            # Off the event loop: wandb.init starts its service process (seconds).
            self._tracker = await asyncio.to_thread(Tracker, self._config)
            await self._feed_trainer()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("the run failed")
            self._run.fail(f"{type(exc).__name__}: {exc}")
        finally:
            for task in self._background:
                task.cancel()
            for task in self._background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._tracker is not None:
                self._tracker.close()

    async def _feed_trainer(self) -> None:
        run, config = self._run, self._config
        spec = await self._trainer.batch_spec()
        step = spec.next_step
        checkpoint_dir = config.output.checkpoint_dir
        state = load_state(checkpoint_dir) if checkpoint_dir is not None else None
        if state is not None:
            run.restore(state)
            logger.info(
                "resumed from the checkpoint of step %d; the trainer expects step %d",
                state.step,
                step,
                extra={"step": step},
            )
        self._rewind(step)
        run.begin(spec, next_step=step, versions_served=self._versions.served)
        self._spawn(self._versions.follow(run.set_policy_version))
        self._spawn(self._sweep())
        for name, env in run.environments.items():
            if env.builtin is not None:
                for _ in range(config.run.max_concurrent_episodes):
                    self._spawn(play_builtin(run, name, env.builtin))
        if config.evals:
            evaluator = Evaluator(
                config, run.renderer, run.generation, versions_served=self._versions.served, episodes=run.evals
            )
            group_size = min(env.group_size for env in config.environments)
            self._spawn(
                follow_evals(
                    evaluator, config.evals, run.dispatcher, self._eval_finished, training_group_size=group_size
                )
            )
        assert self._tracker is not None
        if self._tracker.enabled and config.tracking.trainer_metrics:
            self._spawn(
                watch_trainer_steps(
                    config.peers.trainer, self._tracker, after_step=step - 1, run_id=config.peers.run_id
                )
            )

        last_step_at = time.monotonic()
        while True:
            while step <= config.run.max_steps:
                rollouts = await self._next_batch(step)
                if isinstance(rollouts, int):
                    # The trainer restarted and lost the batches it had queued: a later step
                    # would wait forever for the policy version they make.
                    logger.warning(
                        "the trainer expects the batch of step %d again (it restarted); collecting it", rollouts
                    )
                    self._rewind(rollouts)
                    step = rollouts
                    run.dispatcher.update(next_step=step)
                    continue
                samples = [TrainingSample(sample, r.advantage) for r in rollouts for sample in r.samples]
                packed = pack(samples, seq_len=spec.seq_len, with_routed_experts=spec.router_replay)
                if packed.num_loss_tokens == 0:
                    self._empty_batch(step, rollouts, seq_len=spec.seq_len)
                    run.dispatcher.update(next_step=step)
                    continue
                self._num_empty_batches = 0
                now = time.monotonic()
                record = self._step_record(rollouts, packed, elapsed_s=now - last_step_at)
                oldest = [r.oldest_version for r in rollouts]
                pushed = await self._push(step, packed, record, oldest)
                if pushed is None:
                    break
                self._log_step(pushed, record, rollouts)
                step = pushed + 1
                last_step_at = now
            # Pushed is not trained: a trainer that restarted meanwhile lost the batches it had
            # queued, and asks for them again.
            missing = await self._first_untrained_step()
            if missing is None:
                break
            logger.warning("the trainer expects the batch of step %d again (it restarted); collecting it", missing)
            self._rewind(missing)
            step = missing
            run.dispatcher.update(next_step=step)
        run.finish()
        logger.info("the run is finished: %d steps", config.run.max_steps)

    def _empty_batch(self, step: int, rollouts: list[Rollout], *, seq_len: int) -> None:
        """A batch whose samples were all cut at the trainer's seq_len before their first
        completion token: logged as an error (at most every _EMPTY_BATCH_LOG_INTERVAL_S), and the
        run fails once _MAX_EMPTY_BATCHES came in a row."""
        self._num_empty_batches += 1
        # A sample's prompt: the tokens before its first loss token.
        prompts = [s.loss_mask.index(True) for r in rollouts for s in r.samples if any(s.loss_mask)]
        error = (
            f"the batch of step {step} has no loss token left: the trainer's seq_len {seq_len} (trainer.seq_len) "
            f"cuts every sample before its completion (prompts of {min(prompts, default=0)}-"
            f"{max(prompts, default=0)} tokens); raise trainer.seq_len above the prompts, or shorten them "
            f"({self._num_empty_batches} such batches in a row)"
        )
        if self._num_empty_batches >= _MAX_EMPTY_BATCHES:
            raise RuntimeError(error)
        now = time.monotonic()
        if now - self._empty_batch_logged_at >= _EMPTY_BATCH_LOG_INTERVAL_S:
            self._empty_batch_logged_at = now
            logger.error("%s; collecting again (the run fails after %d)", error, _MAX_EMPTY_BATCHES)

    async def _push(self, step: int, packed: PackedBatch, record: dict[str, Any], oldest: list[int]) -> int | None:
        """Pushes the batch as `step`, or as the step the trainer expects; returns that step
        (None: the trainer expects a step past max_steps, the run is over). The step's metrics
        line is written before each attempt (see MetricsLog)."""
        while True:
            self._checkpoint(step)
            if self._config.output.batches_dir is not None:
                self._dump(step, packed)
            if self._metrics_log is not None:
                self._metrics_log.write({**record, "step": step, **_off_policy(step, oldest)})
            try:
                await self._trainer.push(step, packed)
            except StepMismatch as mismatch:
                self._rewind(min(step, mismatch.expected_step))
                if mismatch.expected_step > self._config.run.max_steps:
                    logger.warning("%s, past max_steps: the run is over", mismatch)
                    return None
                logger.warning("%s; this batch becomes step %d", mismatch, mismatch.expected_step)
                step = mismatch.expected_step
                self._run.dispatcher.update(next_step=step + 1)
                continue
            self._pushed(step, packed, _off_policy(step, oldest))
            return step

    async def _next_batch(self, step: int) -> list[Rollout] | int:
        """The rollouts of `step`; or, if the trainer comes to expect an earlier step meanwhile
        (it restarted from its checkpoint without the batches it had queued), that step."""
        collecting = asyncio.ensure_future(self._run.next_batch(step))
        lost = asyncio.ensure_future(self._trainer_expects_before(step))
        try:
            await asyncio.wait([collecting, lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collecting, lost):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        return collecting.result() if collecting.done() and not collecting.cancelled() else lost.result()

    async def _trainer_expects_before(self, step: int) -> int:
        """Returns only once the trainer expects a step before `step`: that step."""
        while True:
            await asyncio.sleep(self._config.peers.poll_interval_s)
            spec = await self._trainer.batch_spec()
            if spec.next_step < step:
                return spec.next_step

    async def _first_untrained_step(self) -> int | None:
        """None once the trainer has trained max_steps; the step it expects, if it expects one
        up to max_steps (it lost queued batches)."""
        max_steps = self._config.run.max_steps
        while True:
            spec = await self._trainer.batch_spec()
            if spec.next_step <= max_steps:
                return spec.next_step
            try:
                if await self._trainer.completed_step() >= max_steps:
                    return None
            except grpc.aio.AioRpcError as exc:
                logger.info("trainer status: %s; asking again", exc.code().name)
            await asyncio.sleep(self._config.peers.poll_interval_s)

    def _rewind(self, step: int) -> None:
        """Forgets the metrics lines of `step` and later: the trainer does not hold those batches."""
        if self._metrics_log is not None and (removed := self._metrics_log.rewind(step)):
            logger.warning("removed the metrics of %d steps from step %d on: the trainer never got them", removed, step)

    def _checkpoint(self, step: int) -> None:
        directory = self._config.output.checkpoint_dir
        if directory is not None:
            save_state(directory, self._run.checkpoint_state(step))

    def _dump(self, step: int, packed: PackedBatch) -> None:
        directory = self._config.output.batches_dir
        assert directory is not None
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"micro_batch_{index}.{name}": tensor.contiguous()
            for index, micro_batch in enumerate(packed.micro_batches)
            for name, tensor in micro_batch.named_tensors().items()
        }
        metadata = {
            "step": str(step),
            "num_samples": str(packed.num_samples),
            "num_loss_tokens": str(packed.num_loss_tokens),
        }
        # Written aside and renamed: a reader never sees half a file.
        path = directory / f"step_{step:06d}.safetensors"
        partial = path.with_name(f".{path.name}.partial")
        save_file(tensors, partial, metadata=metadata)
        os.replace(partial, path)

    def _step_record(self, rollouts: list[Rollout], packed: PackedBatch, *, elapsed_s: float) -> dict[str, Any]:
        """The metrics of a batch about to be pushed (its step is added when it is written);
        closes the step's counters."""
        run = self._run
        policy_version = run.dispatcher.policy_version or 0
        per_env = run.counters.close_step(policy_version=policy_version)
        reward_mean, reward_std = mean_std([r.reward for r in rollouts])
        turns = sum(env["turns"] for env in per_env.values())
        return {
            "time": time.time(),
            "step_time_s": elapsed_s,
            "policy_version": policy_version,
            "num_rollouts": len(rollouts),
            "num_samples": packed.num_samples,
            "num_micro_batches": len(packed.micro_batches),
            "num_tokens": packed.num_tokens,
            "num_loss_tokens": packed.num_loss_tokens,
            "num_samples_truncated": packed.num_truncated,
            "num_samples_dropped_empty": packed.num_dropped_empty,
            "num_samples_truncated_before_image": packed.num_truncated_before_image,
            "min_policy_version": packed.min_policy_version,
            "max_policy_version": packed.max_policy_version,
            "batch_reward_mean": reward_mean,
            "batch_reward_std": reward_std,
            "num_dropped_off_policy": sum(env["dropped_off_policy"] for env in per_env.values()),
            "num_errors": sum(env["errors"] + env["timed_out"] for env in per_env.values()),
            # Since the previous step, as GetRunStatus's GroupCounts count them since the start.
            "num_groups_finished": sum(env["groups_finished"] for env in per_env.values()),
            "num_groups_filtered_equal_rewards": sum(env["groups_filtered_zero_advantage"] for env in per_env.values()),
            "num_groups_incomplete": sum(env["groups_incomplete"] for env in per_env.values()),
            "num_episodes_timed_out": sum(env["timed_out"] for env in per_env.values()),
            "num_groups_batched": sum(env["groups_batched"] for env in per_env.values()),
            "samples_per_s": packed.num_samples / elapsed_s,
            "tokens_per_s": sum(env["completion_tokens"] for env in per_env.values()) / elapsed_s,
            "truncated_fraction": sum(env["turns_length_limited"] for env in per_env.values()) / max(turns, 1),
            "environments": per_env,
            "evals": self._take_evals(),
        }

    def _eval_finished(self, result: EvalResult) -> None:
        record = result.record()
        self._new_evals[result.name] = record
        if self._evals_log is not None:
            self._evals_log.write({**record, "step": self._run.last_pushed_step})
        if self._tracker is not None:
            self._tracker.log_eval(result)

    def _take_evals(self) -> dict[str, dict[str, Any]]:
        taken, self._new_evals = self._new_evals, {}
        return {name: {k: v for k, v in record.items() if k not in ("name", "time")} for name, record in taken.items()}

    def _log_step(self, step: int, record: dict[str, Any], rollouts: list[Rollout]) -> None:
        """The step's samples and tracker rows, once its batch went to the trainer."""
        tracker, samples_dir = self._tracker, self._config.output.samples_dir
        wants_samples = tracker is not None and tracker.wants_samples(step)
        if samples_dir is not None or wants_samples:
            rows = sample_rows(step, rollouts, self._run.renderer)
            if samples_dir is not None:
                write_samples(samples_dir, step, rows, sample_images(rollouts))
            if tracker is not None and wants_samples:
                tracker.log_samples(step, rows)
        if tracker is not None:
            tracker.log_step(step, {**record, **self._last_off_policy})

    def _pushed(self, step: int, packed: PackedBatch, off_policy: dict[str, float]) -> None:
        run = self._run
        self._last_off_policy = off_policy
        run.last_pushed_step = step
        run.off_policy_steps_mean = off_policy["off_policy_steps_mean"]
        run.off_policy_steps_max = int(off_policy["off_policy_steps_max"])
        run.counters.pushed(
            step=step,
            off_policy_max=run.off_policy_steps_max,
            num_samples=packed.num_samples,
            num_tokens=packed.num_tokens,
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            self._run.sweep()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        task.add_done_callback(_log_failure)
        self._background.append(task)


def _off_policy(step: int, oldest_versions: list[int]) -> dict[str, float]:
    """How far the batch of `step` is from the oldest version in each of its rollouts."""
    distances = [off_policy_steps(step, version) for version in oldest_versions]
    return {"off_policy_steps_mean": math.fsum(distances) / len(distances), "off_policy_steps_max": max(distances)}


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("a background task of the run failed", exc_info=task.exception())
