"""Builds the weight broadcaster's ServiceDefinition from its config."""

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_weight_broadcaster import __version__
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.replicas import PushSettings, ReplicaSet
from primerl_weight_broadcaster.servicer import CAPABILITIES, WeightBroadcasterServicer
from primerl_weight_broadcaster.store import WeightStore


async def build(config: WeightBroadcasterConfig) -> ServiceDefinition:
    store = WeightStore()
    replicas = ReplicaSet(store, PushSettings(**config.push.model_dump()))
    definition = ServiceDefinition(
        name="weight_broadcaster",
        version=__version__,
        servicers=[],
        capabilities=CAPABILITIES,
        on_stop=[replicas.close],
    )
    servicer = WeightBroadcasterServicer(definition, store, replicas)
    descriptor = weight_broadcaster_pb2.DESCRIPTOR.services_by_name["WeightBroadcasterService"]
    definition.servicers = [
        (weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, servicer, descriptor)
    ]
    return definition
