"""The weight broadcaster, the router and the kvstore served with mutual TLS in this process,
attacked on the loopback network (tests/security_attacks.py): for each RPC that changes state (or
hands out data), a peer without a certificate, one with a certificate of another CA, one whose
certificate names no identity, each valid certificate of a role the RPC does not admit, a
captured token replayed over another peer's connection and an unknown token are each refused
with the status that fits, and the service's state is as before. Then the caller the RPC is for
gets through. The roles expected here are written out per RPC (the security contract), not read
from the services' tables; tests/test_security_model_services.py does the same for the trainer,
the orchestrator and the inference service."""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch

from primerl.common.v1 import generation_pb2
from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.config import TlsConfig
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.kvpool.keys import BlockKey
from primerl_common.processes import free_port
from primerl_common.security import _credentials
from primerl_common.security.certificates import tls_of
from primerl_common.tensors import iter_tensor_chunks
from tests.security_attacks import (
    DENIED,
    HOLDERS,
    UNAUTHENTICATED,
    attack,
    client_stream,
    served,
    server_stream,
    service_tls,
    unary,
)

# --- weight broadcaster -------------------------------------------------------------------


def publish_messages(policy_version: int) -> list[wb_pb2.PublishWeightsRequest]:
    tensors = {"w": torch.ones(4)}
    begin = wb_pb2.PublishBegin(
        policy_version=policy_version, kind=wb_pb2.PUBLISH_KIND_FULL, num_tensors=1, num_bytes=16
    )
    return [
        wb_pb2.PublishWeightsRequest(begin=begin),
        *(wb_pb2.PublishWeightsRequest(chunk=chunk) for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=1024)),
    ]


async def test_weight_broadcaster(certs):
    from primerl_weight_broadcaster.config import WeightBroadcasterConfig
    from primerl_weight_broadcaster.server import build

    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0}, tls=service_tls(certs, "weight_broadcaster")
    )
    async with served(await build(config), config, certs) as target:
        stub = wb_pb2_grpc.WeightBroadcasterServiceStub(target.channel("operator"))
        before = await stub.GetStatus(wb_pb2.GetStatusRequest())
        register = wb_pb2.RegisterReplicaRequest(replica_id="evil", address=f"127.0.0.1:{free_port()}")
        collective = wb_pb2.PublishCollectiveRequest(begin=publish_messages(5)[0].begin)
        for rpc, allowed, invoke in [
            (
                "PublishWeights",
                {"trainer"},
                client_stream(
                    wb_pb2_grpc.WeightBroadcasterServiceStub, "PublishWeights", functools.partial(publish_messages, 5)
                ),
            ),
            (
                "PublishCollective",
                {"trainer"},
                unary(wb_pb2_grpc.WeightBroadcasterServiceStub, "PublishCollective", collective),
            ),
            (
                "RegisterReplica",
                {"operator"},
                unary(wb_pb2_grpc.WeightBroadcasterServiceStub, "RegisterReplica", register),
            ),
            (
                "DeregisterReplica",
                {"operator"},
                unary(
                    wb_pb2_grpc.WeightBroadcasterServiceStub,
                    "DeregisterReplica",
                    wb_pb2.DeregisterReplicaRequest(replica_id="evil"),
                ),
            ),
        ]:
            await attack(target, f"/primerl.weight_broadcaster.v1.WeightBroadcasterService/{rpc}", allowed, invoke)
        assert await stub.GetStatus(wb_pb2.GetStatusRequest()) == before
        # The trainer publishes; the operator registers.
        trainer = wb_pb2_grpc.WeightBroadcasterServiceStub(target.channel("trainer"))
        await client_stream(
            wb_pb2_grpc.WeightBroadcasterServiceStub, "PublishWeights", functools.partial(publish_messages, 1)
        )(target.channel("trainer"), [])
        await stub.RegisterReplica(register)
        status = await trainer.GetStatus(wb_pb2.GetStatusRequest())
        assert status.latest_policy_version == 1 and [r.replica_id for r in status.replicas] == ["evil"]


# --- router ---------------------------------------------------------------------------------


async def test_router(certs):
    from primerl_router.config import RouterConfig
    from primerl_router.server import build

    replica = f"127.0.0.1:{free_port()}"
    config = RouterConfig(
        server={"host": "127.0.0.1", "port": 0},
        tls=service_tls(certs, "router"),
        replicas=[{"replica_id": "r0", "address": replica}],
        routing={"no_replica_wait_s": 0.1},
    )
    async with served(await build(config), config, certs) as target:
        stub = router_pb2_grpc.RouterServiceStub(target.channel("operator"))

        async def replicas():
            listed = await stub.ListReplicas(router_pb2.ListReplicasRequest())
            return sorted((r.replica_id, r.address, r.draining) for r in listed.replicas)

        before = await replicas()
        generate = router_pb2.GenerateRequest(input=generation_pb2.GenerationInput(prompt_token_ids=[1, 2]))
        for rpc, allowed, invoke in [
            (
                "RegisterReplica",
                {"operator"},
                unary(
                    router_pb2_grpc.RouterServiceStub,
                    "RegisterReplica",
                    router_pb2.RegisterReplicaRequest(replica_id="evil", address=f"127.0.0.1:{free_port()}"),
                ),
            ),
            (
                "DeregisterReplica",
                {"operator"},
                unary(
                    router_pb2_grpc.RouterServiceStub,
                    "DeregisterReplica",
                    router_pb2.DeregisterReplicaRequest(replica_id="r0"),
                ),
            ),
            (
                "DrainReplica",
                {"operator"},
                unary(
                    router_pb2_grpc.RouterServiceStub, "DrainReplica", router_pb2.DrainReplicaRequest(replica_id="r0")
                ),
            ),
            (
                "UndrainReplica",
                {"operator"},
                unary(
                    router_pb2_grpc.RouterServiceStub,
                    "UndrainReplica",
                    router_pb2.UndrainReplicaRequest(replica_id="r0"),
                ),
            ),
            (
                "ResetPrefixCache",
                {"operator"},
                unary(router_pb2_grpc.RouterServiceStub, "ResetPrefixCache", router_pb2.ResetPrefixCacheRequest()),
            ),
            (
                "Generate",
                {"orchestrator", "tenant"},
                server_stream(router_pb2_grpc.RouterServiceStub, "Generate", generate),
            ),
        ]:
            await attack(target, f"/primerl.router.v1.RouterService/{rpc}", allowed, invoke)
        assert await replicas() == before
        await stub.DrainReplica(router_pb2.DrainReplicaRequest(replica_id="r0"))
        assert await replicas() == [("r0", replica, True)]


# --- kvstore --------------------------------------------------------------------------------


async def test_kvstore(certs, monkeypatch):
    from primerl_kvstore.config import KvstoreConfig
    from primerl_kvstore.server import build

    config = KvstoreConfig(
        server={"host": "127.0.0.1", "port": free_port(), "drain_delay_s": 0},
        tls=service_tls(certs, "kvstore"),
        node={"bulk_port": 0},
    )
    async with served(await build(config), config, certs) as target:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(target.channel("operator"))
        key = BlockKey("tiny", 0, "v1", b"\x01" * 16)
        # An inference replica's KV connector pools a block (it shows its process identity).
        monkeypatch.setattr(_credentials, "_process", tls_of(certs, HOLDERS["inference"]))
        async with KvStoreClient(target.address) as client:
            await client.put(target.address, [(key, b"\x07" * 64)])
        monkeypatch.setattr(_credentials, "_process", None)

        # A replica leases the block to read it: ReleaseLeases by an intruder would free it for
        # eviction under the reader (the lease count is part of the state that must not change).
        pool = kvstore_pb2_grpc.KvStoreServiceStub(target.channel(HOLDERS["inference"]))
        (leased,) = (
            await pool.LocateBlocks(kvstore_pb2.LocateBlocksRequest(keys=[key.to_proto()], lease_ms=60_000))
        ).locations
        assert leased.found and leased.lease_id

        async def stats():
            reply = await stub.GetStats(kvstore_pb2.GetStatsRequest())
            namespaces = sorted((ns.model, ns.namespace, ns.num_blocks) for ns in reply.namespaces)
            return namespaces, reply.num_leased_blocks

        before = await stats()
        assert before == ([("tiny", "v1", 1)], 1)
        node = kvstore_pb2.NodeInfo(node_id="evil", address=f"127.0.0.1:{free_port()}")
        forged = [
            kvstore_pb2.PutBlocksRequest(
                header=kvstore_pb2.BlockHeader(key=BlockKey("tiny", 0, "v1", b"\x02" * 16).to_proto(), num_bytes=4),
                data=b"evil",
            )
        ]
        Stub = kvstore_pb2_grpc.KvStoreServiceStub
        for rpc, allowed, invoke in [
            ("PutBlocks", {"inference"}, client_stream(Stub, "PutBlocks", lambda: forged)),
            (
                "GetBlocks",
                {"inference"},
                server_stream(Stub, "GetBlocks", kvstore_pb2.GetBlocksRequest(keys=[key.to_proto()])),
            ),
            (
                "RemoveBlocks",
                {"kvstore", "operator"},
                unary(Stub, "RemoveBlocks", kvstore_pb2.RemoveBlocksRequest(keys=[key.to_proto()])),
            ),
            (
                "RemoveNamespace",
                {"kvstore", "orchestrator", "operator"},
                unary(Stub, "RemoveNamespace", kvstore_pb2.RemoveNamespaceRequest(model="tiny", namespace="v1")),
            ),
            ("RegisterNode", {"kvstore"}, unary(Stub, "RegisterNode", kvstore_pb2.RegisterNodeRequest(node=node))),
            ("Heartbeat", {"kvstore"}, unary(Stub, "Heartbeat", kvstore_pb2.HeartbeatRequest(node=node))),
            ("UpdateBlocks", {"kvstore"}, unary(Stub, "UpdateBlocks", kvstore_pb2.UpdateBlocksRequest(node_id="evil"))),
            (
                "ClaimEviction",
                {"kvstore"},
                unary(Stub, "ClaimEviction", kvstore_pb2.ClaimEvictionRequest(node_id="evil")),
            ),
            (
                "LocateBlocks",
                {"inference", "kvstore"},
                unary(Stub, "LocateBlocks", kvstore_pb2.LocateBlocksRequest(keys=[key.to_proto()])),
            ),
            (
                "BatchExists",
                {"inference", "kvstore"},
                unary(Stub, "BatchExists", kvstore_pb2.BatchExistsRequest(keys=[key.to_proto()])),
            ),
            (
                "ReleaseLeases",
                {"inference", "kvstore"},
                unary(Stub, "ReleaseLeases", kvstore_pb2.ReleaseLeasesRequest(lease_ids=[leased.lease_id])),
            ),
        ]:
            await attack(target, f"/primerl.kvstore.v1.KvStoreService/{rpc}", allowed, invoke)
        assert await stats() == before
        # The callers these two are for get through.
        exists = await pool.BatchExists(kvstore_pb2.BatchExistsRequest(keys=[key.to_proto()]))
        assert list(exists.exists) == [True]
        released = await pool.ReleaseLeases(kvstore_pb2.ReleaseLeasesRequest(lease_ids=[leased.lease_id]))
        assert released.num_released == 1
        before = ([("tiny", "v1", 1)], 0)
        assert await stats() == before
        await attack_bulk_channel(
            certs, (await stub.GetStats(kvstore_pb2.GetStatsRequest())).nodes[0].bulk_address, key
        )
        assert await stats() == before
        await stub.RemoveNamespace(kvstore_pb2.RemoveNamespaceRequest(model="tiny", namespace="v1"))
        assert await stats() == ([], 0)


async def attack_bulk_channel(certs: pathlib.Path, bulk_address: str, key: BlockKey) -> None:
    """The kvstore's raw-TCP bulk channel: mutual TLS, inference replicas only."""
    import asyncio
    import ssl

    from primerl_common.kvpool.bulk import BulkClient, BulkError

    def get(tls: TlsConfig) -> list:
        client = BulkClient(bulk_address, tls=tls, timeout_s=10)
        try:
            return client.get([key])
        finally:
            client.close()

    evil = (kvstore_pb2.BlockHeader(key=BlockKey("tiny", 0, "v1", b"\x03" * 16).to_proto()), b"evil")
    for holder in ("router", "trainer", "operator", "kvstore"):
        with pytest.raises(BulkError) as refused:
            await asyncio.to_thread(get, tls_of(certs, holder))
        assert refused.value.code == DENIED and "inference" in refused.value.message
        with pytest.raises(BulkError):
            await asyncio.to_thread(lambda h=holder: BulkClient(bulk_address, tls=tls_of(certs, h)).put([evil]))
    with pytest.raises(BulkError) as refused:
        await asyncio.to_thread(get, tls_of(certs, "anonymous"))
    assert refused.value.code == UNAUTHENTICATED
    impostor = tls_of(certs / "other", HOLDERS["inference"]).model_copy(update={"ca": certs / "ca.pem"})
    for tls in (TlsConfig(mode="plaintext"), impostor):  # no certificate; another CA's
        with pytest.raises((ssl.SSLError, ConnectionError, OSError, BulkError)):
            await asyncio.to_thread(get, tls)
    ((header, data),) = await asyncio.to_thread(get, tls_of(certs, HOLDERS["inference"]))
    assert header.found and bytes(data) == b"\x07" * 64
