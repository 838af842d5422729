"""primerl.weight_broadcaster.v1.WeightBroadcasterService: proto <-> domain translation only."""

import grpc

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.server import ServiceDefinition


class WeightBroadcasterServicer(weight_broadcaster_pb2_grpc.WeightBroadcasterServiceServicer):
    """RPCs not overridden here answer UNIMPLEMENTED."""

    def __init__(self, definition: ServiceDefinition) -> None:
        self._definition = definition

    async def GetServiceInfo(
        self, request: weight_broadcaster_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> weight_broadcaster_pb2.GetServiceInfoResponse:
        return weight_broadcaster_pb2.GetServiceInfoResponse(info=self._definition.info())
