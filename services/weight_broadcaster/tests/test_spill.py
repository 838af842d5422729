"""The store spilled to `store.spill_folder`: versions written there and held as mappings of
the files, loaded back by a restarted broadcaster (which pushes them at once), damaged
folders skipped, and a folder that cannot be written refused by the config."""

import functools
import pathlib
import shutil
import uuid

import grpc
import pytest
import torch
from google.rpc import error_details_pb2

from primerl.common.v1 import generation_pb2, service_info_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.errors import error_details
from primerl_common.tensors import TensorAssembler
from primerl_common.testing import bare_server
from primerl_common.weights.manifest import load_tensors, read_manifest
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.spill import SpillFolder
from primerl_weight_broadcaster.store import WeightStore

from .helpers import publish, running_broadcaster, wait_for


def weights(step: int) -> dict[str, torch.Tensor]:
    """Layer i changes at every step that is a multiple of i + 1; the bias never does."""
    return {
        **{f"layer.{i}.weight": torch.full((8, 8), float(step // (i + 1))) for i in range(3)},
        "bias": torch.arange(5, dtype=torch.int64),
    }


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]) for name in a)


def mapped_from(tensor: torch.Tensor) -> pathlib.Path | None:
    """The file whose memory mapping holds `tensor`'s data (None: anonymous memory)."""
    maps = pathlib.Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    address = tensor.data_ptr()
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return pathlib.Path(fields[5]) if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_versions_are_spilled_held_as_mappings_and_loaded_back(tmp_path: pathlib.Path):
    store = WeightStore(SpillFolder(tmp_path))
    assert store.latest is None
    for step in (1, 2, 3):
        published = store.publish(step, weights(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spill-v0000000002", "spill-v0000000003"]  # newest 2
    folder = tmp_path / "spill-v0000000003"
    assert equal(dict(load_tensors(folder, read_manifest(folder))), weights(3))
    assert equal(published.tensors, weights(3))
    assert {mapped_from(t) for t in published.tensors.values()} == {folder / "tensors-00000.safetensors"}  # not RAM
    assert published.last_changed == {"layer.0.weight": 3, "layer.1.weight": 2, "layer.2.weight": 3, "bias": 1}

    restarted = WeightStore(SpillFolder(tmp_path)).latest
    assert restarted.policy_version == 3 and list(restarted.tensors) == list(weights(3))  # published order
    assert equal(restarted.tensors, weights(3))
    assert {mapped_from(t) for t in restarted.tensors.values()} == {folder / "tensors-00000.safetensors"}
    assert (restarted.last_changed, restarted.first_policy_version) == (published.last_changed, 1)
    assert [name for name, _ in restarted.tensors_since(1)] == ["layer.0.weight", "layer.1.weight", "layer.2.weight"]
    assert [name for name, _ in restarted.tensors_since(2)] == ["layer.0.weight", "layer.2.weight"]


def test_damaged_and_half_written_folders_are_skipped_at_start_and_deleted_later(tmp_path: pathlib.Path):
    store = WeightStore(SpillFolder(tmp_path))
    store.publish(1, weights(1))
    store.publish(2, weights(2))
    # A crash mid-write leaves a staging folder; a copy without its manifest and one whose file
    # changed after it was written are not complete versions either.
    shutil.copytree(tmp_path / "spill-v0000000002", tmp_path / ".spill-v0000000009.tmp-0123abcd")
    shutil.copytree(tmp_path / "spill-v0000000002", tmp_path / "spill-v0000000008")
    (tmp_path / "spill-v0000000008" / "manifest.json").unlink()
    shutil.copytree(tmp_path / "spill-v0000000002", tmp_path / "spill-v0000000007")
    with open(tmp_path / "spill-v0000000007" / "tensors-00000.safetensors", "r+b") as file:
        file.seek(-1, 2)
        file.write(b"\x7f")
    (tmp_path / "notes").mkdir()

    restarted = WeightStore(SpillFolder(tmp_path))
    assert restarted.latest.policy_version == 2 and equal(restarted.latest.tensors, weights(2))
    assert restarted.publish(3, weights(3)).num_changed_tensors == 2  # layers 0 and 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "spill-v0000000002", "spill-v0000000003"]


def test_a_failed_spill_is_logged_and_the_version_held_in_ram(tmp_path: pathlib.Path, caplog):
    (tmp_path / "spill").mkdir()
    store = WeightStore(SpillFolder(tmp_path / "spill"))
    first = store.publish(1, weights(1))
    shutil.rmtree(tmp_path / "spill")
    (tmp_path / "spill").write_text("")  # the folder is gone, and cannot be made again
    assert equal(first.tensors, weights(1))  # its deleted files stay mapped
    second = store.publish(2, weights(2))
    assert store.latest is second and equal(second.tensors, weights(2))
    assert {mapped_from(t) for t in second.tensors.values()} == {None}
    assert "spilling policy version 2 to store.spill_folder failed" in caplog.text


def test_a_spill_folder_that_cannot_be_created_is_a_config_error(tmp_path: pathlib.Path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"store\.spill_folder\n.*cannot be created or written"):
        WeightBroadcasterConfig(store={"spill_folder": tmp_path / "file" / "spill"})
    config = WeightBroadcasterConfig(store={"spill_folder": tmp_path / "new" / "spill"})
    assert config.store.spill_folder == (tmp_path / "new" / "spill").resolve() and config.store.spill_folder.is_dir()


class StandInReplica(inference_pb2_grpc.InferenceServiceServicer):
    """The inference surface pushes go to, without an engine: it keeps the tensors it is sent."""

    def __init__(self) -> None:
        self.instance_id = uuid.uuid4().hex
        self.policy_version = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.updates: list[tuple[inference_pb2.WeightUpdateBegin, list[str]]] = []

    async def GetServiceInfo(self, request, context):
        capabilities = ["weights.format.hf", "weights.delta"]
        info = service_info_pb2.ServiceInfo(service_name="inference", instance_id=self.instance_id)
        info.capabilities.extend(capabilities)
        return inference_pb2.GetServiceInfoResponse(info=info)

    async def GetLoad(self, request, context):
        return inference_pb2.GetLoadResponse(load=generation_pb2.LoadReport(policy_version=self.policy_version))

    async def UpdateWeights(self, request_iterator, context):
        requests = aiter(request_iterator)
        begin = (await anext(requests)).begin
        assembler, received = TensorAssembler(), {}
        async for request in requests:
            if (item := assembler.feed(request.chunk)) is not None:
                received[item[0]] = item[1]
        assembler.finish()
        if begin.policy_version <= self.policy_version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not newer")
        self.tensors = {**self.tensors, **received} if begin.delta else received
        self.updates.append((begin, sorted(received)))
        self.policy_version = begin.policy_version
        return inference_pb2.UpdateWeightsResponse(policy_version=begin.policy_version, num_tensors=len(received))


async def test_a_restarted_broadcaster_pushes_its_spilled_version_and_deltas_on_top(tmp_path: pathlib.Path):
    store = {"spill_folder": tmp_path / "spill"}
    async with running_broadcaster(store=store) as stub:
        await publish(stub, 1, weights(1))
        await publish(stub, 2, weights(2))

    replica = StandInReplica()
    register = functools.partial(inference_pb2_grpc.add_InferenceServiceServicer_to_server, replica)
    async with (
        bare_server(register) as address,
        running_broadcaster(replicas=[{"replica_id": "r", "address": address, "delta": True}], store=store) as stub,
    ):
        assert (await stub.GetStatus(pb2.GetStatusRequest())).latest_policy_version == 2
        await wait_for(stub, 2, 1)  # pushed without a publish
        assert equal(replica.tensors, weights(2)) and not replica.updates[-1][0].delta

        # A trainer republishing the version held is told so (it counts that as published).
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish(stub, 2, weights(2))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = next(d for d in error_details(error.value) if isinstance(d, error_details_pb2.ErrorInfo))
        assert (info.reason, dict(info.metadata)) == ("POLICY_VERSION_NOT_NEWER", {"latest_policy_version": "2"})

        assert (await publish(stub, 3, weights(3))).num_changed_tensors == 2
        await wait_for(stub, 3, 1)
        begin, names = replica.updates[-1]
        assert (begin.delta, begin.base_policy_version, names) == (True, 2, ["layer.0.weight", "layer.2.weight"])
        assert equal(replica.tensors, weights(3))
