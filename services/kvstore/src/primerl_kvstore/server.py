"""Builds the kvstore's ServiceDefinition from its config."""

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_kvstore import __version__
from primerl_kvstore.config import KvstoreConfig
from primerl_kvstore.servicer import KvstoreServicer


async def build(config: KvstoreConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="kvstore", version=__version__, servicers=[])
    servicer = KvstoreServicer(definition)
    descriptor = kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"]
    definition.servicers = [(kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server, servicer, descriptor)]
    return definition
