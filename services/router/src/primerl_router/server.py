"""Builds the router's ServiceDefinition from its config."""

from __future__ import annotations

import grpc

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common import security
from primerl_common.images import ROUTER_CAPABILITY_IMAGES
from primerl_common.server import ServiceDefinition
from primerl_router import __version__
from primerl_router.config import RouterConfig
from primerl_router.fleet import Fleet
from primerl_router.forwarding import Forwarder
from primerl_router.servicer import RouterServicer

__all__ = ["ROLES", "build"]

_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"]
# Who may call what (primerl_common.security): the orchestrator (and serving tenants)
# generate; operators register, drain and reset replicas; anyone authenticated lists them.
ROLES = {
    "Generate": {security.ORCHESTRATOR, security.TENANT},
    "RegisterReplica": {security.OPERATOR},
    "DeregisterReplica": {security.OPERATOR},
    "ListReplicas": security.ANY,
    "DrainReplica": {security.OPERATOR},
    "UndrainReplica": {security.OPERATOR},
    "ResetPrefixCache": {security.OPERATOR},
}
# The hot path: a span and server metrics per call cost several times the routing's own
# CPU; the per-replica metrics count it, and the caller's trace context goes through.
_GENERATE = f"/{_SERVICE.full_name}/Generate"


def _add_router_service(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
    # Generate again, with no (de)serializers: bytes in, bytes out. A later
    # registration of a method replaces the earlier one.
    server.add_registered_method_handlers(
        _SERVICE.full_name, {"Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate)}
    )


async def build(config: RouterConfig) -> ServiceDefinition:
    fleet = Fleet(config)
    definition = ServiceDefinition(
        name="router",
        version=__version__,
        servicers=[],
        # generate.images: requests with images go only to replicas that list CAPABILITY_IMAGES.
        capabilities=[f"router.policy.{config.policy.name}", "router.generate.passthrough", ROUTER_CAPABILITY_IMAGES],
        attributes={"policy": config.policy.name},
        on_start=[fleet.start],
        on_stop=[fleet.stop],
        unobserved_methods=[_GENERATE],
    )
    servicer = RouterServicer(definition, fleet, Forwarder(fleet, config.routing), config.routing)
    definition.servicers = [(_add_router_service, servicer, _SERVICE)]
    definition.permissions = security.method_roles(_SERVICE, ROLES)
    return definition
