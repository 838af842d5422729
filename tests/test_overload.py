"""Overload: oversized, concurrent and trickling requests against real services served in this
process on port 0 (real gRPC servers, real stubs; the router's replica is a real inference.v1
server that generates slowly). Each test answers RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED, stays
within a stated bound on the growth of this process's RSS (the services run in it) while the
overload lasts, and serves the next good request."""

from __future__ import annotations

import asyncio
import functools
import pathlib
import socket
import struct
import time

import grpc
import pytest
import torch
from google.rpc import error_details_pb2

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl.kvstore.v1 import kvstore_pb2
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.admission import RETRY_AFTER_METADATA
from primerl_common.errors import error_details
from primerl_common.kvpool.bulk import OP_PUT, STATUS_ERROR
from primerl_common.processes import free_port
from primerl_common.tensors import tensor_to_proto
from primerl_common.testing import bare_server, eventually, in_process_service, rss_bytes
from primerl_kvstore.config import KvstoreConfig
from primerl_kvstore.server import build as build_kvstore
from primerl_launcher.tiny_model import make_tiny_model, save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.server import build as build_orchestrator
from primerl_router.config import RouterConfig
from primerl_router.server import build as build_router
from primerl_trainer.config import TrainerConfig
from primerl_trainer.server import build as build_trainer
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build as build_broadcaster

MiB = 1024 * 1024
QUIET = {"log_json": False, "log_level": "ERROR"}


def reason(error: grpc.aio.AioRpcError) -> str:
    return next((d.reason for d in error_details(error) if isinstance(d, error_details_pb2.ErrorInfo)), "")


def assert_retry_hint(error: grpc.aio.AioRpcError) -> None:
    assert int(dict(error.trailing_metadata())[RETRY_AFTER_METADATA]) > 0
    assert any(isinstance(d, error_details_pb2.RetryInfo) for d in error_details(error))


# ---------------------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("overload") / "tiny-dense", kind="dense", dtype="float32")


def micro_batch(vocab_size: int, num_tokens: int, seed: int) -> trainer_pb2.MicroBatch:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(num_tokens)
    tensors = {
        "input_ids": torch.randint(0, vocab_size, (num_tokens,), generator=generator),
        "position_ids": positions,
        "loss_mask": positions > 0,
        "advantages": torch.ones(num_tokens),
        "inference_logprobs": torch.full((num_tokens,), -1.0),
        "temperatures": torch.ones(num_tokens),
    }
    return trainer_pb2.MicroBatch(**{name: tensor_to_proto(t, name=name) for name, t in tensors.items()})


# A client still sending when the server refuses its stream gets INTERNAL ("Internal error from
# Core") in place of the server's status: grpc.aio marks the call failed when a send fails, before
# the status that ended it is read. The tests' clients pause after `begin` so that a refusal of the
# announcement reaches them as the server sent it.
PAUSE_AFTER_BEGIN_S = 0.2


async def push(stub, begin: trainer_pb2.BatchBegin, micro_batches) -> trainer_pb2.PushBatchResponse:
    async def requests():
        yield trainer_pb2.PushBatchRequest(begin=begin)
        await asyncio.sleep(PAUSE_AFTER_BEGIN_S)
        for message in micro_batches:
            yield trainer_pb2.PushBatchRequest(micro_batch=message)

    return await stub.PushBatch(requests(), timeout=30)


async def test_oversized_push_batches_are_refused_before_they_are_held(dense_dir: pathlib.Path) -> None:
    seq_len = 128
    config = TrainerConfig(
        server={"host": "127.0.0.1", "port": 0, "drain_delay_s": 0.0, "grace_s": 5.0},
        observability=QUIET,
        model={"path": str(dense_dir), "dtype": "float32", "compute_dtype": "float32"},
        seq_len=seq_len,
        batch_limits={"max_micro_batches": 64, "max_bytes": 32 * 1024},
    )
    async with in_process_service(await build_trainer(config), config, grace_s=5.0) as served:
        stub = trainer_pb2_grpc.TrainerServiceStub(served.channel)
        vocab_size = (await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())).vocab_size
        good = [micro_batch(vocab_size, seq_len, seed) for seed in range(16)]  # ~3.7 KB each
        before = rss_bytes()

        # 10^9 micro-batches announced, 64 MiB streamed behind the announcement: refused at `begin`.
        garbage = trainer_pb2.MicroBatch(input_ids=tensor_pb2.Tensor(data=b"\0" * (4 * MiB)))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(stub, trainer_pb2.BatchBegin(step=1, num_micro_batches=10**9), [garbage] * 16)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason(error.value) == "LIMIT_EXCEEDED"
        assert "begin.num_micro_batches" in error.value.details()
        assert "batch_limits.max_micro_batches = 64" in error.value.details()

        # Valid micro-batches past batch_limits.max_bytes (16 x 3.7 KB > 32 KiB): refused on arrival.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(stub, trainer_pb2.BatchBegin(step=1, num_micro_batches=16), good)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "batch_limits.max_bytes" in error.value.details()

        # A micro-batch whose input_ids say 2^40 tokens: refused before it is decoded.
        huge = trainer_pb2.MicroBatch()
        huge.CopyFrom(good[0])
        huge.input_ids.header.shape[:] = [2**40]
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(stub, trainer_pb2.BatchBegin(step=1, num_micro_batches=1), [huge])
        assert "batch_limits.max_tokens" in error.value.details()

        # Bound: none of the 64 MiB was kept.
        assert rss_bytes() - before < 48 * MiB, f"RSS grew {(rss_bytes() - before) / MiB:.0f} MiB"
        reply = await push(stub, trainer_pb2.BatchBegin(step=1, num_micro_batches=2), good[:2])
        assert (reply.step, reply.num_micro_batches) == (1, 2)


# ---------------------------------------------------------------------------- weight broadcaster


def tensor_chunks(name: str, num_bytes: int, chunk_bytes: int = 2 * MiB) -> list[tensor_pb2.TensorChunk]:
    header = tensor_pb2.TensorHeader(name=name, dtype=tensor_pb2.DTYPE_UINT8, shape=[num_bytes], num_bytes=num_bytes)
    data = b"\x01" * chunk_bytes
    chunks = [tensor_pb2.TensorChunk(header=header, data=data[: min(chunk_bytes, num_bytes)])]
    for start in range(chunk_bytes, num_bytes, chunk_bytes):
        chunks.append(tensor_pb2.TensorChunk(data=data[: min(chunk_bytes, num_bytes - start)]))
    return chunks


async def publish(stub, version: int, *, num_tensors: int, tensor_bytes: int, gap_s: float = 0.0, begin=None):
    async def requests():
        yield wb_pb2.PublishWeightsRequest(
            begin=begin
            or wb_pb2.PublishBegin(
                policy_version=version, num_tensors=num_tensors, num_bytes=num_tensors * tensor_bytes
            )
        )
        await asyncio.sleep(PAUSE_AFTER_BEGIN_S)
        for index in range(num_tensors):
            for chunk in tensor_chunks(f"layers.{index}.weight", tensor_bytes):
                yield wb_pb2.PublishWeightsRequest(chunk=chunk)
                await asyncio.sleep(gap_s)

    return await stub.PublishWeights(requests(), timeout=30)


@pytest.fixture
async def broadcaster():
    config = WeightBroadcasterConfig(
        server={"host": "127.0.0.1", "port": 0},
        observability=QUIET,
        publish={"max_tensors": 1000, "max_bytes": 256 * MiB},
        admission={"stream_idle_timeout_s": 2.0},
    )
    async with in_process_service(await build_broadcaster(config), config) as served:
        yield weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(served.channel)


async def test_oversized_and_concurrent_publishes_are_refused_within_a_memory_bound(broadcaster) -> None:
    stub = broadcaster
    before = rss_bytes()
    # Announced past the caps: refused at `begin`.
    for begin, field in [
        (wb_pb2.PublishBegin(policy_version=1, num_tensors=10**7), "publish.max_tensors"),
        (wb_pb2.PublishBegin(policy_version=1, num_bytes=2 * 1024**4), "publish.max_bytes"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish(stub, 1, num_tensors=1, tensor_bytes=1, begin=begin)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and field in error.value.details()
    # Announced nothing, then a tensor header of 1 TiB: refused before its bytes are allocated.
    silent = wb_pb2.PublishBegin(policy_version=1)
    huge = tensor_pb2.TensorHeader(name="w", dtype=tensor_pb2.DTYPE_UINT8, shape=[1024**4], num_bytes=1024**4)

    async def one_huge_header():
        yield wb_pb2.PublishWeightsRequest(begin=silent)
        await asyncio.sleep(PAUSE_AFTER_BEGIN_S)
        yield wb_pb2.PublishWeightsRequest(chunk=tensor_pb2.TensorChunk(header=huge, data=b"x"))

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.PublishWeights(one_huge_header(), timeout=30)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "chunk.header.num_bytes" in error.value.details() and "publish.max_bytes" in error.value.details()

    # Eight publishes of 32 MiB at once: the first is received (slowly), the others refused at
    # once with a retry hint (publish.max_concurrent = 1); without the limit all eight would be
    # held together (256 MiB).
    first = asyncio.ensure_future(publish(stub, 1, num_tensors=16, tensor_bytes=2 * MiB, gap_s=0.05))
    await asyncio.sleep(0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(
        *(publish(stub, version, num_tensors=16, tensor_bytes=2 * MiB) for version in range(2, 9)),
        return_exceptions=True,
    )
    assert loop.time() - started < 3.0
    for result in results:
        assert isinstance(result, grpc.aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason(result) == "OVERLOADED"
        assert "publish.max_concurrent = 1" in result.details()
        assert_retry_hint(result)
    assert (await first).policy_version == 1
    grown = rss_bytes() - before
    assert grown < 160 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
    # The next good publish goes through.
    reply = await publish(stub, 2, num_tensors=2, tensor_bytes=MiB)
    assert (reply.policy_version, reply.num_tensors) == (2, 2)


async def test_a_trickling_publish_ends_deadline_exceeded_and_frees_the_publish_slot(broadcaster) -> None:
    stub = broadcaster

    async def trickle():
        yield wb_pb2.PublishWeightsRequest(begin=wb_pb2.PublishBegin(policy_version=1, num_tensors=1))
        yield wb_pb2.PublishWeightsRequest(chunk=tensor_chunks("w", 4 * MiB)[0])
        await asyncio.sleep(30)  # the rest never comes

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.PublishWeights(trickle(), timeout=30)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and reason(error.value) == "STREAM_IDLE"
    assert "admission.stream_idle_timeout_s" in error.value.details()
    assert 2.0 <= loop.time() - started < 10.0
    # The slot the trickling publish held is free: the next one is taken at once.
    reply = await publish(stub, 1, num_tensors=2, tensor_bytes=MiB)
    assert reply.policy_version == 1


# ------------------------------------------------------------------------------------------ router


class SlowReplica:
    """A real inference.v1 Generate: one message at once, the last once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_started = 0

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        self.num_started += 1
        for finished in (False, True):
            output = generation_pb2.GenerationOutput(token_ids=[7], finished=finished)
            await context.write(inference_pb2.GenerateResponse(output=output).SerializeToString())
            if not finished:
                await self.release.wait()


async def test_ten_times_the_allowed_generate_calls_are_refused_fast_and_the_next_is_served() -> None:
    replica = SlowReplica()
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(replica.generate)}
    request = router_pb2.GenerateRequest(
        input=generation_pb2.GenerationInput(prompt_token_ids=[1, 2, 3]),
        routing=router_pb2.RoutingHints(session_key="episode-1"),
    ).SerializeToString()
    async with bare_server(
        lambda server: server.add_registered_method_handlers("primerl.inference.v1.InferenceService", handlers)
    ) as upstream:
        config = RouterConfig(
            server={"host": "127.0.0.1", "port": 0},
            observability=QUIET,
            replicas=[{"replica_id": "slow-0", "address": upstream}],
            routing={"max_concurrent_generate": 4, "max_concurrent_generate_per_caller": 4},
        )
        async with in_process_service(await build_router(config), config) as router:
            generate = router.channel.unary_stream("/primerl.router.v1.RouterService/Generate")

            async def one_call() -> int:
                return len([message async for message in generate(request, timeout=30)])

            before = rss_bytes()
            calls = [asyncio.ensure_future(one_call()) for _ in range(40)]
            await eventually(lambda: sum(c.done() for c in calls) >= 36, timeout_s=5, what="36 calls were refused")
            refused = [c for c in calls if c.done()]
            assert replica.num_started == 4 and len(refused) == 36
            for call in refused:
                error = call.exception()
                assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "routing.max_concurrent_generate = 4" in error.details()
                assert_retry_hint(error)
            grown = rss_bytes() - before
            assert grown < 32 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
            replica.release.set()
            assert [await c for c in calls if c not in refused] == [2, 2, 2, 2]
            assert await one_call() == 2


# ----------------------------------------------------------------------------------------- kvstore


async def test_kvstore_bulk_channel_bounds_connections_and_ends_a_trickling_put() -> None:
    port = free_port()
    config = KvstoreConfig(
        server={"host": "127.0.0.1", "port": port, "drain_delay_s": 0},
        observability=QUIET,
        node={"bulk_port": 0, "bulk_max_connections": 2, "bulk_idle_timeout_s": 0.5},
        dram={"capacity_bytes": 64 * MiB},
    )
    async with in_process_service(await build_kvstore(config), config) as served:
        stats = await served.channel.unary_unary(
            "/primerl.kvstore.v1.KvStoreService/GetStats",
            request_serializer=kvstore_pb2.GetStatsRequest.SerializeToString,
            response_deserializer=kvstore_pb2.GetStatsResponse.FromString,
        )(kvstore_pb2.GetStatsRequest())
        host, bulk_port = stats.nodes[0].bulk_address.rsplit(":", 1)

        def trickling_put() -> bytes:
            """A put of one 32 MiB block that sends 1 KiB of it, then stops: the node's answer."""
            header = kvstore_pb2.BlockHeader(
                key=kvstore_pb2.BlockKey(model="tiny", namespace="v1", content_hash=b"h" * 8), num_bytes=32 * MiB
            ).SerializeToString()
            for _ in range(100):  # until the connections closed before have given their slots back
                with socket.create_connection((host, int(bulk_port)), timeout=10) as conn:
                    conn.sendall(OP_PUT + struct.pack("<I", 1) + struct.pack("<I", len(header)) + header)
                    answer = conn.recv(2)
                    if answer[0] == STATUS_ERROR:
                        time.sleep(0.05)
                        continue
                    assert answer == b"\x00\x00"  # status ok, block 0: send it
                    conn.sendall(b"x" * 1024)
                    return conn.recv(4096)  # the error answer, once the idle timeout passed
            raise AssertionError("the bulk channel kept refusing connections")

        with socket.create_connection((host, int(bulk_port))), socket.create_connection((host, int(bulk_port))):
            # Two idle connections hold the node's two slots: a third is refused at once.
            with socket.create_connection((host, int(bulk_port)), timeout=10) as third:
                answer = third.recv(4096)
            assert answer[0] == STATUS_ERROR and b"node.bulk_max_connections = 2" in answer
        answer = await asyncio.to_thread(trickling_put)
        assert answer[0] == STATUS_ERROR and b"node.bulk_idle_timeout_s" in answer
        # The reservation was given back: the node holds nothing and takes the next put.
        stats = await served.channel.unary_unary(
            "/primerl.kvstore.v1.KvStoreService/GetStats",
            request_serializer=kvstore_pb2.GetStatsRequest.SerializeToString,
            response_deserializer=kvstore_pb2.GetStatsResponse.FromString,
        )(kvstore_pb2.GetStatsRequest())
        assert stats.nodes[0].num_blocks == 0


# ------------------------------------------------------------------------------------ orchestrator


class IdleTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A real trainer.v1 server at step 0 (policy version 0) that never needs a batch."""

    async def GetBatchSpec(self, request, context):
        return trainer_pb2.GetBatchSpecResponse(
            seq_len=256, vocab_size=320, next_step=1, mode=trainer_pb2.TRAINING_MODE_RL
        )

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(mode=trainer_pb2.TRAINING_MODE_RL, step=0, published_policy_version=0)


class OneTurnRouter(router_pb2_grpc.RouterServiceServicer):
    """A real router.v1 server answering every turn with two tokens of policy version 0."""

    async def Generate(self, request, context):
        yield router_pb2.GenerateResponse(
            output=generation_pb2.GenerationOutput(
                token_ids=[65, 66],
                logprobs=[-0.1, -0.2],
                policy_versions=[0, 0],
                finished=True,
                finish_reason=generation_pb2.FINISH_REASON_STOP,
            )
        )


async def test_an_environment_caller_past_its_episodes_is_refused_until_it_finishes_some(tmp_path) -> None:
    save_tokenizer(tmp_path)
    async with (
        bare_server(functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, IdleTrainer())) as trainer,
        bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, OneTurnRouter())) as router,
    ):
        config = OrchestratorConfig(
            server={"host": "127.0.0.1", "port": 0},
            observability=QUIET,
            peers={"router": router, "trainer": trainer, "poll_interval_s": 0.05},
            model={"path": tmp_path, "max_model_len": 64},
            environments=[{"name": "guess", "group_size": 2}],
            run={"batch_size": 8, "max_steps": 3, "max_concurrent_episodes": 16, "max_episodes_per_caller": 4},
        )
        async with in_process_service(await build_orchestrator(config), config) as served:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(served.channel)

            async def running() -> bool:
                status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
                return status.state == orchestrator_pb2.RUN_STATE_RUNNING

            await eventually(running, timeout_s=30, what="the run is running")

            async def start(task_id: str) -> list[str]:
                request = orchestrator_pb2.StartEpisodeRequest(
                    environment="guess", task=orchestrator_pb2.Task(task_id=task_id)
                )
                return [e.episode_id for e in (await stub.StartEpisode(request, timeout=10)).episodes]

            first, _ = await start("a"), await start("b")
            # Ten more groups asked for at once: all refused, nothing started for them.
            results = await asyncio.gather(*(start(f"c{i}") for i in range(10)), return_exceptions=True)
            for result in results:
                assert isinstance(result, grpc.aio.AioRpcError), result
                assert result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "run.max_episodes_per_caller = 4" in result.details()
                assert_retry_hint(result)
            status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
            assert status.environments[0].num_episodes_started == 4
            for episode_id in first:
                messages = orchestrator_pb2.ChatMessages(
                    messages=[orchestrator_pb2.ChatMessage(role="user", content="hi")]
                )
                await stub.Generate(orchestrator_pb2.GenerateRequest(episode_id=episode_id, messages=messages))
                await stub.FinishEpisode(orchestrator_pb2.FinishEpisodeRequest(episode_id=episode_id, reward=1.0))
            assert len(await start("d")) == 2
