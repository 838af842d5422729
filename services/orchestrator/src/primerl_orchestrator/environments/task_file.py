"""The task stream of an external environment: a JSONL file of {"task_id", "data"}, handed
out in order and cycled, so that a resumed run continues at its data position."""

from __future__ import annotations

import json
import pathlib

from primerl_orchestrator.environments.base import Task

__all__ = ["TaskFile"]


class TaskFile:
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._tasks: list[Task] = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                task = Task(task_id=str(entry["task_id"]), data=dict(entry.get("data", {})))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a task ({exc!r})") from None
            self._tasks.append(task)
        if not self._tasks:
            raise ValueError(f"{path} holds no task")

    def task(self, index: int) -> Task:
        return self._tasks[index % len(self._tasks)]
