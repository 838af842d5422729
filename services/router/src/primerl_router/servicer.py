"""primerl.router.v1.RouterService: proto <-> domain translation only.

Generate is registered with no (de)serializers (see server.py): it receives
the request's bytes and streams the replica's response bytes back.
"""

from __future__ import annotations

import grpc
from google.protobuf import timestamp_pb2

from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.admission import ConcurrencyLimit, caller_key
from primerl_common.errors import InvalidArgument
from primerl_common.server import ServiceDefinition
from primerl_router.circuit import CircuitState
from primerl_router.config import RoutingConfig
from primerl_router.fleet import Fleet
from primerl_router.forwarding import Forwarder
from primerl_router.replica import ROLE_BOTH, Health, Replica

__all__ = ["RouterServicer", "replica_info"]

_HEALTH = {
    Health.UNKNOWN: router_pb2.REPLICA_HEALTH_UNSPECIFIED,
    Health.HEALTHY: router_pb2.REPLICA_HEALTH_HEALTHY,
    Health.DEGRADED: router_pb2.REPLICA_HEALTH_DEGRADED,
    Health.UNHEALTHY: router_pb2.REPLICA_HEALTH_UNHEALTHY,
}
_CIRCUIT = {
    CircuitState.CLOSED: router_pb2.CIRCUIT_STATE_CLOSED,
    CircuitState.OPEN: router_pb2.CIRCUIT_STATE_OPEN,
    CircuitState.HALF_OPEN: router_pb2.CIRCUIT_STATE_HALF_OPEN,
}
# Each replica's ResetPrefixCache call; the engine answers at once.
_RESET_TIMEOUT_S = 10.0


def replica_info(replica: Replica) -> router_pb2.ReplicaInfo:
    info = router_pb2.ReplicaInfo(
        replica_id=replica.replica_id,
        address=replica.address,
        role=replica.role,
        health=_HEALTH[replica.health.state],
        circuit=_CIRCUIT[replica.circuit.state],
        draining=replica.draining,
        num_in_flight=replica.num_in_flight,
        num_requests_total=replica.num_requests_total,
        num_errors_total=replica.num_errors_total,
        labels=replica.labels,
    )
    if replica.load is not None:
        info.load.CopyFrom(replica.load)
    # The broadcaster may know the version and update state before the replica's report does.
    info.load.policy_version = replica.policy_version
    info.load.updating_weights = replica.updating
    info.load.adapter_versions.clear()
    info.load.adapter_versions.update({name.decode(): v for name, v in replica.adapter_versions.items()})
    if replica.last_seen:
        info.last_seen.CopyFrom(_timestamp(replica.last_seen))
    return info


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self, definition: ServiceDefinition, fleet: Fleet, forwarder: Forwarder, routing: RoutingConfig | None = None
    ) -> None:
        self._definition = definition
        self._fleet = fleet
        self._forwarder = forwarder
        routing = routing or RoutingConfig()
        # Counted here, once per client call: a disaggregated request's halves go through the forwarder again.
        self._generate_limit = ConcurrencyLimit(
            what="Generate calls",
            limit=routing.max_concurrent_generate,
            per_caller_limit=routing.max_concurrent_generate_per_caller,
            config_field="routing.max_concurrent_generate",
            per_caller_config_field="routing.max_concurrent_generate_per_caller",
        )

    async def GetServiceInfo(
        self, request: router_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetServiceInfoResponse:
        return router_pb2.GetServiceInfoResponse(info=self._definition.info())

    async def Generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        with self._generate_limit.hold(caller_key(context)):
            await self._forwarder.generate(request, context)

    async def RegisterReplica(
        self, request: router_pb2.RegisterReplicaRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterReplicaResponse:
        if not request.replica_id:
            raise InvalidArgument("must not be empty", field="replica_id")
        if not request.address:
            raise InvalidArgument("must be host:port", field="address")
        replica = await self._fleet.register(
            request.replica_id, request.address, role=request.role or ROLE_BOTH, labels=dict(request.labels)
        )
        return router_pb2.RegisterReplicaResponse(replica=replica_info(replica))

    async def DeregisterReplica(
        self, request: router_pb2.DeregisterReplicaRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterReplicaResponse:
        self._fleet.deregister(request.replica_id)
        return router_pb2.DeregisterReplicaResponse()

    async def ListReplicas(
        self, request: router_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListReplicasResponse:
        return router_pb2.ListReplicasResponse(replicas=[replica_info(replica) for replica in self._fleet.pool])

    async def DrainReplica(
        self, request: router_pb2.DrainReplicaRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DrainReplicaResponse:
        replica = await self._fleet.drain(request.replica_id, wait=request.wait)
        return router_pb2.DrainReplicaResponse(replica=replica_info(replica))

    async def UndrainReplica(
        self, request: router_pb2.UndrainReplicaRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.UndrainReplicaResponse:
        return router_pb2.UndrainReplicaResponse(replica=replica_info(self._fleet.undrain(request.replica_id)))

    async def ResetPrefixCache(
        self, request: router_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ResetPrefixCacheResponse:
        reset, failed = await self._fleet.reset_prefix_cache(_RESET_TIMEOUT_S)
        return router_pb2.ResetPrefixCacheResponse(reset_replica_ids=reset, failed_replica_ids=failed)
