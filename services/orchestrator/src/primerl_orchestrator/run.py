"""The run as environments see it: episodes handed out, model turns, rewards, the groups that
become rollouts ready for a batch, and the run's state and status.

Every call checks the episode's state first (episodes.py) so that a bad call from an
environment is refused with a clear status and nothing else changes; the run goes on.
Evaluation episodes of the environments a process plays go through the same calls
(eval_episodes.py): handed out when training cannot start a group, never trained on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from primerl.common.v1 import generation_pb2
from primerl_common.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable
from primerl_orchestrator.checkpoint import OrchestratorState
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.environments import Task
from primerl_orchestrator.environments.runtime import EnvironmentRuntime
from primerl_orchestrator.episodes import Episode, EpisodeBook, EpisodeState, Group, Rollout
from primerl_orchestrator.eval_episodes import EvalEpisode, EvalEpisodes
from primerl_orchestrator.generation import GenerationError, GenerationRequest, GenerationResult, RouterGeneration
from primerl_orchestrator.metrics import RunCounters
from primerl_orchestrator.ready import ReadyRollouts
from primerl_orchestrator.rendering import Message, PromptRenderer, RenderedPrompt
from primerl_orchestrator.samples import Turn
from primerl_orchestrator.scheduler import Dispatcher
from primerl_orchestrator.staleness import is_stale
from primerl_orchestrator.tool_calls import ToolCall, ToolSpec
from primerl_orchestrator.trainer_client import BatchSpec
from primerl_orchestrator.turns import sampling_params, turn_error

__all__ = ["EnvironmentStatus", "FinishResult", "GroupStatus", "Run", "RunState", "RunStatus", "TurnResult"]

logger = logging.getLogger(__name__)


class RunState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class TurnResult:
    text: str
    token_ids: list[int]
    finish_reason: int  # generation_pb2.FinishReason
    num_prompt_tokens: int
    turn: int
    truncated: bool
    first_policy_version: int
    last_policy_version: int
    # With tools offered: the calls in `text`.
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class FinishResult:
    group_complete: bool
    num_samples: int


@dataclass(frozen=True)
class EnvironmentStatus:
    name: str
    episodes_started: int
    episodes_finished: int
    episodes_running: int
    # Over the episodes finished before the last step.
    reward_mean: float
    reward_std: float
    dropped_off_policy: int
    # Failed turns and episodes, and timed-out episodes.
    errors: int


@dataclass(frozen=True)
class GroupStatus:
    """What became of the run's groups (GroupCounts in the proto says what each counts)."""

    finished: int
    filtered_equal_rewards: int
    incomplete: int
    episodes_timed_out: int
    batched: int


@dataclass(frozen=True)
class RunStatus:
    state: RunState
    # The last step whose batch went to the trainer.
    step: int
    max_steps: int
    policy_version: int
    max_async_level: int
    max_off_policy_steps: int
    dropped_off_policy_total: int
    off_policy_steps_mean: float
    off_policy_steps_max: int
    environments: list[EnvironmentStatus]
    groups: GroupStatus
    error: str


class Run:
    def __init__(
        self,
        config: OrchestratorConfig,
        renderer: PromptRenderer,
        generation: RouterGeneration,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        run = config.run
        self.environments = {env.name: EnvironmentRuntime(env, seed=run.seed) for env in config.environments}
        self.counters = RunCounters(self.environments)
        self.dispatcher = Dispatcher(
            weights={env.name: env.weight for env in config.environments},
            batch_size=run.batch_size,
            max_async_level=run.max_async_level,
            max_concurrent_episodes=run.max_concurrent_episodes,
            max_steps=run.max_steps,
        )
        self._renderer = renderer
        self._generation = generation
        self._clock = clock
        self._book = EpisodeBook()
        # Evaluation episodes of process-played environments (evals.py queues them).
        self.evals = EvalEpisodes(self.dispatcher, clock=clock)
        self._running: collections.Counter[str] = collections.Counter()
        self._ready = ReadyRollouts(
            advantage=config.advantage,
            max_off_policy_steps=run.max_off_policy_steps,
            counters=self.counters,
            on_change=lambda num_ready: self.dispatcher.update(num_ready=num_ready),
        )
        self.spec: BatchSpec | None = None
        self._versions_served = False
        self._paused = False
        self._finished = False
        self.error = ""
        # The last step whose batch went to the trainer, and its off-policy distances.
        self.last_pushed_step = 0
        self.off_policy_steps_mean = 0.0
        self.off_policy_steps_max = 0

    @property
    def renderer(self) -> PromptRenderer:
        return self._renderer

    @property
    def generation(self) -> RouterGeneration:
        return self._generation

    # ------------------------------------------------------------------ lifecycle (the batch loop)

    def begin(self, spec: BatchSpec, *, next_step: int, versions_served: bool) -> None:
        self.spec = spec
        self._versions_served = versions_served
        self.last_pushed_step = next_step - 1
        self.dispatcher.update(next_step=next_step, open=not self._paused)

    def set_policy_version(self, version: int) -> None:
        logger.info("policy version %d is the latest", version, extra={"policy_version": version})
        self.dispatcher.update(policy_version=version)

    def finish(self) -> None:
        self._finished = True
        self.dispatcher.close(
            FailedPrecondition("the run is finished: every step's batch went to the trainer", reason="RUN_FINISHED")
        )

    def drain(self) -> None:
        """No new episodes: the service is shutting down."""
        self.dispatcher.close(Unavailable("the orchestrator is shutting down", reason="DRAINING"))

    def fail(self, error: str) -> None:
        self.error = error
        self.dispatcher.close(FailedPrecondition(f"the run failed: {error}", reason="RUN_FAILED"))

    @property
    def state(self) -> RunState:
        if self.error:
            return RunState.FAILED
        if self._finished:
            return RunState.FINISHED
        if self.spec is None:
            return RunState.STARTING
        return RunState.PAUSED if self._paused else RunState.RUNNING

    def pause(self) -> RunState:
        self._check_not_over()
        self._paused = True
        self.dispatcher.update(open=False)
        return self.state

    def resume(self) -> RunState:
        self._check_not_over()
        self._paused = False
        self.dispatcher.update(open=self.spec is not None)
        return self.state

    def status(self) -> RunStatus:
        environments = []
        for name in self.environments:
            totals = self.counters.totals[name]
            reward_mean, reward_std = self.counters.last_rewards[name]
            environments.append(
                EnvironmentStatus(
                    name=name,
                    episodes_started=totals.episodes_started,
                    episodes_finished=totals.episodes_finished,
                    episodes_running=self._running[name],
                    reward_mean=reward_mean,
                    reward_std=reward_std,
                    dropped_off_policy=totals.dropped_off_policy,
                    errors=totals.errors + totals.timed_out,
                )
            )
        totals = self.counters.totals.values()
        groups = GroupStatus(
            finished=sum(t.groups_finished for t in totals),
            filtered_equal_rewards=sum(t.groups_filtered_zero_advantage for t in totals),
            incomplete=sum(t.groups_incomplete for t in totals),
            episodes_timed_out=sum(t.timed_out for t in totals),
            batched=sum(t.groups_batched for t in totals),
        )
        run = self.config.run
        return RunStatus(
            state=self.state,
            step=self.last_pushed_step,
            max_steps=run.max_steps,
            policy_version=-1 if self.dispatcher.policy_version is None else self.dispatcher.policy_version,
            max_async_level=run.max_async_level,
            max_off_policy_steps=run.max_off_policy_steps,
            dropped_off_policy_total=sum(env.dropped_off_policy for env in environments),
            off_policy_steps_mean=self.off_policy_steps_mean,
            off_policy_steps_max=self.off_policy_steps_max,
            environments=environments,
            groups=groups,
            error=self.error,
        )

    def checkpoint_state(self, step: int) -> OrchestratorState:
        return OrchestratorState(
            step=step,
            task_positions={name: env.next_task_index for name, env in self.environments.items()},
            episodes_started=dict(self.dispatcher.num_started),
            counters=self.counters.state(),
        )

    def restore(self, state: OrchestratorState) -> None:
        """Data positions, shares and counters of a checkpoint (environments since removed
        from the config are ignored)."""
        for name, position in state.task_positions.items():
            if name in self.environments:
                self.environments[name].next_task_index = position
        for name, started in state.episodes_started.items():
            if name in self.dispatcher.num_started:
                self.dispatcher.num_started[name] = started
        self.counters.restore(state.counters)

    def _check_not_over(self) -> None:
        if self.state in (RunState.FINISHED, RunState.FAILED):
            raise FailedPrecondition(f"the run is {self.state.value}", reason=f"RUN_{self.state.name}")

    # ------------------------------------------------------------------ episodes

    def environment(self, name: str) -> EnvironmentRuntime:
        try:
            return self.environments[name]
        except KeyError:
            raise NotFound(f"no environment {name!r}; configured: {', '.join(self.environments)}") from None

    async def next_episode(self, name: str, *, builtin_player: bool = False) -> Episode | EvalEpisode:
        """The next episode of the environment's task stream, or an evaluation episode of it
        while training cannot start a group (waits while both are held)."""
        env = self.environment(name)
        if env.builtin is not None and not builtin_player:
            raise FailedPrecondition(
                f"environment {name!r} is built in: the orchestrator plays it", reason="BUILTIN_ENVIRONMENT"
            )
        if env.tasks is None:
            raise FailedPrecondition(
                f"environment {name!r} has no task stream (tasks_file): start episodes with StartEpisode",
                reason="NO_TASK_STREAM",
            )
        group_size = env.config.group_size
        training = self.dispatcher.next_episode(
            name, group_size, lambda step: self._new_group(env, env.next_task(), group_size, step)
        )
        if env.process is None or not any(e.environment == name for e in self.config.evals):
            episode = await training
        else:
            episode = await self._training_or_eval(training, name)
            if isinstance(episode, EvalEpisode):
                return episode
        self._started(episode)
        return episode

    async def _training_or_eval(self, training: Awaitable[Episode], name: str) -> Episode | EvalEpisode:
        """Whichever comes first; one taken at the same time as the other is put back."""
        tasks = [asyncio.ensure_future(training), asyncio.ensure_future(self.evals.next_episode(name))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        taken = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        if not taken:
            raise next(t.exception() for t in tasks if not t.cancelled() and t.exception() is not None)
        if len(taken) == 2:
            self.evals.unget(taken[1])
        return taken[0]

    async def start_episodes(self, name: str, task: Task, num_episodes: int) -> list[Episode]:
        """A group of episodes for a task the environment brings (waits while dispatch is held)."""
        env = self.environment(name)
        if env.builtin is not None:
            raise FailedPrecondition(
                f"environment {name!r} is built in: the orchestrator plays it", reason="BUILTIN_ENVIRONMENT"
            )
        if not task.task_id:
            raise InvalidArgument("a task needs an id", field="task.task_id")
        size = num_episodes or env.config.group_size
        limit = self.config.run.max_concurrent_episodes
        if size > limit:
            raise InvalidArgument(f"{size} episodes exceed max_concurrent_episodes {limit}", field="num_episodes")
        group = await self.dispatcher.start_group(name, size, lambda step: self._new_group(env, task, size, step))
        for episode in group.episodes:
            self._started(episode)
        return group.episodes

    def _new_group(self, env: EnvironmentRuntime, task: Task, size: int, target_step: int) -> Group:
        version = self.dispatcher.policy_version
        assert version is not None, "groups start once a policy version is known"
        return self._book.new_group(
            env.name, task, size=size, policy_version=version, target_step=target_step, now=self._clock()
        )

    def _started(self, episode: Episode) -> None:
        self.counters.count(episode.environment, "episodes_started")
        self._running[episode.environment] += 1
        self.counters.set_running(episode.environment, self._running[episode.environment])

    # ------------------------------------------------------------------ turns

    async def generate(
        self,
        episode_id: str,
        *,
        messages: Sequence[Message | tuple[str, str]] | None = None,
        tools: Sequence[ToolSpec] = (),
        token_ids: Sequence[int] | None = None,
        sampling: generation_pb2.SamplingParams | None = None,
    ) -> TurnResult:
        evaluation = self.evals.get(episode_id)
        if evaluation is not None:
            return await self._generate_eval(evaluation, messages, tools, token_ids, sampling)
        episode = self._book.get(episode_id)
        episode.check_can_play()
        assert self.spec is not None, "episodes exist once the trainer's spec is known"
        rendered, field = self._prompt(messages, tools, token_ids)
        prompt = rendered.token_ids
        room = self._renderer.check_fits(len(prompt), field=field)
        params = sampling_params(self.environments[episode.environment].config.sampling, sampling, room=room)
        if rendered.images:
            self._check_trainer_takes_images()
        self._check_on_policy(episode)

        turn_index = episode.num_turns
        min_version = max(0, episode.group.target_step - self.config.run.max_async_level)
        request = GenerationRequest.of(
            rendered,
            request_id=f"{episode_id}-{turn_index}",
            episode_id=episode_id,
            sampling=params,
            min_policy_version=min_version if self._versions_served else 0,
            return_routed_experts=self.spec.router_replay,
        )
        episode.turn_in_progress = True
        try:
            result = await self._generation.generate(request)
        except GenerationError as exc:
            self.counters.count(episode.environment, "errors")
            raise turn_error(exc, field) from None
        finally:
            episode.turn_in_progress = False
        # Dropped (timed out, or off-policy) while the turn ran.
        episode.check_not_ended()
        if self._renderer.images is not None and self._renderer.images.image_token_id in result.token_ids:
            # An image token with no image: the trainer would refuse the whole batch it landed in.
            self.counters.count(episode.environment, "errors")
            raise FailedPrecondition(
                "inference sampled the image token (a replica that does not keep vision tokens out of "
                "completions); the turn is not recorded: try it again",
                reason="IMAGE_TOKEN_SAMPLED",
            )
        if result.routed_experts is not None:
            self._check_routed_experts(result.routed_experts.shape[1:], episode)
        turn = Turn(
            prompt,
            result.token_ids,
            result.logprobs,
            result.policy_versions,
            params.temperature,
            result.routed_experts,
            rendered.images,
            rendered.image_starts,
        )
        continued = episode.tokens.add_turn(turn)
        episode.num_turns += 1

        env = episode.environment
        num_tokens = len(result.token_ids)
        truncated = (
            result.finish_reason == generation_pb2.FINISH_REASON_LENGTH
            and len(prompt) + num_tokens >= self._renderer.max_model_len
        )
        self.counters.count(env, "turns")
        self.counters.count(env, "completion_tokens", num_tokens)
        if result.finish_reason == generation_pb2.FINISH_REASON_LENGTH:
            self.counters.count(env, "turns_length_limited")
        if truncated:
            self.counters.count(env, "turns_truncated_by_context")
        if turn_index > 0 and not continued:
            self.counters.count(env, "new_samples_after_first")
        return self._turn_result(result, prompt, turn_index, truncated, tools, episode_id)

    def _prompt(
        self,
        messages: Sequence[Message | tuple[str, str]] | None,
        tools: Sequence[ToolSpec],
        token_ids: Sequence[int] | None,
    ) -> tuple[RenderedPrompt, str]:
        """The turn's prompt, and the request field it came from."""
        if messages is not None:
            if tools:
                self._renderer.check_tool_format()
            return self._renderer.render(messages, tools=tools, field="messages.messages"), "messages"
        vocab_size = self.spec.vocab_size if self.spec is not None else self._renderer.vocab_size
        checked = self._renderer.check_tokens(token_ids or [], vocab_size=vocab_size)
        return RenderedPrompt(checked, checked), "tokens"

    def _turn_result(
        self,
        result: GenerationResult,
        prompt: list[int],
        turn_index: int,
        truncated: bool,
        tools: Sequence[ToolSpec],
        episode_id: str,
    ) -> TurnResult:
        text = self._renderer.decode(result.token_ids)
        return TurnResult(
            text=text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            num_prompt_tokens=len(prompt),
            turn=turn_index,
            truncated=truncated,
            first_policy_version=result.policy_versions[0],
            last_policy_version=result.policy_versions[-1],
            tool_calls=self._renderer.parse_tool_calls(text, id_prefix=f"call_{turn_index}") if tools else [],
        )

    async def _generate_eval(
        self,
        episode: EvalEpisode,
        messages: Sequence[Message | tuple[str, str]] | None,
        tools: Sequence[ToolSpec],
        token_ids: Sequence[int] | None,
        sampling: generation_pb2.SamplingParams | None,
    ) -> TurnResult:
        """A turn of an evaluation episode: the eval's sampling and policy version, nothing recorded
        for training."""
        episode.check_can_play()
        rendered, field = self._prompt(messages, tools, token_ids)
        prompt = rendered.token_ids
        room = self._renderer.check_fits(len(prompt), field=field)
        play = episode.play
        params = sampling_params(play.sampling, sampling, room=room)
        params.MergeFrom(play.forced_sampling)
        params.max_tokens = min(params.max_tokens, room)
        turn_index = episode.num_turns
        request = GenerationRequest.of(
            rendered,
            request_id=f"{episode.episode_id}-{turn_index}",
            episode_id=episode.episode_id,
            sampling=params,
            min_policy_version=play.policy_version if self._versions_served else 0,
            return_routed_experts=False,
        )
        episode.turn_in_progress = True
        try:
            result = await self._generation.generate(request)
        except GenerationError as exc:
            episode.turn_failed = f"{exc.code.name}: {exc.message}"
            raise turn_error(exc, field) from None
        finally:
            episode.turn_in_progress = False
        episode.turn_failed = ""
        episode.num_turns += 1
        text = self._renderer.decode(result.token_ids)
        last = messages[-1] if messages else None
        episode.prompts.append(
            (last.text if isinstance(last, Message) else last[1]) if last is not None else f"<{len(prompt)} tokens>"
        )
        episode.completions.append(text)
        episode.versions.extend(result.policy_versions)
        truncated = (
            result.finish_reason == generation_pb2.FINISH_REASON_LENGTH
            and len(prompt) + len(result.token_ids) >= self._renderer.max_model_len
        )
        return self._turn_result(result, prompt, turn_index, truncated, tools, episode.episode_id)

    def _check_on_policy(self, episode: Episode) -> None:
        """Drops an episode whose tokens are already too old for the step being collected:
        it could only land in that step or a later one."""
        oldest = episode.tokens.oldest_version
        step = self.dispatcher.next_step
        max_off = self.config.run.max_off_policy_steps
        if oldest is not None and is_stale(step, oldest, max_off_policy_steps=max_off):
            self._drop(
                episode,
                f"its oldest token is from policy version {oldest}, more than max_off_policy_steps {max_off} "
                f"behind step {step}",
                counter="dropped_off_policy",
            )
            episode.check_not_ended()

    def _check_trainer_takes_images(self) -> None:
        assert self.spec is not None and self._renderer.images is not None
        image_token_id = self._renderer.images.image_token_id
        if self.spec.image_token_id != image_token_id:
            raise FailedPrecondition(
                f"the prompt holds images (image token {image_token_id}) and the trainer's model takes "
                + ("none" if self.spec.image_token_id is None else f"image token {self.spec.image_token_id}")
                + ": they are different models",
                reason="TRAINER_TAKES_NO_IMAGES",
            )

    def _check_routed_experts(self, shape: Sequence[int], episode: Episode) -> None:
        assert self.spec is not None
        expected = (self.spec.num_hidden_layers, self.spec.num_experts_per_token)
        if tuple(shape) != expected:
            self.counters.count(episode.environment, "errors")
            raise FailedPrecondition(
                f"inference returned routed experts of [layers, top_k] {list(shape)}; the trainer replays "
                f"{list(expected)}: they serve different models",
                reason="ROUTED_EXPERTS_MISMATCH",
            )

    # ------------------------------------------------------------------ the end of an episode

    def finish_episode(
        self, episode_id: str, *, reward: float, metrics: dict[str, float], discard: bool
    ) -> FinishResult:
        evaluation = self.evals.get(episode_id)
        episode = self._book.get(episode_id) if evaluation is None else None
        if not math.isfinite(reward):
            raise InvalidArgument(f"{reward} is not a finite number", field="reward")
        for key, value in metrics.items():
            if not math.isfinite(value):
                raise InvalidArgument(f"{value} is not a finite number", field=f"metrics[{key}]")
        if evaluation is not None:
            self.evals.finish(evaluation, reward=reward, discard=discard)
            # Scored by its evaluation, never a training sample.
            return FinishResult(group_complete=False, num_samples=0)
        assert episode is not None
        episode.check_can_finish(discard=discard)
        env = episode.environment
        previous = episode.state
        if discard:
            episode.state = EpisodeState.DISCARDED
            self.counters.count(env, "episodes_discarded")
            num_samples = 0
        else:
            episode.state = EpisodeState.FINISHED
            episode.reward = reward
            self.counters.count(env, "episodes_finished")
            self.counters.finished(env, reward, metrics)
            num_samples = len(episode.tokens.samples)
        self._ended(episode, previous)
        return FinishResult(group_complete=episode.group.complete, num_samples=num_samples)

    def abandon_episodes(self, environment: str, reason: str) -> int:
        """Drops the running episodes of `environment` (the process that played them is gone,
        environments/processes.py) so that their groups end now; returns how many."""
        running = [e for e in self._book.live() if e.environment == environment and e.state == EpisodeState.RUNNING]
        for episode in running:
            self._drop(episode, reason, counter="errors")
        return len(running) + self.evals.abandon(environment, reason)

    def sweep(self) -> None:
        """Drops episodes past run.episode_timeout_s, and those gone too far off-policy."""
        now = self._clock()
        timeout_s = self.config.run.episode_timeout_s
        self.evals.sweep(timeout_s=timeout_s)
        for episode in self._book.live():
            if episode.state.ended:
                continue
            if now - episode.created_at > timeout_s:
                self._drop(episode, f"not finished within {timeout_s:.0f}s", counter="timed_out")
            elif not episode.turn_in_progress:
                # Dropped: its environment hears so on its next call.
                with contextlib.suppress(ServiceError):
                    self._check_on_policy(episode)

    def _drop(self, episode: Episode, reason: str, *, counter: str) -> None:
        if episode.state.ended:
            return
        # Per episode at debug level: the counters carry the totals.
        logger.debug("dropped episode %s: %s", episode.episode_id, reason, extra={"environment": episode.environment})
        previous = episode.state
        episode.state = EpisodeState.DROPPED
        episode.drop_reason = reason
        self.counters.count(episode.environment, counter)
        self._ended(episode, previous)

    def _ended(self, episode: Episode, previous: EpisodeState) -> None:
        group = episode.group
        finished = episode.state == EpisodeState.FINISHED
        # A finished episode of a group still playing keeps its place in its step until the
        # group completes, or another group would be started for that step.
        self.dispatcher.episode_ended(awaits_group=finished and not group.complete)
        env = episode.environment
        if previous == EpisodeState.RUNNING:
            self._running[env] -= 1
            self.counters.set_running(env, self._running[env])
        if group.complete:
            self._complete(group, last=episode)

    def _complete(self, group: Group, *, last: Episode) -> None:
        self._book.retire(group)
        self._ready.add(group)
        # The group's other finished episodes waited for it (the last one never did).
        self.dispatcher.group_completed(sum(e.state == EpisodeState.FINISHED for e in group.episodes if e is not last))

    # ------------------------------------------------------------------ batches

    async def next_batch(self, step: int) -> list[Rollout]:
        """Rollouts for the batch of `step`, once enough of them are recent enough."""
        while (taken := self._ready.take(step, self.config.run.batch_size)) is None:
            await self.dispatcher.wait_for_change()
        # From here the dispatcher collects for the next step; episodes already too old for it go now.
        self.dispatcher.update(next_step=step + 1)
        self.sweep()
        return taken
