"""The run's episode and batch bookkeeping, without other services: turns are recorded
straight into the episodes (what Generate records after the router answers), and the
calls refused before any generation are made for real."""

import asyncio
import math

import grpc
import pytest

from primerl_common.errors import FailedPrecondition, InvalidArgument, NotFound
from primerl_common.processes import free_port
from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.environments import Task
from primerl_orchestrator.generation import RouterGeneration
from primerl_orchestrator.rendering import PromptRenderer
from primerl_orchestrator.run import Run, RunState
from primerl_orchestrator.samples import Turn
from primerl_orchestrator.trainer_client import BatchSpec

SPEC = BatchSpec(
    seq_len=256, router_replay=False, num_hidden_layers=0, num_experts_per_token=0, vocab_size=320, next_step=1
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return path


@pytest.fixture
async def run(model_dir):
    config = OrchestratorConfig(
        model={"path": model_dir, "max_model_len": 64},
        environments=[
            {"name": "guess", "group_size": 2},
            {"name": "rev", "kind": "reverse_text", "group_size": 2},
        ],
        run={"batch_size": 2, "max_steps": 3, "max_off_policy_steps": 1},
    )
    # Nothing listens there: the calls tested here are refused before any generation.
    generation = RouterGeneration(f"127.0.0.1:{free_port()}", timeout_s=1)
    run = Run(config, PromptRenderer(model_dir, max_model_len=64), generation)
    run.begin(SPEC, next_step=1, versions_served=False)
    run.set_policy_version(0)
    yield run
    await generation.close()


def record_turn(episode, version: int) -> None:
    episode.tokens.add_turn(Turn([1, 2, 3], [4, 5], [-0.5, -0.25], [version, version], 1.0))
    episode.num_turns += 1


async def test_refusals_leave_the_run_going(run):
    with pytest.raises(NotFound):
        await run.generate("nope", messages=[("user", "hi")])
    with pytest.raises(NotFound):
        run.finish_episode("nope", reward=1.0, metrics={}, discard=False)
    with pytest.raises(NotFound, match="no environment 'nope'"):
        await run.next_episode("nope")
    with pytest.raises(FailedPrecondition) as builtin:
        await run.next_episode("rev")
    assert builtin.value.reason == "BUILTIN_ENVIRONMENT"
    with pytest.raises(FailedPrecondition) as no_stream:
        await run.next_episode("guess")
    assert no_stream.value.reason == "NO_TASK_STREAM"
    with pytest.raises(InvalidArgument, match=r"task\.task_id"):
        await run.start_episodes("guess", Task(""), 0)

    first, second = await run.start_episodes("guess", Task("t1", {"secret": 3}), 0)
    with pytest.raises(InvalidArgument) as too_long:
        await run.generate(first.episode_id, messages=[("user", "x" * 100)])
    assert too_long.value.reason == "PROMPT_TOO_LONG" and too_long.value.field == "messages"
    with pytest.raises(InvalidArgument, match="role 'robot'"):
        await run.generate(first.episode_id, messages=[("robot", "hi")])
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        await run.generate(first.episode_id, token_ids=[1, 999])
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        await run.generate(first.episode_id, token_ids=[])
    for bad in (math.nan, math.inf):
        with pytest.raises(InvalidArgument) as not_finite:
            run.finish_episode(first.episode_id, reward=bad, metrics={}, discard=False)
        assert not_finite.value.field == "reward"
    with pytest.raises(InvalidArgument, match=r"metrics\[turns\]"):
        run.finish_episode(first.episode_id, reward=1.0, metrics={"turns": math.nan}, discard=False)

    # A reward needs a turn to score; refused, the episode stays open.
    with pytest.raises(FailedPrecondition) as no_turn:
        run.finish_episode(first.episode_id, reward=1.0, metrics={}, discard=False)
    assert no_turn.value.reason == "NO_TURN_GENERATED"
    record_turn(first, version=0)
    assert run.finish_episode(first.episode_id, reward=1.0, metrics={}, discard=False).num_samples == 1
    with pytest.raises(FailedPrecondition) as twice:
        run.finish_episode(first.episode_id, reward=1.0, metrics={}, discard=False)
    assert twice.value.reason == "EPISODE_FINISHED"
    with pytest.raises(FailedPrecondition) as after_finish:
        await run.generate(first.episode_id, messages=[("user", "hi")])
    assert after_finish.value.reason == "EPISODE_FINISHED"
    assert run.finish_episode(second.episode_id, reward=0.0, metrics={}, discard=True).group_complete
    # Retired with its group, the episode is still known to be finished.
    with pytest.raises(FailedPrecondition):
        run.finish_episode(first.episode_id, reward=1.0, metrics={}, discard=False)
    assert run.state == RunState.RUNNING
    status = run.status()
    guess = {env.name: env for env in status.environments}["guess"]
    assert (guess.episodes_started, guess.episodes_finished) == (2, 1)
    # The discarded episode leaves its group incomplete; the one reward left is filtered.
    assert (status.groups.finished, status.groups.incomplete, status.groups.filtered_equal_rewards) == (0, 1, 1)


async def test_groups_become_batches_with_advantages_and_stale_rollouts_are_dropped(run):
    good = await run.start_episodes("guess", Task("t1"), 0)
    for episode, reward in zip(good, (1.0, 0.0), strict=True):
        record_turn(episode, version=0)
        run.finish_episode(episode.episode_id, reward=reward, metrics={"turns": 1.0}, discard=False)
    # Step 1 is covered: a group for step 2 needs version 1 (max_async_level 1).
    assert "needs policy version >= 1" in run.dispatcher.blocked_reason(2)
    run.set_policy_version(1)
    equal = await asyncio.wait_for(run.start_episodes("guess", Task("t2"), 0), 1)
    for episode in equal:
        record_turn(episode, version=0)
        run.finish_episode(episode.episode_id, reward=0.5, metrics={}, discard=False)
    assert run.counters.totals["guess"].groups_filtered_zero_advantage == 1

    rollouts = await asyncio.wait_for(run.next_batch(1), 1)
    assert sorted(r.advantage for r in rollouts) == [-0.5, 0.5]
    assert run.dispatcher.next_step == 2
    groups = run.status().groups
    assert (groups.finished, groups.filtered_equal_rewards, groups.incomplete, groups.batched) == (2, 1, 0, 1)

    # Step 3 takes versions >= 2 (max_off_policy_steps 1): version-0 rollouts are dropped.
    run.set_policy_version(2)
    old = await asyncio.wait_for(run.start_episodes("guess", Task("t3"), 0), 1)
    for episode, reward in zip(old, (1.0, 0.0), strict=True):
        record_turn(episode, version=0)
        run.finish_episode(episode.episode_id, reward=reward, metrics={}, discard=False)
    waiting = asyncio.ensure_future(run.next_batch(3))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert run.status().dropped_off_policy_total == 2
    waiting.cancel()


async def test_a_turn_on_a_too_old_episode_drops_it(run):
    [episode, other] = await run.start_episodes("guess", Task("t"), 0)
    record_turn(episode, version=0)
    run.dispatcher.update(next_step=3)
    with pytest.raises(FailedPrecondition) as dropped:
        await run.generate(episode.episode_id, messages=[("user", "hi")])
    assert dropped.value.reason == "EPISODE_DROPPED"
    with pytest.raises(FailedPrecondition):
        run.finish_episode(episode.episode_id, reward=1.0, metrics={}, discard=False)
    assert run.counters.totals["guess"].dropped_off_policy == 1
    assert other.state.value == "running"


async def test_pause_holds_dispatch_and_resume_reopens_it(run):
    assert run.pause() == RunState.PAUSED
    waiter = asyncio.ensure_future(run.start_episodes("guess", Task("t"), 0))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    assert run.resume() == RunState.RUNNING
    assert len(await asyncio.wait_for(waiter, 1)) == 2
    run.finish()
    with pytest.raises(FailedPrecondition) as finished:
        await run.start_episodes("guess", Task("t"), 0)
    assert finished.value.reason == "RUN_FINISHED"
    with pytest.raises(FailedPrecondition):
        run.pause()


async def test_sampling_overrides_are_checked(run):
    from primerl.common.v1 import generation_pb2

    [episode, _] = await run.start_episodes("guess", Task("t"), 0)
    with pytest.raises(InvalidArgument) as bad:
        await run.generate(
            episode.episode_id, messages=[("user", "hi")], sampling=generation_pb2.SamplingParams(temperature=0.0)
        )
    assert bad.value.field == "sampling.temperature"
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
