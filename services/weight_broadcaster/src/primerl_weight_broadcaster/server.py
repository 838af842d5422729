"""Builds the weight broadcaster's ServiceDefinition from its config."""

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_weight_broadcaster import __version__
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.servicer import WeightBroadcasterServicer


async def build(config: WeightBroadcasterConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="weight_broadcaster", version=__version__, servicers=[])
    servicer = WeightBroadcasterServicer(definition)
    descriptor = weight_broadcaster_pb2.DESCRIPTOR.services_by_name["WeightBroadcasterService"]
    definition.servicers = [
        (weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, servicer, descriptor)
    ]
    return definition
