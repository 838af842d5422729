"""Builds the weight broadcaster's ServiceDefinition from its config."""

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_weight_broadcaster import __version__
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.replicas import PushSettings, Replica, ReplicaSet
from primerl_weight_broadcaster.servicer import CAPABILITIES, WeightBroadcasterServicer
from primerl_weight_broadcaster.store import WeightStore


async def build(config: WeightBroadcasterConfig) -> ServiceDefinition:
    store = WeightStore()
    replicas = ReplicaSet(store, PushSettings(**config.push.model_dump()))

    async def register_configured() -> None:
        for replica in config.replicas:
            await replicas.register(Replica(replica.replica_id, replica.address, delta=replica.delta))

    definition = ServiceDefinition(
        name="weight_broadcaster",
        version=__version__,
        servicers=[],
        capabilities=CAPABILITIES,
        on_start=[register_configured],
        on_stop=[replicas.close],
    )
    servicer = WeightBroadcasterServicer(definition, store, replicas)
    definition.on_drain = [servicer.drain]
    descriptor = weight_broadcaster_pb2.DESCRIPTOR.services_by_name["WeightBroadcasterService"]
    definition.servicers = [
        (weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, servicer, descriptor)
    ]
    return definition
