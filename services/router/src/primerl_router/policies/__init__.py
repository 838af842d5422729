"""Routing policies by name. Every module of this package (but `base`) that
defines a RoutingPolicy subclass with a `name` is a policy: adding one is
adding its module."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from primerl_router.policies.base import RoutingPolicy

__all__ = ["RoutingPolicy", "make_policy", "policy_class", "policy_names"]


@functools.cache
def _registry() -> dict[str, type[RoutingPolicy]]:
    policies: dict[str, type[RoutingPolicy]] = {}
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, RoutingPolicy) and value.__module__ == module.__name__:
                if value.name in policies:
                    raise RuntimeError(f"two routing policies are named {value.name!r}")
                policies[value.name] = value
    return policies


def policy_names() -> list[str]:
    return sorted(_registry())


def policy_class(name: str) -> type[RoutingPolicy]:
    """The policy registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return _registry()[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}") from None


def make_policy(name: str, options: dict[str, Any]) -> RoutingPolicy:
    cls = policy_class(name)
    return cls(cls.Options.model_validate(options))
