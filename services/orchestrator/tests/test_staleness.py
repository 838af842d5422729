from primerl_orchestrator.staleness import is_stale, may_start, off_policy_steps, target_step


def test_target_step_counts_whole_batches_ready_or_in_flight():
    assert target_step(1, num_committed=0, batch_size=8) == 1
    assert target_step(1, num_committed=7, batch_size=8) == 1
    assert target_step(1, num_committed=8, batch_size=8) == 2
    assert target_step(5, num_committed=17, batch_size=8) == 7


def test_max_async_level():
    # Step 1 needs version 0 (the initial weights) at max_async_level 1; step 2 needs version 1.
    assert may_start(0, 1, max_async_level=1)
    assert not may_start(0, 2, max_async_level=1)
    assert may_start(1, 2, max_async_level=1)
    assert may_start(0, 3, max_async_level=3)
    assert not may_start(0, 4, max_async_level=3)


def test_max_off_policy_steps():
    # Step n takes rollouts whose oldest token is from version >= n - max_off_policy_steps.
    assert off_policy_steps(5, 3) == 2
    assert not is_stale(5, 3, max_off_policy_steps=2)
    assert is_stale(5, 2, max_off_policy_steps=2)
    # A rollout started at the lag max_async_level allows is never stale when it finishes in time.
    assert not is_stale(2, 1, max_off_policy_steps=1)
