"""primerl.router.v1.RouterService: proto <-> domain translation only."""

import grpc

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.server import ServiceDefinition


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """RPCs not overridden here answer UNIMPLEMENTED."""

    def __init__(self, definition: ServiceDefinition) -> None:
        self._definition = definition

    async def GetServiceInfo(
        self, request: router_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetServiceInfoResponse:
        return router_pb2.GetServiceInfoResponse(info=self._definition.info())
