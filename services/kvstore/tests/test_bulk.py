"""The bulk side channel: the same blocks as PutBlocks/GetBlocks over raw TCP, mixed freely with gRPC."""

import asyncio
import os
import socket
import time

import grpc
import pytest

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.kvpool.bulk import BulkClient, BulkError
from primerl_common.processes import free_port
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.testing import in_process_service
from primerl_kvstore.config import KvstoreConfig
from primerl_kvstore.server import build

from .conftest import key

MiB = 1024 * 1024


async def start_pool(pool, **node_fields):
    metadata = await pool.start(role="metadata")
    node = await pool.start(
        role="storage",
        node={"node_id": "bulk-node", "metadata_address": metadata, "bulk_port": 0, "chunk_bytes": 64 * 1024},
        **node_fields,
    )
    client = pool.client(metadata, chunk_bytes=100_000)
    stats = await client.stub(node).GetStats(kvstore_pb2.GetStatsRequest())
    return metadata, node, stats.nodes[0].bulk_address, client


async def test_bulk_and_grpc_move_the_same_blocks_bit_exactly(pool):
    _, node, bulk_address, client = await start_pool(pool)
    assert bulk_address and bulk_address != node
    payloads = {i: os.urandom(size) for i, size in enumerate([1, 64 * 1024, 64 * 1024 + 1, 3 * MiB + 7])}
    reply = await client.put_bulk(bulk_address, [(key(i), data) for i, data in payloads.items()])
    assert (reply.num_stored, reply.num_existing) == (4, 0)
    reply = await client.put_bulk(bulk_address, [(key(0), payloads[0]), (key(10), b"z" * 5)])
    assert (reply.num_stored, reply.num_existing) == (1, 1)
    await client.put(node, [(key(11), b"grpc-put")])

    located = await client.stub().LocateBlocks(kvstore_pb2.LocateBlocksRequest(keys=[key(0).to_proto()]))
    assert located.locations[0].bulk_address == bulk_address
    wanted = [*payloads, 10, 11, 99]
    expected = [payloads.get(i, b"z" * 5 if i == 10 else b"grpc-put") for i in wanted[:-1]]
    for bulk in (True, False):  # the pool read through each path
        fetched = await client.get([key(i) for i in wanted], bulk=bulk)
        assert [bytes(b.data) for b in fetched[:-1]] == expected and not fetched[-1].found
    direct = await client.get_from(node, [key(3)])  # a bulk-put block served over gRPC
    assert bytes(direct[0].data) == payloads[3]


async def test_bulk_errors_name_the_field_and_a_full_node_says_so(pool):
    _, node, bulk_address, client = await start_pool(pool, dram={"capacity_bytes": 10_000})
    for header, field in [
        (kvstore_pb2.BlockHeader(key=kvstore_pb2.BlockKey(content_hash=b"h")), "header.key.model"),
        (kvstore_pb2.BlockHeader(key=key(1).to_proto(), found=True), "header.found"),
    ]:
        with pytest.raises(BulkError) as error:
            await client.put_bulk(bulk_address, [(header, b"abc")])
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.message.startswith(f"{field}:")
    with pytest.raises(BulkError) as error:
        await asyncio.to_thread(lambda: BulkClient(bulk_address).get([key(1), key(2).__class__("", 0, "", b"")]))
    assert error.value.message.startswith("keys[1].model:")

    # Fill the node (one block twice: stored once), lease everything: the next block has no room.
    reply = await client.put_bulk(bulk_address, [(key(i), os.urandom(1000)) for i in [*range(9), 0]])
    assert (reply.num_stored, reply.num_existing) == (9, 1)
    located = await client.stub().LocateBlocks(
        kvstore_pb2.LocateBlocksRequest(keys=[key(i).to_proto() for i in range(9)], lease_ms=30_000)
    )
    lease_ids = [location.lease_id for location in located.locations]
    with pytest.raises(BulkError) as error:
        await client.put_bulk(bulk_address, [(key(20), os.urandom(2000))])
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The node still serves, and a truncated upload leaves nothing behind.
    await client.stub().ReleaseLeases(kvstore_pb2.ReleaseLeasesRequest(lease_ids=lease_ids))

    def truncated_upload() -> bytes:
        # Blocking socket calls in a thread: the server in this process needs the event loop.
        with socket.create_connection(tuple(bulk_address.rsplit(":", 1))) as conn:
            raw = kvstore_pb2.BlockHeader(key=key(30).to_proto(), num_bytes=500).SerializeToString()
            conn.sendall(b"P" + (1).to_bytes(4, "little") + len(raw).to_bytes(4, "little") + raw)
            decision = conn.recv(2, socket.MSG_WAITALL)
            conn.sendall(b"x" * 100)
            return decision

    assert await asyncio.to_thread(truncated_upload) == b"\x00\x00"  # ok, send it
    await asyncio.sleep(0.2)
    fetched = await client.get([key(0), key(30)], bulk=True)
    assert [b.found for b in fetched] == [True, False]
    stats = await client.stub(node).GetStats(kvstore_pb2.GetStatsRequest())  # the node's own, current
    assert stats.num_blocks == 9 and stats.dram_used_bytes == 9000
    reply = await client.put_bulk(bulk_address, [(key(30), os.urandom(500))])  # its room was given back
    assert reply.num_stored == 1


async def test_under_mtls_a_connection_over_the_limit_is_refused_after_the_handshake(tmp_path):
    """Past node.bulk_max_connections an mTLS node completes the handshake, then answers
    RESOURCE_EXHAUSTED naming the limit (plaintext bytes first would end the client's handshake
    instead); once a slot is free the next connection is served."""
    authority = make_authority(tmp_path)
    for holder in ("kvstore", "inference-0:inference"):
        make_certificate(authority, tmp_path, Holder.parse(holder))
    replica = tls_of(tmp_path, "inference-0")
    config = KvstoreConfig(
        server={"host": "127.0.0.1", "port": free_port(), "drain_delay_s": 0},
        tls=tls_of(tmp_path, "kvstore"),
        node={"node_id": "bulk-node", "bulk_port": 0, "bulk_max_connections": 1},
        dram={"capacity_bytes": 16 * MiB},
    )
    async with in_process_service(await build(config), config, client_tls=tls_of(tmp_path, "kvstore")) as served:
        stats = await kvstore_pb2_grpc.KvStoreServiceStub(served.channel).GetStats(kvstore_pb2.GetStatsRequest())
        bulk_address = stats.nodes[0].bulk_address

        def over_the_limit() -> BulkError:
            holder = BulkClient(bulk_address, tls=replica, timeout_s=10)
            try:
                ((header, _),) = holder.get([key(1)])  # admitted: it holds the node's one slot
                assert not header.found
                second = BulkClient(bulk_address, tls=replica, timeout_s=10)  # the handshake completes
                try:
                    with pytest.raises(BulkError) as refused:
                        second.get([key(1)])
                    return refused.value
                finally:
                    second.close()
            finally:
                holder.close()

        refused = await asyncio.to_thread(over_the_limit)
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "node.bulk_max_connections = 1" in refused.message and "retry later" in refused.message

        def served_once_a_slot_is_free() -> bytes:
            for _ in range(100):  # until the closed connection has given its slot back
                client = BulkClient(bulk_address, tls=replica, timeout_s=10)
                try:
                    client.put([(kvstore_pb2.BlockHeader(key=key(2).to_proto()), b"after")])
                    ((_, data),) = client.get([key(2)])
                    return bytes(data)
                except BulkError as error:
                    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    time.sleep(0.05)
                finally:
                    client.close()
            raise AssertionError("the bulk channel kept refusing connections")

        assert await asyncio.to_thread(served_once_a_slot_is_free) == b"after"
