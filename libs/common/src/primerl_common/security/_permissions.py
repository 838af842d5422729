"""Which roles may call which RPC, and the interceptor that enforces it.

Each service lists, for every method of its contract, the roles allowed to call it
(`method_roles`); methods every authenticated caller may call say `ANY`. Health checks,
reflection and GetServiceInfo are open to any authenticated caller (probes and peers need
them before anything else; they change nothing and tell only what the service is). A method
without an entry is refused to everyone. A method that admits the operator role is an admin
method: each call to one made as an operator is logged with its caller, as is every refusal.

In plaintext (loopback only: the local demo and tests) there are no identities: every caller
is `LOCAL`, and permissions are not enforced.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

import grpc

from primerl_common.errors import ServiceError
from primerl_common.grpc_handlers import wrap_method_handler
from primerl_common.security._identity import Caller, CallerResolver, PermissionDenied, _current

__all__ = [
    "ANY",
    "ENVIRONMENT",
    "INFERENCE",
    "KVSTORE",
    "OPEN_METHODS",
    "OPERATOR",
    "ORCHESTRATOR",
    "ROUTER",
    "TENANT",
    "TRAINER",
    "WEIGHT_BROADCASTER",
    "AuthorizationInterceptor",
    "check_owner",
    "method_roles",
]

logger = logging.getLogger(__name__)

# Roles: one per service (its certificate's), plus the people and programs around a run.
TRAINER = "trainer"
ORCHESTRATOR = "orchestrator"
INFERENCE = "inference"
ROUTER = "router"
WEIGHT_BROADCASTER = "weight_broadcaster"
KVSTORE = "kvstore"
OPERATOR = "operator"  # people and tools that run the deployment (the launcher, replica registration)
ENVIRONMENT = "environment"  # environments that call the orchestrator's environment API
TENANT = "tenant"  # users of the serving API (router Generate)

ANY = frozenset({"*"})  # any authenticated caller

OPEN_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.health.v1.Health/List",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)


def method_roles(descriptor: Any, roles: Mapping[str, Collection[str]]) -> dict[str, frozenset[str]]:
    """Full method name -> allowed roles for one gRPC service `descriptor`, from its method
    names -> roles (ANY for any authenticated caller). Every method but GetServiceInfo (open)
    must be named: a new RPC is never open by omission. Raises ValueError otherwise."""
    names = {method.name for method in descriptor.methods}
    unknown = set(roles) - names
    missing = names - set(roles) - {"GetServiceInfo"}
    if unknown or missing:
        raise ValueError(
            f"roles of {descriptor.full_name}: "
            + "; ".join(
                part
                for part in (
                    f"no such method(s) {sorted(unknown)}" if unknown else "",
                    f"no roles for {sorted(missing)}" if missing else "",
                )
                if part
            )
        )
    table = {f"/{descriptor.full_name}/{name}": frozenset(allowed) for name, allowed in roles.items()}
    table.setdefault(f"/{descriptor.full_name}/GetServiceInfo", ANY)
    return table


def check_owner(caller: Caller, owner: str, *, what: str, reason: str) -> None:
    """What a tenant owns (a run on the trainer, its adapter on the replicas) is for it alone:
    raises PermissionDenied (`reason`) unless `caller` is `owner`, an operator, or LOCAL (plaintext
    has no identities). An empty `owner`: owned by no one, open to any caller. `what` names the
    thing in the message ("run 'a1'")."""
    if not owner or caller.name == owner or "*" in caller.roles or OPERATOR in caller.roles:
        return
    raise PermissionDenied(
        f"{what} is not {caller.describe()}'s: only its owner or an operator may use it",
        reason=reason,
        metadata={"caller": caller.name},
    )


def _allows(allowed: frozenset[str], caller: Caller) -> bool:
    return allowed is ANY or "*" in allowed or "*" in caller.roles or not allowed.isdisjoint(caller.roles)


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Finds each call's caller (`CallerResolver`) and refuses the call before its handler
    reads a message: UNAUTHENTICATED without a valid identity, PERMISSION_DENIED naming the
    missing role(s) and the method. The caller is then what `caller_of` returns in the
    handler. Wraps per method (the decision depends on the method and the call's context)."""

    def __init__(
        self,
        resolver: CallerResolver,
        permissions: Mapping[str, frozenset[str]],
        *,
        service: str,
        self_authenticated: Collection[str] = (),
    ) -> None:
        self._resolver = resolver
        self._permissions = {**dict.fromkeys(OPEN_METHODS, ANY), **permissions}
        self._service = service
        self._enforced = resolver.mode != "plaintext"
        # Methods whose handler finds the caller itself (a sealed stream: by its session key).
        self._self_authenticated = frozenset(self_authenticated)

    def _admit(self, method: str, context: grpc.aio.ServicerContext) -> Caller:
        try:
            caller = self._resolver.resolve(context)
        except ServiceError as exc:
            logger.warning(
                "%s refused %s: %s (peer %s)",
                self._service,
                method,
                exc.message,
                context.peer(),
                extra={"method": method, "refusal": exc.reason},
            )
            raise
        self.check(method, caller)
        return caller

    def check(self, method: str, caller: Caller) -> None:
        """Raises PermissionDenied (logged) unless `caller` may call `method`; logs admin calls."""
        allowed = self._permissions.get(method, frozenset())
        if self._enforced and not _allows(allowed, caller):
            needed = " or ".join(sorted(allowed)) or "none (no role may call it)"
            logger.warning(
                "%s refused %s to %s: needs role %s",
                self._service,
                method,
                caller.describe(),
                needed,
                extra={"method": method, "caller": caller.name, "refusal": "MISSING_ROLE"},
            )
            raise PermissionDenied(
                f"{method} needs role {needed}; {caller.describe()} has none of them",
                reason="MISSING_ROLE",
                metadata={"method": method, "caller": caller.name, "roles": ",".join(sorted(allowed))},
            )
        if self._enforced and "operator" in allowed and allowed.isdisjoint(caller.roles - {"operator"}):
            # Called as an operator (a service calling a method its own role allows, such as the
            # orchestrator polling GetBatchSpec, is routine and not logged per call).
            logger.info(
                "%s admin call %s by %s",
                self._service,
                method,
                caller.describe(),
                extra={"method": method, "caller": caller.name},
            )

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method in self._self_authenticated:
            return handler
        method = details.method

        def coroutine(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def admitted(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    caller = self._admit(method, context)
                except ServiceError as exc:
                    await context.abort_with_status(exc.to_status())
                token = _current.set(caller)
                try:
                    return await behavior(request, context)
                finally:
                    _current.reset(token)

            return admitted

        def async_generator(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def admitted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    caller = self._admit(method, context)
                except ServiceError as exc:
                    await context.abort_with_status(exc.to_status())
                _current.set(caller)  # an async generator's frames run in the call's own task
                async for response in behavior(request, context):
                    yield response

            return admitted

        return wrap_method_handler(handler, coroutine=coroutine, async_generator=async_generator)
