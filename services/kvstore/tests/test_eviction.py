"""Eviction on one node (roles both): watermarks, LRU order, leases, spill to disk, a full store."""

import os

import grpc
import prometheus_client
import pytest

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import error_details

from .conftest import key

BLOCK = 1000
# 100 blocks of DRAM: past 90 blocks it evicts down to 80.
DRAM = {"capacity_bytes": 100 * BLOCK}
EVICTION = {"high_watermark": 0.9, "low_watermark": 0.8}


async def start_node(pool, **fields):
    address = await pool.start(role="both", node={"node_id": "n"}, dram=DRAM, eviction=EVICTION, **fields)
    return address, pool.client(address)


async def stored(client, indices):
    fetched = await client.get([key(i) for i in indices])
    return {i for i, block in zip(indices, fetched, strict=True) if block.found}


async def stats(client):
    return await client.stub().GetStats(kvstore_pb2.GetStatsRequest())


async def test_watermarks_and_lru_order(pool):
    address, client = await start_node(pool)
    payloads = {i: os.urandom(BLOCK) for i in range(120)}
    for i in range(90):
        await client.put(address, [(key(i), payloads[i])])
    assert (await stats(client)).dram_used_bytes == 90 * BLOCK
    # Reading block 0 makes it the most recently used: block 1 is now the oldest.
    await client.get([key(0)])
    await client.put(address, [(key(90), payloads[90])])  # would pass the high watermark
    reply = await stats(client)
    assert reply.dram_used_bytes == 80 * BLOCK and reply.num_evicted_total == 11
    assert await stored(client, range(91)) == {0, *range(12, 91)}
    for i in range(91, 120):
        await client.put(address, [(key(i), payloads[i])])
        assert (await stats(client)).dram_used_bytes <= 90 * BLOCK
    # Evicted blocks are gone from the metadata role too; the rest read back bit-exactly.
    located = await client.stub().BatchExists(kvstore_pb2.BatchExistsRequest(keys=[key(1).to_proto()]))
    assert list(located.exists) == [False]
    survivors = sorted(await stored(client, range(120)))
    fetched = await client.get([key(i) for i in survivors])
    assert all(bytes(block.data) == payloads[i] for i, block in zip(survivors, fetched, strict=True))


async def test_leased_blocks_are_never_evicted_and_a_full_store_says_so(pool):
    address, client = await start_node(pool)
    for i in range(90):
        await client.put(address, [(key(i), os.urandom(BLOCK))])
    # Lease the 20 oldest (as a reader between LocateBlocks and GetBlocks).
    leased = await client.stub().LocateBlocks(
        kvstore_pb2.LocateBlocksRequest(keys=[key(i).to_proto() for i in range(20)], lease_ms=30_000)
    )
    for i in range(90, 200):
        await client.put(address, [(key(i), os.urandom(BLOCK))])
    assert await stored(client, range(20)) == set(range(20))
    assert (await stats(client)).num_leased_blocks == 20

    # Everything leased: nothing can leave and a block past the capacity is refused.
    every = await client.stub().LocateBlocks(
        kvstore_pb2.LocateBlocksRequest(keys=[key(i).to_proto() for i in range(200)], lease_ms=30_000)
    )
    used = (await stats(client)).dram_used_bytes
    big = (100 * BLOCK - used) + 1
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.put(address, [(key(500), os.urandom(big))])
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_details(error.value)[0].reason == "STORE_FULL"
    assert (await stats(client)).dram_used_bytes == used

    # Released: room again.
    lease_ids = [loc.lease_id for loc in [*leased.locations, *every.locations] if loc.lease_id]
    released = await client.stub().ReleaseLeases(kvstore_pb2.ReleaseLeasesRequest(lease_ids=lease_ids))
    assert released.num_released == len(lease_ids)
    reply = await client.put(address, [(key(500), os.urandom(big))])
    assert reply.num_stored == 1


async def test_dram_spills_to_disk_before_blocks_are_dropped(pool, tmp_path):
    disk = {"path": str(tmp_path / "disk"), "capacity_bytes": 100 * BLOCK, "fsync": False}
    address, client = await start_node(pool, disk=disk)
    payloads = {i: os.urandom(BLOCK) for i in range(200)}
    for i in range(91):
        await client.put(address, [(key(i), payloads[i])])
    reply = await stats(client)
    assert reply.num_spilled_total == 11 and reply.num_evicted_total == 0
    assert (reply.dram_used_bytes, reply.disk_used_bytes) == (80 * BLOCK, 11 * BLOCK)
    located = await client.stub().LocateBlocks(
        kvstore_pb2.LocateBlocksRequest(keys=[key(0).to_proto(), key(90).to_proto()])
    )
    assert [loc.tier for loc in located.locations] == [kvstore_pb2.TIER_DISK, kvstore_pb2.TIER_DRAM]
    assert bytes((await client.get([key(0)]))[0].data) == payloads[0]

    # Both tiers full: the disk tier drops its least recently used blocks.
    for i in range(91, 200):
        await client.put(address, [(key(i), payloads[i])])
    reply = await stats(client)
    assert reply.num_evicted_total > 0
    assert reply.disk_used_bytes <= 90 * BLOCK and reply.dram_used_bytes <= 90 * BLOCK
    present = await stored(client, range(200))
    assert len(present) == reply.num_blocks
    assert 199 in present and 1 not in present
    fetched = await client.get([key(i) for i in sorted(present)])
    assert all(bytes(b.data) == payloads[i] for i, b in zip(sorted(present), fetched, strict=True))
    files = list((tmp_path / "disk" / "blocks").glob("*/*.blk"))
    assert len(files) * BLOCK == reply.disk_used_bytes

    metrics = prometheus_client.generate_latest().decode()
    assert f'primerl_kvstore_node_spilled_total{{node="n"}} {float(reply.num_spilled_total)}' in metrics
    assert f'primerl_kvstore_node_disk_used_bytes{{node="n"}} {float(reply.disk_used_bytes)}' in metrics
