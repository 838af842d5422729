"""sort_letters: the model sorts a few random letters alphabetically; exact answers only
(reward 1 or 0)."""

from __future__ import annotations

import string

from pydantic import Field, model_validator

from primerl_orchestrator.environments.base import SingleTurnEnvironment, Task

__all__ = ["SortLetters"]


class SortLetters(SingleTurnEnvironment):
    kind = "sort_letters"

    class Options(SingleTurnEnvironment.Options):
        min_letters: int = Field(default=3, ge=1)
        max_letters: int = Field(default=8, ge=1)

        @model_validator(mode="after")
        def _counts(self) -> SortLetters.Options:
            if self.min_letters > self.max_letters:
                raise ValueError(f"min_letters {self.min_letters} > max_letters {self.max_letters}")
            return self

    options: Options

    def task(self, index: int) -> Task:
        rng = self.rng(index)
        count = rng.randint(self.options.min_letters, self.options.max_letters)
        letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(count))
        return Task(task_id=f"{self.kind}-{index}", data={"letters": letters, "answer": "".join(sorted(letters))})

    def prompt(self, task: Task) -> list[tuple[str, str]]:
        return [
            ("system", "Sort the letters the user sends alphabetically. Answer with the sorted letters only."),
            ("user", task.data["letters"]),
        ]

    def score(self, task: Task, answer: str) -> float:
        return float(answer.strip() == task.data["answer"])

    def reference_answer(self, task: Task) -> str:
        return task.data["answer"]
