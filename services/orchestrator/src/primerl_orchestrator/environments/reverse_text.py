"""reverse_text: the model reverses a short random string; the reward is the longest-common-
subsequence ratio of its answer and the reversed string (partial credit for near misses)."""

from __future__ import annotations

import string

from pydantic import Field, model_validator

from primerl_orchestrator.environments.base import SingleTurnEnvironment, Task

__all__ = ["ReverseText", "lcs_ratio"]


class ReverseText(SingleTurnEnvironment):
    kind = "reverse_text"

    class Options(SingleTurnEnvironment.Options):
        min_length: int = Field(default=4, ge=1)
        max_length: int = Field(default=12, ge=1)
        alphabet: str = Field(default=string.ascii_lowercase, min_length=2)
        system_prompt: str = Field(
            default="Reverse the text the user sends, character by character. Answer with the reversed text only.",
            min_length=1,
            description="the instruction the model sees (a short one costs a tiny model fewer tokens)",
        )

        @model_validator(mode="after")
        def _lengths(self) -> ReverseText.Options:
            if self.min_length > self.max_length:
                raise ValueError(f"min_length {self.min_length} > max_length {self.max_length}")
            return self

    options: Options

    def task(self, index: int) -> Task:
        rng = self.rng(index)
        length = rng.randint(self.options.min_length, self.options.max_length)
        text = "".join(rng.choice(self.options.alphabet) for _ in range(length))
        return Task(task_id=f"{self.kind}-{index}", data={"text": text})

    def prompt(self, task: Task) -> list[tuple[str, str]]:
        return [
            ("system", self.options.system_prompt),
            ("user", task.data["text"]),
        ]

    def score(self, task: Task, answer: str) -> float:
        return lcs_ratio(answer.strip(), task.data["text"][::-1])

    def reference_answer(self, task: Task) -> str:
        return task.data["text"][::-1]


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)): 1 for equal strings, 0 when nothing is shared."""
    if not a and not b:
        return 1.0
    previous = [0] * (len(b) + 1)
    for char in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if char == other else max(previous[j + 1], current[j]))
        previous = current
    return 2 * previous[-1] / (len(a) + len(b))
