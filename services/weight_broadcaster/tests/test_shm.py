"""The same-host transport's folder (shm.py): owned while the broadcaster runs, removed after a
broadcaster that died; which replicas share it; a publish received straight into it and its
version folders linking those bytes (full and delta) or written once (other formats); and
the transport `auto` picks per replica."""

import fcntl
import gc
import os
import pathlib

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.weights.manifest import load_tensors, read_manifest
from primerl_common.weights.shared_memory import shm_attributes
from primerl_weight_broadcaster.replicas import Replica, pick_transport
from primerl_weight_broadcaster.shm import SharedMemory
from primerl_weight_broadcaster.store import WeightStore


def _tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layers.0.self_attn.{p}_proj.weight": scale * torch.randn(rows, 8, generator=generator)
        for p, rows in (("q", 8), ("k", 4), ("v", 4), ("o", 8))
    } | {"norm.weight": torch.ones(8, dtype=torch.bfloat16)}


def _received(shm: SharedMemory, tensors: dict[str, torch.Tensor]):
    receiver = shm.receiver(sum(t.numel() * t.element_size() for t in tensors.values()))
    assert receiver is not None
    received = {}
    for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=100):
        if (item := receiver.assembler.feed(chunk)) is not None:
            received[item[0]] = item[1]
    receiver.assembler.finish()
    return receiver, *receiver.finish(received)


def test_the_folder_is_owned_while_running_and_a_dead_broadcasters_one_is_removed(tmp_path: pathlib.Path):
    first, second = SharedMemory(tmp_path, keep_versions=1), SharedMemory(tmp_path, keep_versions=1)
    assert first.root != second.root and first.root.parent == tmp_path
    # `second`'s process dies: its lock goes, its folder stays until another broadcaster starts.
    os.close(second._lock)
    # Another process's lock (an open file description of its own) holds `first`'s.
    held = os.open(first.root / ".lock", os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(held)

    third = SharedMemory(tmp_path, keep_versions=1)

    assert sorted(tmp_path.iterdir()) == sorted([first.root, third.root])
    first.close()
    third.close()
    assert list(tmp_path.iterdir()) == []


def test_replicas_are_routed_by_boot_id_and_shared_memory_identity(tmp_path: pathlib.Path):
    (tmp_path / "shm").mkdir()
    (tmp_path / "other-shm").mkdir()
    shm = SharedMemory(tmp_path / "shm", keep_versions=1)
    same = shm_attributes(tmp_path / "shm")
    try:
        # The same memory seen at another path (a container mounting the host's /dev/shm elsewhere).
        folder, why = shm.route({**same, "weights.shm_folder": "/mnt/host-shm"})
        assert folder == pathlib.Path("/mnt/host-shm") / shm.root.name and "same host" in why
        assert shm.route(same)[0] == shm.root
        assert shm.route({**same, "host.boot_id": "another-boot"}) == (None, "another host (its boot id differs)")
        assert "not " in shm.route(shm_attributes(tmp_path / "other-shm"))[1]  # its own shared memory
        assert shm.route({}) == (None, "the replica names no boot id")  # a replica of an earlier release
        assert shm.route({**same, "weights.shm_folder": ""})[0] is None
    finally:
        shm.close()


async def test_a_publish_received_into_shared_memory_is_linked_into_its_folders(tmp_path: pathlib.Path):
    shm = SharedMemory(tmp_path, keep_versions=1)
    store = WeightStore()
    try:
        first = _tensors()
        receiver, views, placement = _received(shm, first)
        assert all(torch.equal(views[name], t) for name, t in first.items())
        assert receiver.path.exists() and placement.finite
        version = store.make_latest(store.prepare(1, views, placement=placement))
        async with shm.use(version, None) as (folder, manifest):
            assert folder == shm.root / "v0000000001-hf"
            assert read_manifest(folder, verify_checksums=False) == manifest
            assert manifest.metadata == {"all_finite": True}  # checked once here, not by every replica
            # The bytes received, not a copy of them; q, k and v back to back as they came.
            (data,) = {t.file for t in manifest.tensors}
            assert os.stat(folder / data).st_ino == os.stat(receiver.path).st_ino
            offsets = {t.name.split(".")[-2]: (t.offset, t.num_bytes) for t in manifest.tensors}
            assert offsets["k_proj"][0] == sum(offsets["q_proj"]) and offsets["v_proj"][0] == sum(offsets["k_proj"])
            loaded = dict(load_tensors(folder, manifest))
            assert all(torch.equal(loaded[name], t) for name, t in first.items())

        second = {**first, "layers.0.self_attn.k_proj.weight": first["layers.0.self_attn.k_proj.weight"] * 2}
        _, views, placement = _received(shm, second)
        version = store.make_latest(store.prepare(2, views, placement=placement))
        async with shm.use(version, 1) as (folder, manifest):
            # A delta of whole engine modules: q/k/v (one qkv_proj), linked too.
            assert folder.name == "v0000000002-hf-delta0000000001" and manifest.delta
            assert sorted(t.name.split(".")[-2] for t in manifest.tensors) == ["k_proj", "q_proj", "v_proj"]
            assert all(torch.equal(t, second[name]) for name, t in load_tensors(folder, manifest))
        kernel = await store.in_format(version, tensor_pb2.WEIGHT_FORMAT_KERNEL)
        async with shm.use(kernel, None) as (folder, manifest):  # converted: written once
            assert folder.name == "v0000000002-kernel"
            assert "layers.0.self_attn.qkv_proj.weight" in {t.name for t in manifest.tensors}
        # Only the newest version's folders are kept; the first publish's file goes with it.
        del views, placement, version
        gc.collect()
        await shm.pruned()
        assert not receiver.path.exists()
        assert sorted(p.name for p in shm.root.iterdir() if not p.name.startswith(".")) == [
            "v0000000002-hf-delta0000000001",
            "v0000000002-kernel",
        ]
    finally:
        shm.close()


async def test_a_version_holding_nan_is_not_said_to_be_finite(tmp_path: pathlib.Path):
    shm = SharedMemory(tmp_path, keep_versions=1)
    store = WeightStore()
    try:
        tensors = {**_tensors(), "norm.weight": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)}
        _, views, placement = _received(shm, tensors)
        assert not placement.finite
        version = store.make_latest(store.prepare(1, views, placement=placement))
        async with shm.use(version, None) as (_, manifest):
            assert manifest.metadata == {}  # each replica checks for itself, and refuses it
        kernel = await store.in_format(version, tensor_pb2.WEIGHT_FORMAT_KERNEL)
        async with shm.use(kernel, None) as (_, manifest):
            assert manifest.metadata == {}
    finally:
        shm.close()


def test_a_publish_that_does_not_fit_is_received_in_ram(tmp_path: pathlib.Path):
    shm = SharedMemory(tmp_path, keep_versions=1)
    try:
        free = os.statvfs(tmp_path)
        assert shm.receiver(free.f_bavail * free.f_frsize) is None
        assert shm.receiver(0) is None  # nothing announced
        receiver = shm.receiver(1024)
        assert receiver is not None
        receiver.close()  # a stream that failed leaves nothing
        assert [p.name for p in shm.root.iterdir()] == [".lock"]
    finally:
        shm.close()


def test_transport_auto_picks_shared_memory_on_this_host_and_grpc_for_anyone_else(tmp_path: pathlib.Path):
    shm = SharedMemory(tmp_path, keep_versions=1)
    here = {
        "capabilities": frozenset({"weights.shm", "weights.collective.gloo"}),
        "attributes": shm_attributes(tmp_path),
    }

    def pick(collective=None, **fields):
        replica = Replica("r", "127.0.0.1:1", delta=False, **{"transport": pb2.TRANSPORT_AUTO, **here, **fields})
        return pick_transport(replica, shm, collective)

    class Gloo:
        capability = "weights.collective.gloo"

    try:
        assert pick() == (pb2.TRANSPORT_SHM, f"same host and shared memory ({tmp_path})")
        assert pick(transport=pb2.TRANSPORT_GRPC) == (pb2.TRANSPORT_GRPC, "")  # asked for: kept
        # A replica of an earlier release lists no weights.shm (nor the attributes).
        assert pick(capabilities=frozenset(), attributes={}) == (pb2.TRANSPORT_GRPC, "no capability weights.shm")
        assert pick(shm_failed="it could not load from shared memory (...)")[0] == pb2.TRANSPORT_GRPC
        other_host = {**here["attributes"], "host.boot_id": "elsewhere"}
        assert pick(attributes=other_host) == (pb2.TRANSPORT_GRPC, "another host (its boot id differs)")
        # Off this host, the collective transport where the broadcaster has one (HF format only).
        assert pick(Gloo(), attributes=other_host)[0] == pb2.TRANSPORT_NCCL
        assert pick(Gloo(), attributes=other_host, format=tensor_pb2.WEIGHT_FORMAT_KERNEL)[0] == pb2.TRANSPORT_GRPC
        assert pick_transport(Replica("r", "a:1", delta=False, transport=pb2.TRANSPORT_AUTO, **here), None, None) == (
            pb2.TRANSPORT_GRPC,
            "the broadcaster has no shm.folder",
        )
    finally:
        shm.close()
