"""Real kvstore servers in this process (fixed free ports: peers must reach a node at
the address it advertises) and a client that talks to them through the real stubs."""

from __future__ import annotations

import contextlib

import pytest

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.kvpool.keys import BlockKey
from primerl_common.processes import free_port
from primerl_common.server import GrpcService
from primerl_common.testing import in_process_service
from primerl_kvstore.config import KvstoreConfig
from primerl_kvstore.server import build


class Pool:
    def __init__(self) -> None:
        self.services: list[GrpcService] = []
        self.clients: list[KvStoreClient] = []
        self._serving = contextlib.AsyncExitStack()

    async def start(self, **fields) -> str:
        """Starts one kvstore process-in-process; returns its address."""
        port = free_port()
        fields.setdefault("server", {})
        fields["server"] = {"host": "127.0.0.1", "port": port, "drain_delay_s": 0, **fields["server"]}
        config = KvstoreConfig(**fields)
        served = await self._serving.enter_async_context(in_process_service(await build(config), config))
        self.services.append(served.service)
        return served.address

    def client(self, metadata_address: str, **kwargs) -> KvStoreClient:
        client = KvStoreClient(metadata_address, **kwargs)
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        await self._serving.aclose()


@pytest.fixture
async def pool():
    pool = Pool()
    yield pool
    await pool.close()


def key(index: int, namespace: str = "v1", model: str = "tiny", rank: int = 0) -> BlockKey:
    return BlockKey(model, rank, namespace, index.to_bytes(8, "little") + b"hash")


def stats_of(reply: kvstore_pb2.GetStatsResponse) -> dict[tuple[str, str], int]:
    return {(ns.model, ns.namespace): ns.num_blocks for ns in reply.namespaces}
