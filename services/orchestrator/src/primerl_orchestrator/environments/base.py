"""The contract of an environment of a kind the orchestrator knows.

Such an environment makes its tasks (a pure function of the run's seed and the task's
index, so that a resumed run continues the same stream from its data position). A built-in
one (BuiltinEnvironment) plays one episode of a task in the orchestrator through `generate`,
the same model turn an external environment calls over gRPC: it sees text, never tokens,
logprobs or versions. A process environment (ProcessEnvironment) is played by a program of
its own that the orchestrator starts, restarts when it dies, and that reaches the
orchestrator through its gRPC API only, like an external environment: a crash in it never
takes the orchestrator down.

Adding one is one module in this package: a subclass of either with a `kind` (and, when it
has settings, an `Options` section, set under `[environments.options]`). One that knows the
correct answer of its tasks returns it from `reference_answer`, which is what
`primerl_orchestrator.sft_export` writes SFT data from.
"""

from __future__ import annotations

import abc
import pathlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from primerl_common.config import Section

__all__ = [
    "BuiltinEnvironment",
    "Environment",
    "Generate",
    "Outcome",
    "ProcessEnvironment",
    "SingleTurnEnvironment",
    "Task",
    "TurnOutcome",
]


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


class Environment(abc.ABC):
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

    def reference_answer(self, task: Task) -> str | None:
        """A correct answer to `task` (what SFT data trains on); None: this environment knows none."""
        return None


class BuiltinEnvironment(Environment):
    """Played by the orchestrator itself."""

    @abc.abstractmethod
    async def play(self, task: Task, generate: Generate) -> Outcome:
        """Plays one episode of `task` (at least one turn: a reward needs one); returns its reward."""


class ProcessEnvironment(Environment):
    """Played by a program of its own, which the orchestrator starts, restarts when it dies (at
    most `max_restarts` times, waiting `restart_backoff_s`, doubled after each death that came
    sooner than a minute after its start, up to `max_restart_backoff_s`), and stops with the
    run. The program takes this environment's episodes with NextEpisode (the task stream is
    `task`), plays them with Generate and ends them with FinishEpisode; episodes it was playing
    when it died are dropped."""

    class Options(Environment.Options):
        max_restarts: int = Field(
            default=10, ge=0, description="restarts of the environment's process before the run fails"
        )
        restart_backoff_s: float = Field(default=1.0, gt=0, description="wait before the first restart")
        max_restart_backoff_s: float = Field(default=30.0, gt=0, description="longest wait before a restart")
        log_file: pathlib.Path | None = Field(
            default=None,
            description="the process's output (appended); unset: kept in a temporary file whose last lines are "
            "logged when the process dies",
        )
        tls_cert: pathlib.Path | None = Field(
            default=None,
            description="under tls.mode mtls (required there): the certificate the process shows, naming the role "
            "environment (not the orchestrator's); primerl up makes one",
        )
        tls_key: pathlib.Path | None = Field(default=None, description="the private key of tls_cert")

    options: Options
    # The options an evaluation of it may override (those its tasks carry to the process, e.g.
    # which dataset); the rest are the process's, the same for training and evaluation episodes.
    eval_options: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def command(self, *, name: str, orchestrator: str) -> list[str]:
        """The program playing environment `name` through the orchestrator at `orchestrator`."""


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
