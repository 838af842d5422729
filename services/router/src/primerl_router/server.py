"""Builds the router's ServiceDefinition from its config."""

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_router import __version__
from primerl_router.config import RouterConfig
from primerl_router.servicer import RouterServicer


async def build(config: RouterConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="router", version=__version__, servicers=[])
    servicer = RouterServicer(definition)
    descriptor = router_pb2.DESCRIPTOR.services_by_name["RouterService"]
    definition.servicers = [(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, descriptor)]
    return definition
