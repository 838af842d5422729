"""The contract of a built-in environment, which the orchestrator plays itself.

A built-in environment makes its tasks (a pure function of the run's seed and the task's
index, so that a resumed run continues the same stream from its data position) and plays
one episode of a task through `generate`, the same model turn an external environment
calls over gRPC: it sees text, never tokens, logprobs or versions.

Adding one is one module in this package: a BuiltinEnvironment subclass with a `kind`
(and, when it has settings, an `Options` section, set under `[environments.options]`). One that
knows the correct answer of its tasks returns it from `reference_answer`, which is what
`primerl_orchestrator.sft_export` writes SFT data from.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from primerl_common.config import Section

__all__ = ["BuiltinEnvironment", "Generate", "Outcome", "SingleTurnEnvironment", "Task", "TurnOutcome"]


@dataclass(frozen=True)
class Task:
    task_id: str
    # JSON-like: what the environment needs to play and score the task.
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TurnOutcome:
    """What an environment learns of a model turn."""

    text: str
    truncated: bool


@dataclass(frozen=True)
class Outcome:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


# One model turn: the conversation so far (role, content) -> the model's answer.
Generate = Callable[[Sequence[tuple[str, str]]], Awaitable[TurnOutcome]]


class BuiltinEnvironment(abc.ABC):
    kind: ClassVar[str]

    class Options(Section):
        """No settings."""

    def __init__(self, options: Options, *, seed: int) -> None:
        self.options = options
        self.seed = seed

    def rng(self, index: int) -> random.Random:
        """The random stream of task `index`: the same in every process and after a resume."""
        return random.Random(f"{self.kind}:{self.seed}:{index}")

    @abc.abstractmethod
    def task(self, index: int) -> Task:
        """Task number `index` of this environment's stream."""

    @abc.abstractmethod
    async def play(self, task: Task, generate: Generate) -> Outcome:
        """Plays one episode of `task` (at least one turn: a reward needs one); returns its reward."""

    def reference_answer(self, task: Task) -> str | None:
        """A correct answer to `task` (what SFT data trains on); None: this environment knows none."""
        return None


class SingleTurnEnvironment(BuiltinEnvironment):
    """One prompt, one answer, one score."""

    @abc.abstractmethod
    def prompt(self, task: Task) -> list[tuple[str, str]]:
        """The conversation the model answers."""

    @abc.abstractmethod
    def score(self, task: Task, answer: str) -> float:
        """Reward of `answer`, in [0, 1]."""

    async def play(self, task: Task, generate: Generate) -> Outcome:
        turn = await generate(self.prompt(task))
        return Outcome(self.score(task, turn.text), {"truncated": float(turn.truncated)})
