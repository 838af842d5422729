"""The kvstore's Prometheus metrics (served on observability.metrics_port), read at scrape time
from the storage nodes and metadata roles of this process, so the block path touches nothing."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from primerl_kvstore.metadata import Metadata
from primerl_kvstore.storage import StorageNode

__all__ = ["track"]


class _KvstoreCollector(Collector):
    def __init__(self) -> None:
        self.nodes: weakref.WeakSet[StorageNode] = weakref.WeakSet()
        self.metadata: weakref.WeakSet[Metadata] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "blocks": ("Blocks this node holds.", lambda n: n.num_blocks),
            "dram_used_bytes": ("DRAM in use.", lambda n: n.dram_used_bytes),
            "dram_capacity_bytes": ("DRAM segment.", lambda n: n.dram_capacity_bytes),
            "disk_used_bytes": ("Disk tier in use.", lambda n: n.disk.used_bytes if n.disk else 0),
            "disk_capacity_bytes": ("Disk tier size.", lambda n: n.disk.capacity_bytes if n.disk else 0),
        }
        counters = {
            "hits": ("Blocks served.", lambda n: n.num_hits_total),
            "misses": ("Blocks asked for and not held.", lambda n: n.num_misses_total),
            "evicted": ("Blocks dropped to make room.", lambda n: n.num_evicted_total),
            "spilled": ("Blocks moved from DRAM to disk.", lambda n: n.num_spilled_total),
        }
        nodes = list(self.nodes)
        for name, (doc, read) in gauges.items():
            family = GaugeMetricFamily(f"primerl_kvstore_node_{name}", doc, labels=["node"])
            for node in nodes:
                family.add_metric([node.node_id], read(node))
            yield family
        for name, (doc, read) in counters.items():
            family = CounterMetricFamily(f"primerl_kvstore_node_{name}", doc, labels=["node"])
            for node in nodes:
                family.add_metric([node.node_id], read(node))
            yield family
        roles = list(self.metadata)
        if roles:
            yield GaugeMetricFamily(
                "primerl_kvstore_live_nodes", "Storage nodes the metadata role knows.", sum(len(m.nodes) for m in roles)
            )
            yield GaugeMetricFamily(
                "primerl_kvstore_leased_blocks",
                "Blocks held by a live lease.",
                sum(m.num_leased_blocks() for m in roles),
            )
            yield CounterMetricFamily(
                "primerl_kvstore_locate_hits", "Keys LocateBlocks found.", sum(m.num_hits_total for m in roles)
            )
            yield CounterMetricFamily(
                "primerl_kvstore_locate_misses",
                "Keys LocateBlocks did not find.",
                sum(m.num_misses_total for m in roles),
            )


_collector: _KvstoreCollector | None = None


def track(*, node: StorageNode | None = None, metadata: Metadata | None = None) -> None:
    """Reports `node` and `metadata` in the default registry (as long as they live)."""
    global _collector
    if _collector is None:
        _collector = _KvstoreCollector()
        REGISTRY.register(_collector)
    if node is not None:
        _collector.nodes.add(node)
    if metadata is not None:
        _collector.metadata.add(metadata)
