import asyncio

import pytest

from primerl_common.errors import FailedPrecondition
from primerl_orchestrator.environments import Task
from primerl_orchestrator.episodes import EpisodeBook, EpisodeState
from primerl_orchestrator.scheduler import Dispatcher


def dispatcher(weights=None, *, batch_size=4, max_async_level=1, max_concurrent=16, max_steps=10, version=0):
    d = Dispatcher(
        weights=weights or {"a": 1.0},
        batch_size=batch_size,
        max_async_level=max_async_level,
        max_concurrent_episodes=max_concurrent,
        max_steps=max_steps,
    )
    d.update(policy_version=version, open=True)
    return d


book = EpisodeBook()


def factory(environment, size, targets=None):
    def make(target_step):
        if targets is not None:
            targets.append(target_step)
        return book.new_group(environment, Task("t"), size=size, policy_version=0, target_step=target_step, now=0.0)

    return make


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_group_is_handed_out_episode_by_episode():
    d = dispatcher()
    episodes = [await d.next_episode("a", 3, factory("a", 3)) for _ in range(3)]
    assert len({e.group.group_id for e in episodes}) == 1
    assert [e.index_in_group for e in episodes] == [0, 1, 2]
    assert all(e.state == EpisodeState.RUNNING for e in episodes)
    assert d.num_in_flight == 3 and d.num_started["a"] == 3


async def test_max_async_level_holds_groups_for_later_steps_until_the_version_is_published():
    d = dispatcher(batch_size=2, max_async_level=1, version=0)
    targets = []
    group = await d.start_group("a", 2, factory("a", 2, targets))
    assert targets == [1]
    waiter = asyncio.ensure_future(d.start_group("a", 2, factory("a", 2, targets)))
    await settle()
    # Step 1 is covered by the group in flight; step 2 needs version 1.
    assert not waiter.done()
    assert "needs policy version >= 1" in d.blocked_reason(2)
    d.update(policy_version=1)
    await asyncio.wait_for(waiter, 1)
    assert targets == [1, 2]
    assert d.target_step() == 3
    for episode in group.episodes:
        episode.state = EpisodeState.FINISHED
        d.episode_ended()
    # Episodes that ended without becoming ready rollouts (e.g. a filtered group) free their step.
    assert d.target_step() == 2


async def test_finished_episodes_of_a_group_still_playing_keep_their_step():
    d = dispatcher(batch_size=2, max_async_level=1, version=0)
    targets = []
    group = await d.start_group("a", 2, factory("a", 2, targets))
    first, second = group.episodes
    first.state = EpisodeState.FINISHED
    d.episode_ended(awaits_group=True)
    # Step 1 is still covered: its finished episode waits for the rest of its group.
    assert d.target_step() == 2
    second.state = EpisodeState.FINISHED
    d.episode_ended(awaits_group=True)
    d.num_ready += 2
    d.group_completed(2)
    assert d.num_awaiting_group == 0 and d.target_step() == 2
    d.update(policy_version=1)
    await d.start_group("a", 2, factory("a", 2, targets))
    assert targets == [1, 2]


async def test_concurrency_limit_and_max_steps():
    d = dispatcher(batch_size=100, max_concurrent=4, max_steps=1)
    await d.start_group("a", 3, factory("a", 3))
    assert "max_concurrent_episodes" in d.blocked_reason(2)
    assert d.blocked_reason(1) is None
    d2 = dispatcher(batch_size=2, max_steps=1, version=5)
    await d2.start_group("a", 2, factory("a", 2))
    assert "last step" in d2.blocked_reason(2)


async def test_weights_share_the_starts_among_waiting_environments():
    d = dispatcher({"a": 2.0, "b": 1.0}, batch_size=1000, max_concurrent=1000, max_async_level=1000)
    d.update(open=False)
    order = []

    async def player(name):
        episode = await d.next_episode(name, 1, factory(name, 1))
        order.append(episode.environment)

    players = [asyncio.ensure_future(player(name)) for name in "ab" for _ in range(6)]
    await settle()
    d.update(open=True)
    await asyncio.gather(*players)
    # Every start goes to the environment furthest behind its weight (ties: the first listed).
    assert order[:9] == ["a", "b", "a", "a", "b", "a", "a", "b", "a"]


async def test_closed_dispatch_refuses_waiters_and_pause_holds_them():
    d = dispatcher()
    d.update(open=False)
    waiter = asyncio.ensure_future(d.next_episode("a", 1, factory("a", 1)))
    await settle()
    assert not waiter.done()
    d.close(FailedPrecondition("over", reason="RUN_FINISHED"))
    with pytest.raises(FailedPrecondition, match="over"):
        await waiter
    assert d._waiting["a"] == 0
