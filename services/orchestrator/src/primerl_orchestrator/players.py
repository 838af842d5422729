"""The orchestrator playing its built-in environments: each player takes the next episode,
plays it through the same turns an external environment calls, and finishes it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from primerl_common.errors import FailedPrecondition, ServiceError
from primerl_orchestrator.environments import BuiltinEnvironment, TurnOutcome
from primerl_orchestrator.run import Run

__all__ = ["play_builtin"]

logger = logging.getLogger(__name__)

# After a failed episode, so that a broken router is not hammered by every player at once.
_ERROR_PAUSE_S = 1.0


async def play_builtin(run: Run, name: str, environment: BuiltinEnvironment) -> None:
    """Plays episodes of environment `name` until the run is over."""
    while True:
        try:
            episode = await run.next_episode(name, builtin_player=True)
        except FailedPrecondition:
            return  # finished or failed

        async def generate(messages: Sequence[tuple[str, str]], episode_id: str = episode.episode_id) -> TurnOutcome:
            result = await run.generate(episode_id, messages=messages)
            return TurnOutcome(result.text, result.truncated)

        try:
            outcome = await environment.play(episode.group.task, generate)
        except Exception as exc:
            if not isinstance(exc, ServiceError):
                logger.exception("episode %s of %s failed", episode.episode_id, name)
                run.counters.count(name, "errors")
            if episode.state.ended:
                continue  # dropped by the orchestrator
            run.finish_episode(episode.episode_id, reward=0.0, metrics={}, discard=True)
            await asyncio.sleep(_ERROR_PAUSE_S)
            continue
        run.finish_episode(episode.episode_id, reward=outcome.reward, metrics=outcome.metrics, discard=False)
