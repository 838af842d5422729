"""The contract of a routing policy.

The pool filters the registered replicas down to the candidates that may take
a request (role, health, circuit, drain, policy version, update state) and
asks the policy to choose one of them; the policy never sees a replica it must
not use. A policy keeps whatever state it needs through the hooks below, all
called on the event loop, so it needs no locks.

Adding a policy is one module in this package: a RoutingPolicy subclass with a
`name` (and, when it has settings, an `Options` section, set under
`[policy.options]` in the router's config). The registry finds it by that name.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from primerl_common.config import Section

if TYPE_CHECKING:
    from primerl_router.replica import Replica
    from primerl_router.request import RouteRequest

__all__ = ["RoutingPolicy"]


class RoutingPolicy(abc.ABC):
    name: ClassVar[str]

    class Options(Section):
        """No settings."""

    def __init__(self, options: Options) -> None:
        self.options = options

    @abc.abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        """One of `candidates` (never empty) for `request`. Called once per
        attempt: a retry chooses again among the replicas not tried yet."""

    def on_routed(self, request: RouteRequest, replica: Replica) -> None:  # noqa: B027 (optional hook)
        """`replica` took `request`."""

    def on_membership_change(self, replicas: Sequence[Replica]) -> None:  # noqa: B027 (optional hook)
        """A replica joined or left; `replicas` are all registered ones,
        eligible or not."""

    def on_prefix_cache_reset(self, replica: Replica) -> None:  # noqa: B027 (optional hook)
        """`replica` dropped its prefix cache."""
