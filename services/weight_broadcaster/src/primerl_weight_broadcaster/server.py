"""Builds the weight broadcaster's ServiceDefinition from its config."""

import asyncio
import logging

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common import security
from primerl_common.server import ServiceDefinition
from primerl_common.weights.shared_memory import ATTRIBUTE_BOOT_ID, boot_id
from primerl_weight_broadcaster import __version__
from primerl_weight_broadcaster.adapters import AdapterStore
from primerl_weight_broadcaster.collective import CollectiveHost, CollectiveSettings
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.replica_set import ReplicaSet
from primerl_weight_broadcaster.replicas import PushSettings, Replica
from primerl_weight_broadcaster.servicer import (
    CAPABILITIES,
    CAPABILITY_NCCL,
    CAPABILITY_SHARED_FS,
    CAPABILITY_SHM,
    WeightBroadcasterServicer,
)
from primerl_weight_broadcaster.shared_fs import SharedFolders
from primerl_weight_broadcaster.shm import SharedMemory
from primerl_weight_broadcaster.spill import SpillFolder
from primerl_weight_broadcaster.store import WeightStore

# Who may call what (primerl_common.security): only the trainer publishes; operators
# register replicas; both remove adapters (a deleted run's); anyone authenticated reads
# versions and replica states.
ROLES = {
    "PublishWeights": {security.TRAINER},
    "PublishCollective": {security.TRAINER},
    "RegisterReplica": {security.OPERATOR},
    "DeregisterReplica": {security.OPERATOR},
    "GetStatus": security.ANY,
    "WaitForVersion": security.ANY,
    "WatchReplicas": security.ANY,
    "RemoveAdapter": {security.TRAINER, security.OPERATOR},
}

logger = logging.getLogger(__name__)


async def build(config: WeightBroadcasterConfig) -> ServiceDefinition:
    spill = None if config.store.spill_folder is None else SpillFolder(config.store.spill_folder)
    # Reads the newest spilled version, if any (checksums included): off the event loop.
    store = await asyncio.to_thread(WeightStore, spill)
    # Each adapter's latest version, beside the spilled versions (spill.py leaves the folder alone).
    adapter_folder = None if spill is None else spill.root / "adapters"
    adapters = await asyncio.to_thread(AdapterStore, adapter_folder)
    folder = config.shared_fs.folder
    shared = None if folder is None else SharedFolders(folder, keep_versions=config.shared_fs.keep_versions)
    collective = None
    if config.collective.backend is not None:
        collective = CollectiveHost(CollectiveSettings(**config.collective.model_dump()))
    shm = None
    if config.shm.folder is not None:
        try:
            shm = SharedMemory(config.shm.folder, keep_versions=config.shm.keep_versions)
        except OSError as exc:  # a read-only or full tmpfs: replicas get gRPC
            logger.warning("no same-host transport: cannot make a folder in %s (%s)", config.shm.folder, exc)
    replicas = ReplicaSet(store, PushSettings(**config.push.model_dump()), shared, collective, shm, adapters)

    async def register_configured() -> None:
        for replica in config.replicas:
            await replicas.register(
                Replica(
                    replica.replica_id,
                    replica.address,
                    delta=replica.delta,
                    format=tensor_pb2.WeightFormat.Value(f"WEIGHT_FORMAT_{replica.format.upper()}"),
                    transport=weight_broadcaster_pb2.Transport.Value(f"TRANSPORT_{replica.transport.upper()}"),
                )
            )

    async def close_shm() -> None:
        assert shm is not None
        await shm.pruned()
        await asyncio.to_thread(shm.close)

    async def prune_shared_folder() -> None:  # leftovers of an earlier process
        if shared is not None:
            await asyncio.to_thread(shared.prune)

    definition = ServiceDefinition(
        name="weight_broadcaster",
        version=__version__,
        servicers=[],
        capabilities=(
            *CAPABILITIES,
            *([CAPABILITY_SHARED_FS] if shared else []),
            *([CAPABILITY_NCCL] if collective else []),
            *([CAPABILITY_SHM] if shm else []),
        ),
        attributes={ATTRIBUTE_BOOT_ID: boot_id(), **({"shm.folder": str(shm.root)} if shm else {})},
        on_start=[prune_shared_folder, register_configured],
        on_stop=[replicas.close, *([close_shm] if shm else [])],
        # The trainer's publishes, sealed on server.sealed_port where it is set.
        sealed_methods=["/primerl.weight_broadcaster.v1.WeightBroadcasterService/PublishWeights"],
    )
    servicer = WeightBroadcasterServicer(definition, store, replicas, config.publish)
    definition.on_drain = [servicer.drain]
    descriptor = weight_broadcaster_pb2.DESCRIPTOR.services_by_name["WeightBroadcasterService"]
    definition.servicers = [
        (weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, servicer, descriptor)
    ]
    definition.permissions = security.method_roles(descriptor, ROLES)
    return definition
