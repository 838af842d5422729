"""primerl.inference.v1.InferenceService: proto <-> domain translation only."""

import grpc

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.server import ServiceDefinition


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """RPCs not overridden here answer UNIMPLEMENTED."""

    def __init__(self, definition: ServiceDefinition) -> None:
        self._definition = definition

    async def GetServiceInfo(
        self, request: inference_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetServiceInfoResponse:
        return inference_pb2.GetServiceInfoResponse(info=self._definition.info())
