"""The router's RPCs through a real in-process server and the real stub.
Replicas here are addresses where nothing listens (what a crashed replica
looks like); tests/test_with_inference.py runs real inference replicas."""

import grpc
import prometheus_client
import pytest

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.errors import error_details
from primerl_common.processes import free_port
from primerl_common.testing import in_process_service
from primerl_router.config import RouterConfig
from primerl_router.server import build


@pytest.fixture
async def router():
    dead = f"127.0.0.1:{free_port()}"
    config = RouterConfig(
        server={"host": "127.0.0.1", "port": 0},
        replicas=[{"replica_id": "dead-0", "address": dead}],
        routing={"no_replica_wait_s": 0.2},
        health={"interval_s": 0.1, "timeout_s": 0.2, "unhealthy_threshold": 50},
        circuit_breaker={"failure_threshold": 2, "open_s": 60},
    )
    async with in_process_service(await build(config), config, max_attempts=1) as served:
        yield router_pb2_grpc.RouterServiceStub(served.channel), served.channel, dead


def generate_request(**fields) -> router_pb2.GenerateRequest:
    generation = generation_pb2.GenerationInput(prompt_token_ids=[1, 2, 3], **fields)
    return router_pb2.GenerateRequest(input=generation, routing=router_pb2.RoutingHints(session_key="episode-1"))


async def generate_error(stub, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in stub.Generate(request, timeout=10):
            pass
    return error.value


async def test_register_list_drain_undrain_deregister(router):
    stub, _, dead = router
    reply = await stub.RegisterReplica(
        router_pb2.RegisterReplicaRequest(replica_id="dead-1", address=dead, labels={"zone": "b"})
    )
    assert reply.replica.replica_id == "dead-1" and reply.replica.labels["zone"] == "b"
    assert reply.replica.health == router_pb2.REPLICA_HEALTH_DEGRADED  # its first check failed
    assert reply.replica.role == generation_pb2.REPLICA_ROLE_BOTH

    replicas = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
    assert [r.replica_id for r in replicas] == ["dead-0", "dead-1"]
    assert replicas[0].circuit == router_pb2.CIRCUIT_STATE_CLOSED and replicas[0].load.policy_version == -1

    drained = await stub.DrainReplica(router_pb2.DrainReplicaRequest(replica_id="dead-1", wait=True))
    assert drained.replica.draining
    undrained = await stub.UndrainReplica(router_pb2.UndrainReplicaRequest(replica_id="dead-1"))
    assert not undrained.replica.draining

    await stub.DeregisterReplica(router_pb2.DeregisterReplicaRequest(replica_id="dead-1"))
    replicas = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
    assert [r.replica_id for r in replicas] == ["dead-0"]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.DrainReplica(router_pb2.DrainReplicaRequest(replica_id="dead-1"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica_id="x"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_failures_reach_the_client_and_open_the_circuit(router):
    stub, _, _ = router
    # The replica's own error (connection refused) goes to the client as it is.
    error = await generate_error(stub, generate_request())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    await generate_error(stub, generate_request())
    replica = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas[0]
    assert replica.circuit == router_pb2.CIRCUIT_STATE_OPEN
    assert replica.num_requests_total == 2 and replica.num_errors_total == 2 and replica.num_in_flight == 0

    # Open circuit: the router refuses by itself, saying why.
    error = await generate_error(stub, generate_request())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "dead-0: circuit open" in error.details()
    assert error_details(error)[0].reason == "NO_REPLICA"

    metrics = prometheus_client.generate_latest().decode()
    assert 'primerl_router_replica_errors_total{code="UNAVAILABLE",replica="dead-0"} 2.0' in metrics
    assert 'primerl_router_replica_circuit_open{replica="dead-0"} 1.0' in metrics
    assert 'primerl_router_replica_in_flight{replica="dead-0"} 0.0' in metrics


async def test_version_and_malformed_requests(router):
    stub, channel, _ = router
    error = await generate_error(stub, generate_request(min_policy_version=3))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(error)[0].reason == "POLICY_VERSION_NOT_SERVED"

    raw = channel.unary_stream("/primerl.router.v1.RouterService/Generate")  # bytes in, no serializer
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in raw(b"\x0a\x09\x12"):
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_reset_prefix_cache_reports_who_failed(router):
    stub, _, _ = router
    reply = await stub.ResetPrefixCache(router_pb2.ResetPrefixCacheRequest())
    assert list(reply.failed_replica_ids) == ["dead-0"] and not reply.reset_replica_ids
