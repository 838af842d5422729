"""Environments by kind. Every module of this package (but `base`, `processes`, `runtime` and
`task_file`; subpackages are helpers of a kind, never kinds) that defines an Environment
subclass with a `kind` is an environment kind: adding one is adding its module. Built-in ones
are played by the orchestrator, process ones by a program of their own that it runs.
`external` names an environment played by a program through the orchestrator's API that the
user runs."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from primerl_orchestrator.environments.base import (
    BuiltinEnvironment,
    Environment,
    Outcome,
    ProcessEnvironment,
    Task,
    TurnOutcome,
)

__all__ = [
    "EXTERNAL",
    "BuiltinEnvironment",
    "Environment",
    "Outcome",
    "ProcessEnvironment",
    "Task",
    "TurnOutcome",
    "environment_class",
    "environment_kinds",
]

EXTERNAL = "external"
_NOT_ENVIRONMENTS = {"base", "processes", "runtime", "task_file"}


@functools.cache
def _registry() -> dict[str, type[Environment]]:
    environments: dict[str, type[Environment]] = {}
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.ispkg or module_info.name in _NOT_ENVIRONMENTS:
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, Environment)
                and value.__module__ == module.__name__
                and hasattr(value, "kind")
            ):
                if value.kind in environments or value.kind == EXTERNAL:
                    raise RuntimeError(f"two environments are of kind {value.kind!r}")
                environments[value.kind] = value
    return environments


def environment_kinds() -> list[str]:
    return sorted(_registry())


def environment_class(kind: str) -> type[Environment]:
    """The environment class of `kind`; ValueError naming the known kinds otherwise."""
    try:
        return _registry()[kind]
    except KeyError:
        known = ", ".join([EXTERNAL, *environment_kinds()])
        raise ValueError(f"unknown environment kind {kind!r}; known: {known}") from None
