"""One configured environment at run time: its built-in player or its process environment (if
any), its task stream and its data position (the index of the next task)."""

from __future__ import annotations

from primerl_orchestrator.config import EnvironmentConfig
from primerl_orchestrator.environments import (
    BuiltinEnvironment,
    Environment,
    ProcessEnvironment,
    Task,
    environment_class,
)
from primerl_orchestrator.environments.task_file import TaskFile

__all__ = ["EnvironmentRuntime"]


class EnvironmentRuntime:
    def __init__(self, config: EnvironmentConfig, *, seed: int) -> None:
        self.config = config
        self.name = config.name
        # The orchestrator plays it (builtin), or runs the program that does (process).
        self.builtin: BuiltinEnvironment | None = None
        self.process: ProcessEnvironment | None = None
        self.tasks: Environment | TaskFile | None = None
        if config.builtin:
            cls = environment_class(config.kind)
            environment = cls(cls.Options.model_validate(config.options), seed=seed)
            if isinstance(environment, BuiltinEnvironment):
                self.builtin = environment
            else:
                assert isinstance(environment, ProcessEnvironment), f"{cls.__name__} is neither kind of environment"
                self.process = environment
            self.tasks = environment
        elif config.tasks_file is not None:
            self.tasks = TaskFile(config.tasks_file)
        self.next_task_index = 0

    def next_task(self) -> Task:
        assert self.tasks is not None
        task = self.tasks.task(self.next_task_index)
        self.next_task_index += 1
        return task
