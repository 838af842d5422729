"""Evaluations: a fixed set of an environment's tasks played on the current policy, scored,
never trained on.

An evaluation plays the first `num_tasks` tasks of its environment's stream (under its own
seed), `num_samples` times each, through the same router as training rollouts, and reports
the mean reward and pass@k (the unbiased estimator from n samples per task). The orchestrator
plays a built-in environment's samples itself; an environment played by a process of its own
gets them as evaluation episodes through the API (eval_episodes.py), played by that process. During training
an eval episode starts only while training cannot start a group (TrainingFirst): evaluations
fill the time inference would otherwise wait for a new policy, and never take a slot a
training group could have.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from primerl.common.v1 import generation_pb2
from primerl_orchestrator.config import EvalConfig, EvalSampling, OrchestratorConfig
from primerl_orchestrator.environments import BuiltinEnvironment, Task, TurnOutcome
from primerl_orchestrator.environments.runtime import EnvironmentRuntime
from primerl_orchestrator.eval_episodes import EvalEpisodes, EvalPlay, SampleRecord
from primerl_orchestrator.generation import GenerationError, GenerationRequest, RouterGeneration
from primerl_orchestrator.metrics import mean_std
from primerl_orchestrator.rendering import PromptRenderer
from primerl_orchestrator.scheduler import Dispatcher
from primerl_orchestrator.turns import sampling_params

__all__ = ["Admission", "EvalResult", "Evaluator", "Immediately", "TrainingFirst", "follow_evals", "pass_at_k"]

logger = logging.getLogger(__name__)

# Default offset of an eval's task seed from the run's: a stream apart from training's.
EVAL_SEED_OFFSET = 1000
# Plays of a sample while inference is unavailable, before it counts as failed.
_SAMPLE_ATTEMPTS = 3


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from the n
    sampled passes, c of them passing: 1 - C(n - c, k) / C(n, k), as a product (no huge
    binomials)."""
    if not 1 <= k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@{k} of {num_correct} passing out of {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    failing_all = 1.0
    for drawn in range(num_samples - num_correct + 1, num_samples + 1):
        failing_all *= 1.0 - k / drawn
    return 1.0 - failing_all


@dataclass
class EvalResult:
    name: str
    environment: str
    # The latest policy version when the evaluation started, and the versions its tokens came from.
    policy_version: int
    min_token_version: int | None
    max_token_version: int | None
    num_tasks: int
    num_samples: int
    reward_mean: float
    reward_std: float
    pass_at: dict[int, float]
    num_errors: int
    duration_s: float
    samples: list[SampleRecord] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        """The numbers, flat (what metrics.jsonl and the trackers get)."""
        return {
            "policy_version": self.policy_version,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            **{f"pass@{k}": value for k, value in self.pass_at.items()},
            "num_tasks": self.num_tasks,
            "num_samples": self.num_samples,
            "num_errors": self.num_errors,
            "min_token_version": self.min_token_version,
            "max_token_version": self.max_token_version,
            "duration_s": self.duration_s,
        }

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "environment": self.environment, "time": time.time(), **self.metrics()}


class Admission(Protocol):
    def may_start(self) -> bool:
        """True while an eval episode may start."""

    async def wait(self) -> None:
        """Returns when an eval episode may start."""


class Immediately:
    """No training to give way to (`primerl eval`)."""

    def may_start(self) -> bool:
        return True

    async def wait(self) -> None:
        return None


class TrainingFirst:
    """An eval episode starts only while the run is open and training cannot start a group of
    its smallest size (waiting for a policy version, every step covered, or its episodes at
    max_concurrent_episodes)."""

    def __init__(self, dispatcher: Dispatcher, *, group_size: int) -> None:
        self._dispatcher = dispatcher
        self._group_size = group_size

    def may_start(self) -> bool:
        d = self._dispatcher
        return d.open and d.closed_error is None and d.blocked_reason(self._group_size) is not None

    async def wait(self) -> None:
        while not self.may_start():
            await self._dispatcher.wait_for_change()


class Evaluator:
    """Plays evaluations of the configured environments through the router."""

    def __init__(
        self,
        config: OrchestratorConfig,
        renderer: PromptRenderer,
        generation: RouterGeneration,
        *,
        versions_served: bool,
        episodes: EvalEpisodes | None = None,
        max_sample_records: int = 8,
    ) -> None:
        """`episodes`: where the evaluations of process-played environments are handed out (the
        run's), None when there are none."""
        self._config = config
        self._episodes = episodes
        self._renderer = renderer
        self._generation = generation
        self._versions_served = versions_served
        self._max_sample_records = max_sample_records
        self.environments: dict[str, EnvironmentRuntime] = {}
        for evaluation in config.evals:
            seed = evaluation.seed if evaluation.seed is not None else config.run.seed + EVAL_SEED_OFFSET
            runtime = EnvironmentRuntime(config.eval_environment(evaluation), seed=seed)
            if runtime.builtin is None and (runtime.process is None or episodes is None):
                raise ValueError(f"eval {evaluation.name!r}: nobody plays its environment")
            self.environments[evaluation.name] = runtime

    async def evaluate(self, evaluation: EvalConfig, *, policy_version: int, admission: Admission) -> EvalResult:
        runtime = self.environments[evaluation.name]
        assert runtime.tasks is not None
        tasks = [runtime.tasks.task(index) for index in range(evaluation.num_tasks)]
        started = time.monotonic()
        token_versions: list[int] = []
        if runtime.builtin is not None:
            records = await self._play_builtin(
                evaluation, runtime, tasks, policy_version=policy_version, admission=admission, versions=token_versions
            )
        else:
            assert self._episodes is not None and evaluation.environment is not None
            play = EvalPlay(
                evaluation=evaluation.name,
                environment=evaluation.environment,
                policy_version=policy_version,
                sampling=runtime.config.sampling,
                forced_sampling=_forced(evaluation.sampling),
                max_concurrent=evaluation.max_concurrent,
                may_start=admission.may_start,
            )
            records = await self._episodes.play(play, tasks, evaluation.num_samples)
            token_versions.extend(r.policy_version for r in records if not r.error)
        return self._result(evaluation, runtime, records, policy_version, token_versions, started)

    async def _play_builtin(
        self,
        evaluation: EvalConfig,
        runtime: EnvironmentRuntime,
        tasks: list[Task],
        *,
        policy_version: int,
        admission: Admission,
        versions: list[int],
    ) -> list[SampleRecord]:
        environment = runtime.builtin
        assert environment is not None
        slots = asyncio.Semaphore(evaluation.max_concurrent)
        token_versions = versions

        async def play(task: Task, index: int) -> SampleRecord:
            async with slots:
                await admission.wait()
                return await self._play(
                    evaluation,
                    environment,
                    runtime,
                    task,
                    index,
                    policy_version=policy_version,
                    versions=token_versions,
                )

        plays = [play(task, index) for task in tasks for index in range(evaluation.num_samples)]
        return list(await asyncio.gather(*plays))

    def _result(
        self,
        evaluation: EvalConfig,
        runtime: EnvironmentRuntime,
        records: list[SampleRecord],
        policy_version: int,
        token_versions: list[int],
        started: float,
    ) -> EvalResult:
        rewards = [r.reward for r in records]
        per_task = [records[i : i + evaluation.num_samples] for i in range(0, len(records), evaluation.num_samples)]
        passed = [sum(r.reward >= evaluation.pass_threshold and not r.error for r in group) for group in per_task]
        reward_mean, reward_std = mean_std(rewards)
        return EvalResult(
            name=evaluation.name,
            environment=runtime.config.kind,
            policy_version=policy_version,
            min_token_version=min(token_versions, default=None),
            max_token_version=max(token_versions, default=None),
            num_tasks=evaluation.num_tasks,
            num_samples=evaluation.num_samples,
            reward_mean=reward_mean,
            reward_std=reward_std,
            pass_at={
                k: math.fsum(pass_at_k(evaluation.num_samples, c, k) for c in passed) / len(passed)
                for k in evaluation.ks
            },
            num_errors=sum(bool(r.error) for r in records),
            duration_s=time.monotonic() - started,
            # One sample of each task first, so that the table shows different tasks.
            samples=[group[0] for group in per_task][: self._max_sample_records],
        )

    async def _play(
        self,
        evaluation: EvalConfig,
        environment: BuiltinEnvironment,
        runtime: EnvironmentRuntime,
        task: Task,
        index: int,
        *,
        policy_version: int,
        versions: list[int],
    ) -> SampleRecord:
        episode_id = f"eval-{evaluation.name}-v{policy_version}-{task.task_id}-{index}"
        turns: list[tuple[str, str]] = []
        sample_versions: list[int] = []

        async def generate(messages: Sequence[tuple[str, str]]) -> TurnOutcome:
            prompt = self._renderer.render_messages(messages)
            room = self._renderer.check_fits(len(prompt), field="messages")
            request = GenerationRequest(
                request_id=f"{episode_id}-{len(turns)}",
                episode_id=episode_id,
                prompt_token_ids=prompt,
                sampling=sampling_params(runtime.config.sampling, None, room=room),
                cache_salt="",  # replicas salt with the version they serve the turn at
                min_policy_version=policy_version if self._versions_served else 0,
                return_routed_experts=False,
            )
            result = await self._generation.generate(request)
            text = self._renderer.decode(result.token_ids)
            turns.append((messages[-1][1], text))
            sample_versions.extend(result.policy_versions)
            truncated = (
                result.finish_reason == generation_pb2.FINISH_REASON_LENGTH
                and len(prompt) + len(result.token_ids) >= self._renderer.max_model_len
            )
            return TurnOutcome(text, truncated)

        reward, error = 0.0, ""
        for attempt in range(1, _SAMPLE_ATTEMPTS + 1):
            turns.clear()
            sample_versions.clear()
            try:
                reward, error = (await environment.play(task, generate)).reward, ""
                break
            except GenerationError as exc:
                # Inference unavailable (after the router retries): the answer was never seen, so
                # the sample is played again rather than scored as wrong.
                error = f"{type(exc).__name__}: {exc}"
                if exc.code != grpc.StatusCode.UNAVAILABLE or attempt == _SAMPLE_ATTEMPTS:
                    break
                logger.info("eval %s: sample %s again (%s)", evaluation.name, episode_id, exc)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                break
        if error:  # counted as failed; the evaluation goes on
            logger.warning("eval %s: sample %s failed: %s", evaluation.name, episode_id, error)
        versions.extend(sample_versions)
        return SampleRecord(
            task_id=task.task_id,
            prompt="\n".join(prompt for prompt, _ in turns),
            completion="\n".join(completion for _, completion in turns),
            reward=reward,
            policy_version=min(sample_versions, default=policy_version),
            error=error,
        )


async def follow_evals(
    evaluator: Evaluator,
    evaluations: Sequence[EvalConfig],
    dispatcher: Dispatcher,
    on_result: Callable[[EvalResult], Awaitable[None] | None],
    *,
    training_group_size: int,
) -> None:
    """Runs each evaluation whenever the latest policy version enters a new multiple of its
    interval (and at version 0 when `at_start`), until cancelled. A version that arrives while
    the previous evaluation runs is evaluated after it, as the latest one then. Eval episodes
    give way to training groups of `training_group_size` (TrainingFirst)."""
    if not evaluations:
        return
    admission = TrainingFirst(dispatcher, group_size=training_group_size)

    async def follow(evaluation: EvalConfig) -> None:
        interval = evaluation.interval_steps
        last_period = -1 if evaluation.at_start else 0
        while True:
            version = dispatcher.policy_version
            if version is None or version // interval <= last_period:
                await dispatcher.wait_for_change()
                continue
            last_period = version // interval
            try:
                result = await evaluator.evaluate(evaluation, policy_version=version, admission=admission)
            except Exception:
                logger.exception("eval %s at policy version %d failed", evaluation.name, version)
                continue
            logger.info(
                "eval %s at policy version %d: reward %.3f, %s",
                evaluation.name,
                version,
                result.reward_mean,
                ", ".join(f"pass@{k} {v:.3f}" for k, v in result.pass_at.items()),
                extra={"policy_version": version},
            )
            outcome = on_result(result)
            if outcome is not None:
                await outcome

    await asyncio.gather(*(follow(evaluation) for evaluation in evaluations))


def _forced(sampling: EvalSampling) -> generation_pb2.SamplingParams:
    """The eval's own sampling settings, as the fields that replace a turn's."""
    return generation_pb2.SamplingParams(**sampling.model_dump(exclude_none=True))
