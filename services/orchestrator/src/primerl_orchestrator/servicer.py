"""primerl.orchestrator.v1.OrchestratorService: proto <-> domain translation only."""

import grpc

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.server import ServiceDefinition


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """RPCs not overridden here answer UNIMPLEMENTED."""

    def __init__(self, definition: ServiceDefinition) -> None:
        self._definition = definition

    async def GetServiceInfo(
        self, request: orchestrator_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GetServiceInfoResponse:
        return orchestrator_pb2.GetServiceInfoResponse(info=self._definition.info())
