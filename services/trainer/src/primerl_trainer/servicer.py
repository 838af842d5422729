"""primerl.trainer.v1.TrainerService: proto <-> domain translation only."""

import grpc

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.server import ServiceDefinition


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """RPCs not overridden here answer UNIMPLEMENTED."""

    def __init__(self, definition: ServiceDefinition) -> None:
        self._definition = definition

    async def GetServiceInfo(
        self, request: trainer_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetServiceInfoResponse:
        return trainer_pb2.GetServiceInfoResponse(info=self._definition.info())
