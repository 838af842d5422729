"""Every service served with mutual TLS in this process, attacked on the loopback network: for
each RPC that changes state (or hands out data), a peer without a certificate, one with a
certificate of another CA, one whose certificate names no identity, each valid certificate of a
role the RPC does not admit, a captured token replayed over another peer's connection and an
unknown token are each refused with the status that fits, and the service's state is as before.
Then the caller the RPC is for gets through. The roles expected here are written out per RPC (the
security contract), not read from the services' tables."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
import torch

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.config import TlsConfig
from primerl_common.errors import error_details
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.kvpool.keys import BlockKey
from primerl_common.processes import free_port
from primerl_common.security import _credentials
from primerl_common.security.certificates import Holder, make_authority, make_certificate, make_token, tls_of
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.testing import bare_server, eventually, in_process_service
from primerl_launcher.tiny_model import make_tiny_model, save_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
# The holder of each role's certificate.
HOLDERS = {
    "trainer": "trainer",
    "orchestrator": "orchestrator",
    "inference": "inference-0",
    "router": "router",
    "weight_broadcaster": "weight_broadcaster",
    "kvstore": "kvstore",
    "operator": "operator",
    "environment": "env-a",
    "tenant": "tenant-1",
}
UNAVAILABLE, UNAUTHENTICATED, DENIED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("certs")
    authority = make_authority(directory)
    other = make_authority(directory / "other", name="another CA")
    for role, name in HOLDERS.items():
        make_certificate(authority, directory, Holder(name, (role,)))
        make_certificate(other, directory / "other", Holder(name, (role,)))  # an impostor of each
        make_token(directory, f"stolen-{role}:{role}@{name}")
    make_certificate(authority, directory, Holder("anonymous", ()))
    return directory


def service_tls(certs: pathlib.Path, role: str) -> TlsConfig:
    return tls_of(certs, HOLDERS[role], tokens_file=certs / "tokens.toml")


@dataclasses.dataclass
class Target:
    address: str
    certs: pathlib.Path
    channels: dict[str, grpc.aio.Channel] = dataclasses.field(default_factory=dict)

    def channel(self, who: str) -> grpc.aio.Channel:
        """A channel as `who`: a holder name, "other:<name>" (another CA), or "no certificate"."""
        if who not in self.channels:
            if who == "no certificate":
                ca = (self.certs / "ca.pem").read_bytes()
                credentials = grpc.ssl_channel_credentials(root_certificates=ca)
                self.channels[who] = grpc.aio.secure_channel(self.address, credentials)
            elif who.startswith("other:"):
                impostor = tls_of(self.certs / "other", who.removeprefix("other:"))
                self.channels[who] = make_channel(
                    self.address, tls=impostor.model_copy(update={"ca": self.certs / "ca.pem"}), max_attempts=1
                )
            else:
                self.channels[who] = make_channel(self.address, tls=tls_of(self.certs, who), max_attempts=1)
        return self.channels[who]

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


def token(certs: pathlib.Path, role: str) -> str:
    return (certs / "tokens" / f"stolen-{role}.token").read_text().strip()


Invoke = Callable[[grpc.aio.Channel, list[tuple[str, str]]], Awaitable[object]]


async def attack(target: Target, rpc: str, allowed: set[str], invoke: Invoke) -> None:
    """Every intruder's call of `rpc` (which admits the roles `allowed`) is refused as it should be."""
    legit = HOLDERS[sorted(allowed)[0]]
    intruders: list[tuple[str, str, list[tuple[str, str]], grpc.StatusCode]] = [
        ("no certificate", "no certificate", [], UNAVAILABLE),
        (f"{legit}'s name from another CA", f"other:{legit}", [], UNAVAILABLE),
        ("a certificate without identity", "anonymous", [], UNAUTHENTICATED),
        *[(f"{name} (wrong role)", name, [], DENIED) for role, name in HOLDERS.items() if role not in allowed],
        *[
            (
                f"{role}'s token replayed by {replayer}",
                replayer,
                [("authorization", f"Bearer {token(target.certs, role)}")],
                UNAUTHENTICATED,
            )
            for role in allowed
            for replayer in [HOLDERS["tenant"] if role != "tenant" else HOLDERS["environment"]]
        ],
        (f"{legit} with an unknown token", legit, [("authorization", "Bearer forged")], UNAUTHENTICATED),
    ]
    for label, who, metadata, expected in intruders:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await invoke(target.channel(who), metadata)
        assert refused.value.code() == expected, f"{rpc} by {label}: {refused.value.code()} {refused.value.details()}"
        if expected == DENIED:
            details = refused.value.details()
            assert rpc in details and all(role in details for role in allowed), details
            assert error_details(refused.value)[0].reason == "MISSING_ROLE"


def unary(stub_class, method: str, request) -> Invoke:
    async def invoke(channel, metadata):
        return await getattr(stub_class(channel), method)(request, metadata=metadata, timeout=10)

    return invoke


def server_stream(stub_class, method: str, request) -> Invoke:
    async def invoke(channel, metadata):
        return [item async for item in getattr(stub_class(channel), method)(request, metadata=metadata, timeout=10)]

    return invoke


def client_stream(stub_class, method: str, messages: Callable[[], list]) -> Invoke:
    async def invoke(channel, metadata):
        async def requests():
            for message in messages():
                yield message

        return await getattr(stub_class(channel), method)(requests(), metadata=metadata, timeout=10)

    return invoke


@contextlib.asynccontextmanager
async def served(definition, config, certs: pathlib.Path) -> AsyncIterator[Target]:
    async with in_process_service(definition, config, client_tls=tls_of(certs, "operator")) as service:
        target = Target(service.address, certs)
        try:
            yield target
        finally:
            await target.close()


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


# --- trainer --------------------------------------------------------------------------------


async def test_trainer(certs, tmp_path_factory):
    from primerl_trainer.config import TrainerConfig
    from primerl_trainer.server import build

    model = make_tiny_model(tmp_path_factory.getbasetemp() / "security-tiny-dense", kind="dense", dtype="float32")
    config = TrainerConfig(
        server={"host": "127.0.0.1", "port": 0, "drain_delay_s": 0.0, "grace_s": 5.0},
        tls=service_tls(certs, "trainer"),
        model={"path": str(model), "dtype": "float32", "compute_dtype": "float32"},
        seq_len=64,
        checkpoint={"dir": str(tmp_path_factory.mktemp("checkpoints")), "save_on_stop": False},
    )
    async with served(await build(config), config, certs) as target:
        orchestrator = trainer_pb2_grpc.TrainerServiceStub(target.channel("orchestrator"))
        before = await orchestrator.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
        batch = [
            trainer_pb2.PushBatchRequest(begin=trainer_pb2.BatchBegin(step=before.next_step, num_micro_batches=10**9))
        ]
        Stub = trainer_pb2_grpc.TrainerServiceStub
        for rpc, allowed, invoke in [
            ("PushBatch", {"orchestrator"}, client_stream(Stub, "PushBatch", lambda: batch)),
            ("SaveCheckpoint", {"operator"}, unary(Stub, "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest())),
            (
                "GetBatchSpec",
                {"orchestrator", "operator"},
                unary(Stub, "GetBatchSpec", trainer_pb2.GetBatchSpecRequest()),
            ),
        ]:
            await attack(target, f"/primerl.trainer.v1.TrainerService/{rpc}", allowed, invoke)
        assert await orchestrator.GetBatchSpec(trainer_pb2.GetBatchSpecRequest()) == before
        status = await trainer_pb2_grpc.TrainerServiceStub(target.channel("tenant-1")).GetStatus(
            trainer_pb2.GetStatusRequest()
        )
        assert status.step == 0


# --- orchestrator ---------------------------------------------------------------------------


def _stand_ins():
    path = REPO / "services" / "orchestrator" / "tests" / "stand_ins.py"
    spec = importlib.util.spec_from_file_location("orchestrator_stand_ins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_orchestrator(certs, tmp_path_factory):
    from primerl_orchestrator.config import OrchestratorConfig
    from primerl_orchestrator.server import build

    stand_ins = _stand_ins()
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(tokenizer)
    async with (
        bare_server(
            functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, stand_ins.StandInTrainer())
        ) as trainer_at,
        bare_server(
            functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, stand_ins.StandInRouter())
        ) as router_at,
    ):
        # Its peers here are plaintext stand-ins: this process has no identity of its own.
        config = OrchestratorConfig(
            server={"host": "127.0.0.1", "port": 0},
            tls=service_tls(certs, "orchestrator"),
            peers={"router": router_at, "trainer": trainer_at, "poll_interval_s": 0.05},
            model={"path": tokenizer, "max_model_len": 64},
            environments=[{"name": "guess", "group_size": 2}],
            run={"batch_size": 2, "max_steps": 3},
        )
        async with served(await build(config), config, certs) as target:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(target.channel("operator"))

            async def status():
                return await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())

            async def running():
                # ... and knows the policy version its peers serve (-1 until its first poll of them)
                now = await status()
                return now.state == orchestrator_pb2.RUN_STATE_RUNNING and now.policy_version >= 0

            await eventually(running, timeout_s=30, what="the run is running at a known policy version")
            before = await status()
            Stub = orchestrator_pb2_grpc.OrchestratorServiceStub
            start = orchestrator_pb2.StartEpisodeRequest(
                environment="guess", task=orchestrator_pb2.Task(task_id="evil")
            )
            for rpc, allowed, invoke in [
                ("PauseRun", {"operator"}, unary(Stub, "PauseRun", orchestrator_pb2.PauseRunRequest())),
                ("ResumeRun", {"operator"}, unary(Stub, "ResumeRun", orchestrator_pb2.ResumeRunRequest())),
                ("StartEpisode", {"environment"}, unary(Stub, "StartEpisode", start)),
                (
                    "NextEpisode",
                    {"environment"},
                    unary(Stub, "NextEpisode", orchestrator_pb2.NextEpisodeRequest(environment="guess")),
                ),
                (
                    "Generate",
                    {"environment"},
                    unary(Stub, "Generate", orchestrator_pb2.GenerateRequest(episode_id="x")),
                ),
                (
                    "FinishEpisode",
                    {"environment"},
                    unary(Stub, "FinishEpisode", orchestrator_pb2.FinishEpisodeRequest(episode_id="x", reward=1.0)),
                ),
                (
                    "ListEnvironments",
                    {"environment"},
                    unary(Stub, "ListEnvironments", orchestrator_pb2.ListEnvironmentsRequest()),
                ),
            ]:
                await attack(target, f"/primerl.orchestrator.v1.OrchestratorService/{rpc}", allowed, invoke)
            assert await status() == before
            # An environment (its token, over its own connection) plays; the operator pauses.
            environment = orchestrator_pb2_grpc.OrchestratorServiceStub(target.channel(HOLDERS["environment"]))
            metadata = [("authorization", f"Bearer {token(certs, 'environment')}")]
            episodes = await environment.StartEpisode(start, metadata=metadata, timeout=10)
            assert len(episodes.episodes) == 2
            await stub.PauseRun(orchestrator_pb2.PauseRunRequest())
            assert (await status()).state == orchestrator_pb2.RUN_STATE_PAUSED


# --- inference ------------------------------------------------------------------------------


async def test_inference(certs, tmp_path_factory):
    from primerl_inference.config import InferenceConfig
    from primerl_inference.server import build

    model = make_tiny_model(tmp_path_factory.getbasetemp() / "security-tiny-inference", kind="dense", dtype="float32")
    config = InferenceConfig(
        server={"host": "127.0.0.1", "port": 0, "sealed_port": 0},
        tls=service_tls(certs, "inference"),
        engine={"model": str(model), "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 4},
    )
    async with served(await build(config), config, certs) as target:
        router = inference_pb2_grpc.InferenceServiceStub(target.channel("router"))
        before = (await router.GetLoad(inference_pb2.GetLoadRequest())).load
        Stub = inference_pb2_grpc.InferenceServiceStub
        update = [inference_pb2.UpdateWeightsRequest(begin=inference_pb2.WeightUpdateBegin(policy_version=99))]
        generate = inference_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                prompt_token_ids=[1, 2, 3], sampling=generation_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
            )
        )
        adapter = [inference_pb2.LoadAdapterRequest(spec=inference_pb2.AdapterSpec(name="evil"))]
        for rpc, allowed, invoke in [
            ("UpdateWeights", {"weight_broadcaster"}, client_stream(Stub, "UpdateWeights", lambda: update)),
            ("PauseGeneration", {"operator"}, unary(Stub, "PauseGeneration", inference_pb2.PauseGenerationRequest())),
            (
                "ResumeGeneration",
                {"operator"},
                unary(Stub, "ResumeGeneration", inference_pb2.ResumeGenerationRequest()),
            ),
            (
                "ResetPrefixCache",
                {"router", "operator"},
                unary(Stub, "ResetPrefixCache", inference_pb2.ResetPrefixCacheRequest()),
            ),
            ("LoadAdapter", {"weight_broadcaster", "operator"}, client_stream(Stub, "LoadAdapter", lambda: adapter)),
            (
                "UnloadAdapter",
                {"weight_broadcaster", "operator"},
                unary(Stub, "UnloadAdapter", inference_pb2.UnloadAdapterRequest(name="evil")),
            ),
            ("Generate", {"router"}, server_stream(Stub, "Generate", generate)),
        ]:
            await attack(target, f"/primerl.inference.v1.InferenceService/{rpc}", allowed, invoke)
        after = (await router.GetLoad(inference_pb2.GetLoadRequest())).load
        assert after.policy_version == before.policy_version and not after.paused
        tokens = [
            token_id async for reply in router.Generate(generate, timeout=60) for token_id in reply.output.token_ids
        ]
        assert len(tokens) == 2
        await sealed_push_attacked_then_taken(target, model)


def model_tensors(model: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for path in sorted(model.glob("*.safetensors")) for name, t in load_file(path).items()}


async def sealed_push_attacked_then_taken(target: Target, model: pathlib.Path) -> None:
    """UpdateWeights as sealed streams on the replica's sealed port: sessions only for the
    broadcaster's role, a stream under a guessed key refused, then the broadcaster's push of the
    model's tensors served as the new version."""
    import os

    from primerl_common.sealed_streams import SealedCaller
    from primerl_common.security.sealed import StreamKey

    method = "/primerl.inference.v1.InferenceService/UpdateWeights"
    load = inference_pb2_grpc.InferenceServiceStub(target.channel("router")).GetLoad
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await SealedCaller(target.channel("router"), "127.0.0.1").open(method, 1, timeout_s=10)
    assert denied.value.code() == DENIED and "weight_broadcaster" in denied.value.details()
    tensors = model_tensors(model)
    begin = inference_pb2.WeightUpdateBegin(
        policy_version=7,
        format=tensor_pb2.WEIGHT_FORMAT_HF,
        num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )
    requests = [
        inference_pb2.UpdateWeightsRequest(begin=begin).SerializeToString(),
        *(
            inference_pb2.UpdateWeightsRequest(chunk=chunk).SerializeToString()
            for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=1 << 20)
        ),
    ]
    broadcaster = SealedCaller(target.channel("weight_broadcaster"), "127.0.0.1")
    try:
        port, (guessed, taken) = await broadcaster.open(method, 2, timeout_s=10)
        forged = StreamKey(guessed.session_id, os.urandom(32), method)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await broadcaster.call(port, forged, 0, requests, inference_pb2.UpdateWeightsResponse, timeout_s=60)
        assert refused.value.code() == UNAUTHENTICATED
        assert (await load(inference_pb2.GetLoadRequest())).load.policy_version != 7
        response = await broadcaster.call(port, taken, 1, requests, inference_pb2.UpdateWeightsResponse, timeout_s=120)
        assert response.policy_version == 7
        assert (await load(inference_pb2.GetLoadRequest())).load.policy_version == 7
    finally:
        await broadcaster.close()


# --- deployment -----------------------------------------------------------------------------


async def test_the_container_health_probe_speaks_mutual_tls(certs):
    """deploy/docker/grpc_healthcheck.py (the images' HEALTHCHECK, the Kubernetes probes) with
    the identity PRIMERL_TLS_* names; without it the mTLS server refuses it."""
    import asyncio
    import os
    import sys

    from primerl_router.config import RouterConfig
    from primerl_router.server import build

    config = RouterConfig(server={"host": "127.0.0.1", "port": 0}, tls=service_tls(certs, "router"))
    async with served(await build(config), config, certs) as target:
        port = target.address.rpartition(":")[2]
        script = str(REPO / "deploy" / "docker" / "grpc_healthcheck.py")
        plain_env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMERL_")}
        tls_env = {
            **plain_env,
            "PRIMERL_TLS_MODE": "mtls",
            "PRIMERL_TLS_CERT": str(certs / "router.pem"),
            "PRIMERL_TLS_KEY": str(certs / "router-key.pem"),
            "PRIMERL_TLS_CA": str(certs / "ca.pem"),
        }
        results = []
        for env in (tls_env, plain_env):
            probe = await asyncio.create_subprocess_exec(
                sys.executable, script, port, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await probe.communicate()
            results.append((probe.returncode, (out + err).decode()))
    assert results[0][0] == 0 and "SERVING" in results[0][1], results
    assert results[1][0] == 1, results


@pytest.mark.parametrize("deployment", ["compose", "systemd/etc", "k8s/config", "slurm/config"])
def test_every_shipped_deployment_requires_mutual_tls(deployment):
    import tomllib

    configs = sorted((REPO / "deploy" / deployment).glob("*.toml"))
    # One per service, and more where a deployment shape has its own (compose's router-*.toml).
    services = ("trainer", "orchestrator", "inference", "router", "weight_broadcaster", "kvstore")
    assert {name for name in services if any(path.stem.startswith(name) for path in configs)} == set(services)
    for path in configs:
        tls = TlsConfig(**tomllib.loads(path.read_text())["tls"])
        assert tls.mode == "mtls" and None not in (tls.cert, tls.key, tls.ca), path


def test_a_local_run_of_primerl_up_says_plaintext_unless_the_launch_file_gives_tls(tmp_path):
    from primerl_launcher.spec import ServiceSpec
    from primerl_launcher.wiring import wire

    given = {"mode": "mtls", "cert": "c.pem", "key": "k.pem", "ca": "ca.pem"}
    services = {
        "router": ServiceSpec("router", "router", {}, "[router]"),
        "kvstore": ServiceSpec("kvstore", "kvstore", {"tls": dict(given)}, "[kvstore]"),
    }
    wire(services, run_dir=tmp_path, model=None, host="127.0.0.1")
    assert services["router"].table["tls"] == {"mode": "plaintext"}
    assert services["kvstore"].table["tls"] == given
