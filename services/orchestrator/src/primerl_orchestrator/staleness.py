"""The two rules that bound how far rollouts are from the policy the trainer updates.

Steps count from 1; policy version n is the weights after trainer step n (version 0: the
initial weights). The batch of step n is trained starting from version n - 1, so every token
in it was sampled by a version <= n - 1.

- max_async_level (how far inference may run ahead of training): a group is started *for*
  a step, the first step whose batch is not yet covered by the rollouts ready or in flight:

      target_step = next_step + (num_ready + num_in_flight + num_awaiting_group) // batch_size

  (num_awaiting_group: finished episodes of groups still playing; without them a group
  whose first episodes finished early would look short and a second group would be started
  for its step, whose rollouts would land a step later than their version allows for)

  and it may start only once the latest policy version v satisfies
  v >= target_step - max_async_level. With the default 1, step n's rollouts start on
  version n - 1: the trainer's previous step must be published first.

- max_off_policy_steps: a rollout goes into the batch of step n only if the oldest version
  that sampled one of its tokens, o, satisfies n - o <= max_off_policy_steps. Checked before
  each turn of an episode (against the step being collected; an episode that can only land
  in that step or a later one is dropped at once) and again when each batch is cut.
  Dropped rollouts are counted per environment.

Since a group starts at v >= n - max_async_level, max_off_policy_steps >= max_async_level
keeps rollouts that finish in time; more leaves room for slow or long episodes.
"""

from __future__ import annotations

__all__ = ["is_stale", "may_start", "off_policy_steps", "target_step"]


def target_step(next_step: int, *, num_committed: int, batch_size: int) -> int:
    """The step a new group would be collected for; `num_committed`: rollouts ready or in flight."""
    return next_step + num_committed // batch_size


def may_start(policy_version: int, step: int, *, max_async_level: int) -> bool:
    """Whether a group for `step` may start while `policy_version` is the latest."""
    return policy_version >= step - max_async_level


def off_policy_steps(step: int, oldest_version: int) -> int:
    """How many steps the batch of `step` is ahead of the oldest version in a rollout."""
    return step - oldest_version


def is_stale(step: int, oldest_version: int, *, max_off_policy_steps: int) -> bool:
    return off_policy_steps(step, oldest_version) > max_off_policy_steps
