"""The disk tier across a restart of a real `primerl-kvstore` process, killed with SIGKILL."""

import os
import pathlib
import shutil
import sys

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.processes import ServiceProcess, free_port

from .conftest import key

BLOCK = 10_000


def binary() -> str:
    path = shutil.which("primerl-kvstore", path=str(pathlib.Path(sys.executable).parent))
    assert path
    return path


async def test_disk_tier_survives_a_kill_and_restart(tmp_path):
    port = free_port()
    disk = tmp_path / "disk"
    args = [
        binary(),
        *("--server.host", "127.0.0.1", "--server.port", str(port), "--server.drain_delay_s", "0"),
        *("--dram.capacity_bytes", str(20 * BLOCK), "--disk.path", str(disk)),
        *("--observability.log_json", "false"),
    ]
    payloads = {i: os.urandom(BLOCK) for i in range(40)}
    process = ServiceProcess(args, port=port)
    await process.start()
    try:
        async with KvStoreClient(process.address) as client:
            for i in range(40):
                await client.put(process.address, [(key(i), payloads[i])])
            located = await client.stub().LocateBlocks(
                kvstore_pb2.LocateBlocksRequest(keys=[key(i).to_proto() for i in range(40)])
            )
            on_disk = {i for i, loc in enumerate(located.locations) if loc.tier == kvstore_pb2.TIER_DISK}
            assert len(on_disk) >= 20 and all(loc.found for loc in located.locations)
    finally:
        process.kill()
        await process.wait()

    # What a crash can leave: a half-written file aside, a truncated block, a flipped bit.
    (disk / "tmp" / "crashed.tmp").write_bytes(b"PRKVBLK1 half")
    files = sorted((disk / "blocks").glob("*/*.blk"))
    truncated, flipped = files[0], files[1]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    flipped.write_bytes(bytes(raw))

    process = ServiceProcess(args, port=port)
    async with process, KvStoreClient(process.address) as client:
        fetched = await client.get([key(i) for i in range(40)])
        found = {i for i, block in enumerate(fetched) if block.found}
        # DRAM died with the process; the disk tier is back, bit-exact, minus the two damaged files.
        assert len(found) == len(on_disk) - 2 and found <= on_disk
        assert all(bytes(fetched[i].data) == payloads[i] for i in found)
        stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
        assert stats.num_blocks == len(found) and stats.disk_used_bytes == len(found) * BLOCK
    assert not list((disk / "tmp").iterdir())
    assert not truncated.exists() and not flipped.exists()
