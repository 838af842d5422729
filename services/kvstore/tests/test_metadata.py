"""The metadata role's bookkeeping with a hand-driven clock: leases, claims, liveness."""

import pytest

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument, NotFound
from primerl_kvstore.metadata import Metadata, StoredBlock

from .conftest import key

DRAM = kvstore_pb2.TIER_DRAM


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def metadata():
    clock = Clock()
    meta = Metadata(node_timeout_s=5.0, max_lease_ms=10_000, storage_link=lambda record: None, clock=clock)
    for node_id in ("a", "b"):
        meta.register(kvstore_pb2.NodeInfo(node_id=node_id, address=f"{node_id}:1"))
    return meta, clock


def test_leases_hold_blocks_until_released_or_expired(metadata):
    meta, clock = metadata
    meta.update_blocks("a", [StoredBlock(key(i), 10, DRAM) for i in range(3)], [])
    first = meta.locate([key(0)], lease_ms=2_000)[0]
    second = meta.locate([key(0)], lease_ms=3_000)[0]
    assert first.found and first.lease_id and first.lease_id != second.lease_id
    assert meta.claim_eviction("a", [key(0), key(1)]) == [False, True]
    assert [loc.found for loc in meta.locate([key(0), key(1)], lease_ms=0)] == [True, False]
    assert meta.release([first.lease_id, "unknown"]) == 1
    assert meta.claim_eviction("a", [key(0)]) == [False]  # the second lease still holds it
    clock.now += 3.1
    assert meta.claim_eviction("a", [key(0)]) == [True]  # expired
    assert meta.num_leased_blocks() == 0
    with pytest.raises(InvalidArgument, match="lease_ms"):
        meta.locate([key(2)], lease_ms=10_001)


def test_a_lease_holds_the_block_on_its_node_only(metadata):
    meta, _ = metadata
    for node_id in ("a", "b"):
        meta.update_blocks(node_id, [StoredBlock(key(1), 10, DRAM)], [])
    location = meta.locate([key(1)], lease_ms=1_000)[0]
    other = "b" if location.node_id == "a" else "a"
    assert meta.claim_eviction(other, [key(1)]) == [True]
    assert meta.claim_eviction(location.node_id, [key(1)]) == [False]
    assert meta.exists([key(1)]) == [True]


def test_nodes_that_stop_heartbeating_are_forgotten(metadata):
    meta, clock = metadata
    meta.update_blocks("a", [StoredBlock(key(1), 10, kvstore_pb2.TIER_DISK)], [])
    assert meta.locate([key(1)], 0)[0].tier == kvstore_pb2.TIER_DISK
    clock.now += 3
    meta.heartbeat(kvstore_pb2.NodeInfo(node_id="b", address="b:1"))
    clock.now += 3
    assert not meta.locate([key(1)], 0)[0].found  # a is dead; b is alive
    meta.sweep()
    assert sorted(meta.nodes) == ["b"]
    with pytest.raises(NotFound):
        meta.heartbeat(kvstore_pb2.NodeInfo(node_id="a", address="a:1"))
    with pytest.raises(NotFound):
        meta.update_blocks("a", [StoredBlock(key(2), 10, DRAM)], [])
    stats = meta.stats()
    assert [n.node_id for n in stats.nodes] == ["b"] and stats.num_misses_total == 1
