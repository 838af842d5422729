"""primerl.kvstore.v1.KvStoreService: proto <-> domain translation only."""

import grpc

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.server import ServiceDefinition


class KvstoreServicer(kvstore_pb2_grpc.KvStoreServiceServicer):
    """RPCs not overridden here answer UNIMPLEMENTED."""

    def __init__(self, definition: ServiceDefinition) -> None:
        self._definition = definition

    async def GetServiceInfo(
        self, request: kvstore_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetServiceInfoResponse:
        return kvstore_pb2.GetServiceInfoResponse(info=self._definition.info())
