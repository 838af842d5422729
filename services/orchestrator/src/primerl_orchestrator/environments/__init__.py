"""Environments by kind. Every module of this package (but `base`, `runtime` and `task_file`) that
defines a BuiltinEnvironment subclass with a `kind` is a built-in environment: adding one
is adding its module. `external` names an environment played by a program through the
orchestrator's API."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from primerl_orchestrator.environments.base import BuiltinEnvironment, Outcome, Task, TurnOutcome

__all__ = [
    "EXTERNAL",
    "BuiltinEnvironment",
    "Outcome",
    "Task",
    "TurnOutcome",
    "environment_class",
    "environment_kinds",
]

EXTERNAL = "external"
_NOT_ENVIRONMENTS = {"base", "runtime", "task_file"}


@functools.cache
def _registry() -> dict[str, type[BuiltinEnvironment]]:
    environments: dict[str, type[BuiltinEnvironment]] = {}
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name in _NOT_ENVIRONMENTS:
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BuiltinEnvironment)
                and value.__module__ == module.__name__
                and hasattr(value, "kind")
            ):
                if value.kind in environments or value.kind == EXTERNAL:
                    raise RuntimeError(f"two environments are of kind {value.kind!r}")
                environments[value.kind] = value
    return environments


def environment_kinds() -> list[str]:
    return sorted(_registry())


def environment_class(kind: str) -> type[BuiltinEnvironment]:
    """The built-in environment of `kind`; ValueError naming the known kinds otherwise."""
    try:
        return _registry()[kind]
    except KeyError:
        known = ", ".join([EXTERNAL, *environment_kinds()])
        raise ValueError(f"unknown environment kind {kind!r}; known: {known}") from None
