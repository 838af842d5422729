"""Builds the orchestrator's ServiceDefinition from its config."""

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_orchestrator import __version__
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.servicer import OrchestratorServicer


async def build(config: OrchestratorConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="orchestrator", version=__version__, servicers=[])
    servicer = OrchestratorServicer(definition)
    descriptor = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"]
    definition.servicers = [(orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server, servicer, descriptor)]
    return definition
