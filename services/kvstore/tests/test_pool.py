"""A pool of separate roles over real gRPC: a metadata server and two storage nodes."""

import asyncio
import os

import grpc
import pytest

from primerl.common.v1 import tensor_pb2
from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import error_details

from .conftest import key, stats_of

MiB = 1024 * 1024


async def start_pool(pool, *, node_timeout_s=5.0, heartbeat_s=0.2, **node_fields):
    metadata = await pool.start(role="metadata", metadata={"node_timeout_s": node_timeout_s})
    nodes = []
    for name in ("node-a", "node-b"):
        address = await pool.start(
            role="storage",
            node={"node_id": name, "metadata_address": metadata, "heartbeat_interval_s": heartbeat_s},
            **node_fields,
        )
        nodes.append(address)
    return metadata, nodes


def routed_experts(num_tokens: int) -> tensor_pb2.Tensor:
    data = os.urandom(num_tokens * 4 * 2)
    header = tensor_pb2.TensorHeader(
        name="routed_experts", dtype=tensor_pb2.DTYPE_UINT8, shape=[num_tokens, 4, 2], num_bytes=len(data)
    )
    return tensor_pb2.Tensor(header=header, data=data)


async def test_put_through_one_node_read_back_bit_exactly_through_the_pool(pool):
    metadata, (node_a, node_b) = await start_pool(pool)
    client = pool.client(metadata, chunk_bytes=256 * 1024)
    # Sizes around the chunk size, one of several chunks, and a routed-experts payload.
    sizes = [1, 256 * 1024 - 1, 256 * 1024, 256 * 1024 + 1, 3 * MiB + 5]
    payloads = [os.urandom(size) for size in sizes]
    experts = routed_experts(16)
    headers = [kvstore_pb2.BlockHeader(key=key(i).to_proto()) for i in range(len(sizes))]
    headers[0].routed_experts.CopyFrom(experts)
    reply = await client.put(node_a, list(zip(headers, payloads, strict=True)))
    assert (reply.num_stored, reply.num_existing, reply.num_rejected) == (len(sizes), 0, 0)
    # Content-addressed: a second put of the same key is not stored twice.
    again = await client.put(node_b, [(key(0), payloads[0])])
    assert (again.num_stored, again.num_existing) == (1, 0)  # node b did not hold it
    again = await client.put(node_a, [(key(0), payloads[0])])
    assert (again.num_stored, again.num_existing) == (0, 1)

    located = await client.stub().LocateBlocks(
        kvstore_pb2.LocateBlocksRequest(keys=[key(i).to_proto() for i in range(1, len(sizes))] + [key(99).to_proto()])
    )
    assert [loc.address for loc in located.locations[:-1]] == [node_a] * (len(sizes) - 1)
    assert all(loc.tier == kvstore_pb2.TIER_DRAM for loc in located.locations[:-1])
    assert not located.locations[-1].found

    # Node b does not hold them; the pool client finds the holder and reads from it.
    on_b = await client.get_from(node_b, [key(1)])
    assert not on_b[0].found and on_b[0].data is None
    fetched = await client.get([key(i) for i in range(len(sizes))] + [key(99)])
    assert [bytes(block.data) for block in fetched[:-1]] == payloads
    assert all(block.header.num_bytes == size for block, size in zip(fetched, sizes, strict=False))
    assert fetched[0].header.routed_experts == experts
    assert not fetched[-1].found
    exists = await client.stub().BatchExists(
        kvstore_pb2.BatchExistsRequest(keys=[key(1).to_proto(), key(99).to_proto()])
    )
    assert list(exists.exists) == [True, False]

    stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
    assert {node.node_id for node in stats.nodes} == {"node-a", "node-b"}
    assert stats.num_leased_blocks == 0  # the pool client released its leases
    assert stats_of(stats) == {("tiny", "v1"): len(sizes)}


async def test_removing_a_namespace_frees_exactly_its_blocks(pool):
    metadata, (node_a, node_b) = await start_pool(pool)
    client = pool.client(metadata)
    for node, namespaces in ((node_a, ("v1", "v2")), (node_b, ("v1", "v3"))):
        blocks = [(key(i, ns), os.urandom(1000 + i)) for ns in namespaces for i in range(5)]
        await client.put(node, blocks)
    await client.put(node_a, [(key(0, "v1", model="other"), b"x" * 10)])  # same namespace, other model

    reply = await client.stub().RemoveNamespace(kvstore_pb2.RemoveNamespaceRequest(model="tiny", namespace="v1"))
    assert reply.num_blocks == 10 and reply.num_bytes == 2 * sum(1000 + i for i in range(5))
    stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
    assert stats_of(stats) == {("tiny", "v2"): 5, ("tiny", "v3"): 5, ("other", "v1"): 1}
    for node, expected in ((node_a, 6), (node_b, 5)):
        node_stats = await client.stub(node).GetStats(kvstore_pb2.GetStatsRequest())
        assert node_stats.num_blocks == expected
    fetched = await client.get([key(0, "v1"), key(0, "v2"), key(0, "v3"), key(0, "v1", model="other")])
    assert [block.found for block in fetched] == [False, True, True, True]

    removed = await client.stub().RemoveBlocks(kvstore_pb2.RemoveBlocksRequest(keys=[key(1, "v2").to_proto()]))
    assert removed.num_removed == 1
    assert not (await client.get([key(1, "v2")]))[0].found


async def test_a_dead_nodes_blocks_are_no_longer_located(pool):
    metadata, (node_a, _) = await start_pool(pool, node_timeout_s=0.6, heartbeat_s=0.1)
    client = pool.client(metadata)
    await client.put(node_a, [(key(1), b"abc")])
    assert (await client.get([key(1)]))[0].found
    await pool.services[1].stop(0)  # node a: its heartbeats stop
    await asyncio.sleep(1.0)
    located = await client.stub().LocateBlocks(kvstore_pb2.LocateBlocksRequest(keys=[key(1).to_proto()]))
    assert not located.locations[0].found
    stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
    assert [node.node_id for node in stats.nodes] == ["node-b"]


async def test_metadata_restart_nodes_register_again_and_report_their_blocks(pool):
    metadata, (node_a, _) = await start_pool(pool, heartbeat_s=0.1)
    client = pool.client(metadata)
    await client.put(node_a, [(key(1), b"abc")])
    # Forget everything: what a restarted metadata role knows.
    first = pool.services[0]
    servicer = first.definition.servicers[0][1]
    servicer._metadata.nodes.clear()
    servicer._metadata._holders.clear()
    assert not (await client.get([key(1)]))[0].found
    for _ in range(50):
        await asyncio.sleep(0.05)
        if (await client.get([key(1)]))[0].found:
            break
    assert bytes((await client.get([key(1)]))[0].data) == b"abc"


async def error_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value


async def test_bad_requests_name_the_field(pool):
    metadata, (node_a, _) = await start_pool(pool)
    client = pool.client(metadata)
    stub = client.stub()

    error = await error_of(
        stub.LocateBlocks(kvstore_pb2.LocateBlocksRequest(keys=[kvstore_pb2.BlockKey(content_hash=b"h")]))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "keys[0].model" in error.details()
    bad = [key(1).to_proto(), kvstore_pb2.BlockKey(model="m", content_hash=b"x" * 65)]
    error = await error_of(stub.BatchExists(kvstore_pb2.BatchExistsRequest(keys=bad)))
    assert "keys[1].content_hash" in error.details()
    error = await error_of(stub.LocateBlocks(kvstore_pb2.LocateBlocksRequest(keys=[key(1).to_proto()], lease_ms=10**7)))
    assert error.details().startswith("lease_ms:")
    error = await error_of(stub.RegisterNode(kvstore_pb2.RegisterNodeRequest(node=kvstore_pb2.NodeInfo(address="h:1"))))
    assert error.details().startswith("node.node_id:")
    error = await error_of(stub.RemoveNamespace(kvstore_pb2.RemoveNamespaceRequest(namespace="v1")))
    assert error.details().startswith("model:")
    error = await error_of(stub.Heartbeat(kvstore_pb2.HeartbeatRequest(node=kvstore_pb2.NodeInfo(node_id="ghost"))))
    assert error.code() == grpc.StatusCode.NOT_FOUND

    node = client.stub(node_a)

    def header(**fields):
        return kvstore_pb2.PutBlocksRequest(header=kvstore_pb2.BlockHeader(**fields))

    cases = [
        ([kvstore_pb2.PutBlocksRequest(data=b"abc")], "header"),
        ([header(key=kvstore_pb2.BlockKey(model="m"), num_bytes=3)], "header.key.content_hash"),
        ([header(key=key(1).to_proto(), num_bytes=0)], "header.num_bytes"),
        ([header(key=key(1).to_proto(), num_bytes=1 << 40)], "header.num_bytes"),
        ([header(key=key(1).to_proto(), num_bytes=2, found=True)], "header.found"),
        ([header(key=key(1).to_proto(), num_bytes=2), kvstore_pb2.PutBlocksRequest(data=b"abc")], "data"),
        ([header(key=key(1).to_proto(), num_bytes=4), kvstore_pb2.PutBlocksRequest(data=b"ab")], "data"),
    ]
    bad_experts = kvstore_pb2.BlockHeader(key=key(1).to_proto(), num_bytes=1)
    bad_experts.routed_experts.header.dtype = tensor_pb2.DTYPE_FLOAT32
    cases.append(([kvstore_pb2.PutBlocksRequest(header=bad_experts, data=b"a")], "header.routed_experts.header.dtype"))
    for messages, field in cases:
        error = await error_of(node.PutBlocks(iter(messages)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error)
        assert error.details().startswith(f"{field}:"), (field, error.details())
        violation = error_details(error)[1].field_violations[0]
        assert violation.field == field
    # Nothing half-stored, nothing reserved.
    assert (await node.GetStats(kvstore_pb2.GetStatsRequest())).num_blocks == 0

    error = await error_of(stub.PutBlocks(iter([header(key=key(1).to_proto(), num_bytes=1)])))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and error_details(error)[0].reason == "NO_STORAGE_ROLE"
    error = await error_of(node.LocateBlocks(kvstore_pb2.LocateBlocksRequest()))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and error_details(error)[0].reason == "NO_METADATA_ROLE"
