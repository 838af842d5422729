"""LoRA adapter publishes (PUBLISH_KIND_ADAPTER) and their push to replicas: the broadcaster
in process, replicas as stand-ins that serve the inference.v1 surface a push uses and keep what
they are sent (pushes to real vLLM replicas: tests/test_adapter_push.py)."""

from __future__ import annotations

import contextlib
import functools
import pathlib
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from primerl.common.v1 import generation_pb2, service_info_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.errors import error_details, field_violations
from primerl_common.tensors import TensorAssembler
from primerl_common.testing import bare_server, eventually
from primerl_common.weights.manifest import write_weights
from primerl_weight_broadcaster.adapters import REMOVALS_FILE

from .helpers import lora_tensors, publish, publish_adapter, running_broadcaster, wait_for, wait_for_adapter

FULL = {"layer.0.weight": torch.ones(4, 4)}


class StandInReplica(inference_pb2_grpc.InferenceServiceServicer):
    """An inference replica without an engine: it takes full updates and LoRA adapters as the
    real one does (a replacement needs a greater version and keeps the owner) and keeps them."""

    def __init__(self, *, lora: bool = True) -> None:
        self.instance_id = uuid.uuid4().hex
        self.lora = lora
        self.policy_version = 0
        self.adapters: dict[str, tuple[inference_pb2.AdapterSpec, dict[str, torch.Tensor]]] = {}
        self.num_load_calls = 0
        self.fail_loads = 0  # the next loads answered UNAVAILABLE
        self.num_unload_calls = 0
        self.fail_unloads = 0  # the next unloads answered UNAVAILABLE
        self.down = False  # every probe answered UNAVAILABLE

    def restart(self, *, keep_adapters: bool = False) -> None:
        """A new process; with `keep_adapters`, one that loads its adapters back at start."""
        self.instance_id, self.policy_version = uuid.uuid4().hex, 0
        if not keep_adapters:
            self.adapters = {}

    def hold(self, name: str, policy_version: int, owner: str = "") -> None:
        """Holds an adapter no broadcaster pushed (loaded from elsewhere, or by an earlier process)."""
        spec = inference_pb2.AdapterSpec(name=name, policy_version=policy_version, owner=owner, rank=8, alpha=16.0)
        self.adapters[name] = (spec, lora_tensors(policy_version))

    def versions(self) -> dict[str, int]:
        return {name: spec.policy_version for name, (spec, _) in self.adapters.items()}

    async def GetServiceInfo(self, request, context):
        if self.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        info = service_info_pb2.ServiceInfo(service_name="inference", instance_id=self.instance_id)
        info.capabilities.extend(["weights.format.hf", *(["lora"] if self.lora else [])])
        return inference_pb2.GetServiceInfoResponse(info=info)

    async def GetLoad(self, request, context):
        return inference_pb2.GetLoadResponse(load=generation_pb2.LoadReport(policy_version=self.policy_version))

    async def UpdateWeights(self, request_iterator, context):
        begin = None
        async for request in request_iterator:
            begin = begin or request.begin
        self.policy_version = begin.policy_version
        return inference_pb2.UpdateWeightsResponse(policy_version=begin.policy_version)

    async def LoadAdapter(self, request_iterator, context):
        self.num_load_calls += 1
        requests = aiter(request_iterator)
        spec = (await anext(requests)).spec
        assembler, tensors = TensorAssembler(), {}
        async for request in requests:
            if (item := assembler.feed(request.chunk)) is not None:
                tensors[item[0]] = item[1]
        assembler.finish()
        if self.fail_loads:
            self.fail_loads -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        held = self.adapters.get(spec.name)
        if held is not None and spec.policy_version <= held[0].policy_version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not newer")
        if held is not None and spec.owner != held[0].owner:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another owner")
        self.adapters[spec.name] = (spec, tensors)
        return inference_pb2.LoadAdapterResponse(name=spec.name, replaced=held is not None)

    async def UnloadAdapter(self, request, context):
        self.num_unload_calls += 1
        if self.fail_unloads:
            self.fail_unloads -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        if self.adapters.pop(request.name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter {request.name!r}")
        return inference_pb2.UnloadAdapterResponse(unloaded=True)

    async def ListAdapters(self, request, context):
        return inference_pb2.ListAdaptersResponse(adapters=[spec for spec, _ in self.adapters.values()])


@contextlib.asynccontextmanager
async def serving(replica: StandInReplica) -> AsyncIterator[str]:
    async with bare_server(functools.partial(inference_pb2_grpc.add_InferenceServiceServicer_to_server, replica)) as a:
        yield a


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


async def status(stub) -> pb2.GetStatusResponse:
    return await stub.GetStatus(pb2.GetStatusRequest())


async def test_each_adapter_version_reaches_every_replica_and_late_ones():
    first, second, late = StandInReplica(), StandInReplica(), StandInReplica()
    async with (
        serving(first) as first_address,
        serving(second) as second_address,
        serving(late) as late_address,
        running_broadcaster(
            replicas=[{"replica_id": "a", "address": first_address}, {"replica_id": "b", "address": second_address}]
        ) as stub,
    ):
        watch = stub.WatchReplicas(pb2.WatchReplicasRequest())
        await publish(stub, 1, FULL)
        reply = await publish_adapter(stub, "math", 1, lora_tensors(1))
        assert (reply.policy_version, reply.num_tensors) == (1, 16)
        await wait_for_adapter(stub, "math", 1, 2)  # each version reaches them (not only the latest)
        await publish_adapter(stub, "math", 2, lora_tensors(2))
        reached = await wait_for_adapter(stub, "math", 2, 2)
        assert (reached.latest_policy_version, reached.num_replicas_at_version) == (2, 2)
        await wait_for(stub, 1, 2)  # full weights pushed as before

        for replica in (first, second):
            spec, tensors = replica.adapters["math"]
            assert (spec.policy_version, spec.rank, spec.alpha) == (2, 8, 16.0)
            assert list(spec.target_modules) == ["q_proj", "v_proj"] and same(tensors, lora_tensors(2))
        state = await status(stub)
        assert state.latest_policy_version == 1  # an adapter is not a full version
        assert dict(state.latest_adapter_versions) == {"math": 2}
        assert {r.replica_id: dict(r.adapter_versions) for r in state.replicas} == {"a": {"math": 2}, "b": {"math": 2}}

        # Full versions keep their own count: 2 is free, 1 is stale.
        assert (await publish(stub, 2, FULL)).policy_version == 2
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish(stub, 1, FULL)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id="late", address=late_address))
        await wait_for_adapter(stub, "math", 2, 3)
        assert same(late.adapters["math"][1], lora_tensors(2)) and late.num_load_calls == 1

        events = []
        async for event in watch:
            events.append(event)
            if event.replica.replica_id == "late" and dict(event.replica.adapter_versions) == {"math": 2}:
                break
        assert any(dict(e.replica.adapter_versions) == {"math": 1} for e in events)
        watch.cancel()


async def test_bad_adapter_publishes_are_refused_naming_the_field_and_store_nothing():
    good = lora_tensors(1)
    unpaired = {k: v for k, v in good.items() if "layers.3.self_attn.v_proj.lora_B" not in k}
    cases = [
        ({"adapter_name": ""}, good, "begin.adapter_name"),
        ({"adapter_name": "../etc"}, good, "begin.adapter_name"),
        ({"adapter_name": ".hidden"}, good, "begin.adapter_name"),
        ({"adapter_name": "x" * 65}, good, "begin.adapter_name"),
        ({"adapter_owner": "../bob"}, good, "begin.adapter_owner"),
        ({"adapter_owner": "-bob"}, good, "begin.adapter_owner"),
        ({"adapter_owner": "b" * 65}, good, "begin.adapter_owner"),
        ({"adapter_rank": 0}, good, "begin.adapter_rank"),
        ({"adapter_alpha": 0.0}, good, "begin.adapter_alpha"),
        ({"adapter_rank": 4}, good, "begin.adapter_rank"),  # the tensors are of rank 8
        ({"num_stripes": 2, "stripe_session": "s"}, good, "begin.num_stripes"),
        ({"num_bytes": 100}, good, "begin.num_bytes"),  # more arrive than announced
        ({}, {**good, "model.layers.0.self_attn.q_proj.weight": torch.ones(8, 256)}, "chunk.header.name"),
        ({}, {k.replace("base_model.model.", ""): v for k, v in good.items()}, "chunk.header.name"),
        ({}, unpaired, "chunk.header.name"),
    ]
    async with running_broadcaster(publish_limits={"max_bytes": 1 << 20}) as stub:
        await publish_adapter(stub, "math", 3, good)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish_adapter(stub, "math", 4, good, num_bytes=2 << 20)  # as for full publishes
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "publish.max_bytes" in error.value.details()
        for begin, tensors, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await publish_adapter(stub, begin.pop("adapter_name", "math"), 4, tensors, **begin)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.value.details())
            assert field in field_violations(error.value), (field, error.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish_adapter(stub, "math", 3, good)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not newer than the latest published 3 of adapter 'math'" in error.value.details()

        collective = pb2.PublishCollectiveRequest(
            begin=pb2.PublishBegin(policy_version=5, kind=pb2.PUBLISH_KIND_ADAPTER)
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PublishCollective(collective)
        assert "begin.kind" in field_violations(error.value)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.WaitForVersion(pb2.WaitForVersionRequest(adapter_name="a/b", policy_version=1))
        assert "adapter_name" in field_violations(error.value)

        state = await status(stub)
        assert dict(state.latest_adapter_versions) == {"math": 3} and state.latest_policy_version == -1
        reply = await stub.WaitForVersion(
            pb2.WaitForVersionRequest(adapter_name="code", policy_version=0, timeout_ms=50)
        )
        assert not reply.reached and reply.latest_policy_version == -1
        assert "publish.adapter" in (await stub.GetServiceInfo(pb2.GetServiceInfoRequest())).info.capabilities


async def test_failed_and_refused_loads_restarts_and_replicas_without_lora():
    replica, no_lora = StandInReplica(), StandInReplica(lora=False)
    replica.fail_loads = 2
    async with (
        serving(replica) as address,
        serving(no_lora) as no_lora_address,
        running_broadcaster(
            replicas=[{"replica_id": "r", "address": address}, {"replica_id": "n", "address": no_lora_address}]
        ) as stub,
    ):
        await publish_adapter(stub, "math", 1, lora_tensors(1))
        await publish(stub, 1, FULL)
        await wait_for(stub, 1, 2)  # the failing adapter push holds no full push back
        await wait_for_adapter(stub, "math", 1, 1)  # retried with backoff
        assert replica.num_load_calls == 3 and no_lora.num_load_calls == 0

        # A restarted replica holds no adapter: it is pushed again.
        replica.restart()
        await eventually(lambda: "math" in replica.adapters, what="the adapter pushed again")
        await wait_for(stub, 1, 2)

        # Another broadcaster process pushed it a newer version: "not newer" is taken as held.
        tensors = replica.adapters["math"][1]
        replica.adapters["math"] = (inference_pb2.AdapterSpec(name="math", policy_version=7), tensors)
        await publish_adapter(stub, "math", 5, lora_tensors(5))
        reply = await wait_for_adapter(stub, "math", 5, 1)
        assert reply.latest_policy_version == 5
        state = {r.replica_id: dict(r.adapter_versions) for r in (await status(stub)).replicas}
        assert state == {"r": {"math": 7}, "n": {}}


async def test_a_restarted_broadcaster_still_pushes_its_adapters(tmp_path: pathlib.Path):
    store = {"spill_folder": tmp_path / "spill"}
    async with running_broadcaster(store=store) as stub:
        await publish(stub, 1, FULL)
        await publish_adapter(stub, "math", 1, lora_tensors(1))
        await publish_adapter(stub, "math", 2, lora_tensors(2))
        await publish_adapter(stub, "code", 1, lora_tensors(3, rank=4, modules=("o_proj",)), adapter_rank=4)
    assert sorted(p.name for p in (tmp_path / "spill" / "adapters" / "math").iterdir()) == ["v0000000002"]

    replica = StandInReplica()
    async with (
        serving(replica) as address,
        running_broadcaster(replicas=[{"replica_id": "r", "address": address}], store=store) as stub,
    ):
        state = await status(stub)
        assert dict(state.latest_adapter_versions) == {"math": 2, "code": 1} and state.latest_policy_version == 1
        await wait_for_adapter(stub, "math", 2, 1)
        await wait_for_adapter(stub, "code", 1, 1)
        assert same(replica.adapters["math"][1], lora_tensors(2))
        assert list(replica.adapters["code"][0].target_modules) == ["o_proj"]
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish_adapter(stub, "math", 2, lora_tensors(2))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_an_owned_adapter_reaches_every_replica_with_its_owner_and_keeps_it():
    replica, late = StandInReplica(), StandInReplica()
    async with (
        serving(replica) as address,
        serving(late) as late_address,
        running_broadcaster(replicas=[{"replica_id": "r", "address": address}]) as stub,
    ):
        await publish_adapter(stub, "math", 1, lora_tensors(1), adapter_owner="alice")
        await wait_for_adapter(stub, "math", 1, 1)
        spec, tensors = replica.adapters["math"]
        assert (spec.owner, spec.policy_version) == ("alice", 1) and same(tensors, lora_tensors(1))

        # Another tenant's publish of the same name (or an ownerless one) is refused before
        # anything is received, whatever its version: the first owner's adapter stays.
        for owner, shown in (("bob", "'bob'"), ("", "no owner")):
            for version in (2, 1):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await publish_adapter(stub, "math", version, lora_tensors(9), adapter_owner=owner)
                assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"adapter 'math' belongs to 'alice', not to {shown}" in error.value.details()
                info = error_details(error.value)[0]
                assert info.reason == "ADAPTER_OWNER_MISMATCH"
                assert (info.metadata["adapter_owner"], info.metadata["requested_owner"]) == ("alice", owner)
        assert dict((await status(stub)).latest_adapter_versions) == {"math": 1}

        # Its owner publishes on; another name is free for anyone.
        await publish_adapter(stub, "math", 2, lora_tensors(2), adapter_owner="alice")
        await publish_adapter(stub, "code", 1, lora_tensors(3), adapter_owner="bob")
        await wait_for_adapter(stub, "math", 2, 1)
        await wait_for_adapter(stub, "code", 1, 1)
        await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id="late", address=late_address))
        await wait_for_adapter(stub, "math", 2, 2)
        await wait_for_adapter(stub, "code", 1, 2)
        for held in (replica, late):
            assert {name: (spec.owner, spec.policy_version) for name, (spec, _) in held.adapters.items()} == {
                "math": ("alice", 2),
                "code": ("bob", 1),
            }
            assert same(held.adapters["math"][1], lora_tensors(2))
        # Its status says whose each adapter a replica holds is (routers serve it to them alone).
        for held in (await status(stub)).replicas:
            assert dict(held.adapter_owners) == {"math": "alice", "code": "bob"}

        # A restarted replica gets them again, owners included.
        replica.restart()
        await eventually(lambda: len(replica.adapters) == 2, what="the adapters pushed again")
        assert {name: spec.owner for name, (spec, _) in replica.adapters.items()} == {"math": "alice", "code": "bob"}


async def test_a_restarted_broadcaster_keeps_each_adapters_owner(tmp_path: pathlib.Path):
    store = {"spill_folder": tmp_path / "spill"}
    async with running_broadcaster(store=store) as stub:
        await publish_adapter(stub, "math", 1, lora_tensors(1), adapter_owner="alice")
        await publish_adapter(stub, "math", 2, lora_tensors(2), adapter_owner="alice")
        await publish_adapter(stub, "open", 1, lora_tensors(3))
    # A version spilled before adapters had owners: it has none.
    spill_rank_8_adapter(tmp_path / "spill" / "adapters" / "old" / "v0000000004", version=4)

    replica = StandInReplica()
    async with (
        serving(replica) as address,
        running_broadcaster(replicas=[{"replica_id": "r", "address": address}], store=store) as stub,
    ):
        assert dict((await status(stub)).latest_adapter_versions) == {"math": 2, "open": 1, "old": 4}
        for name, version in (("math", 2), ("open", 1), ("old", 4)):
            await wait_for_adapter(stub, name, version, 1)
        owners = {name: (spec.owner, spec.policy_version) for name, (spec, _) in replica.adapters.items()}
        assert owners == {"math": ("alice", 2), "open": ("", 1), "old": ("", 4)}
        assert same(replica.adapters["old"][1], lora_tensors(4))

        with pytest.raises(grpc.aio.AioRpcError) as error:
            await publish_adapter(stub, "math", 3, lora_tensors(3), adapter_owner="bob")
        assert error_details(error.value)[0].reason == "ADAPTER_OWNER_MISMATCH"
        await publish_adapter(stub, "math", 3, lora_tensors(3), adapter_owner="alice")
        await wait_for_adapter(stub, "math", 3, 1)
        assert replica.adapters["math"][0].owner == "alice"


def held(replica: StandInReplica) -> dict[str, tuple[str, int]]:
    return {name: (spec.owner, spec.policy_version) for name, (spec, _) in replica.adapters.items()}


async def replica_adapters(stub) -> dict[str, tuple[dict[str, int], dict[str, str]]]:
    """Each replica's adapter versions and owners, as the broadcaster reports them."""
    return {r.replica_id: (dict(r.adapter_versions), dict(r.adapter_owners)) for r in (await status(stub)).replicas}


async def remove_adapter(stub, name: str) -> pb2.RemoveAdapterResponse:
    return await stub.RemoveAdapter(pb2.RemoveAdapterRequest(adapter_name=name))


async def test_a_removed_adapter_is_unloaded_from_every_replica_even_those_away_or_late():
    first, second, away, late = StandInReplica(), StandInReplica(), StandInReplica(), StandInReplica()
    first.fail_unloads = 1  # retried with backoff
    async with (
        serving(first) as first_address,
        serving(second) as second_address,
        serving(away) as away_address,
        serving(late) as late_address,
        running_broadcaster(
            replicas=[
                {"replica_id": "a", "address": first_address},
                {"replica_id": "b", "address": second_address},
                {"replica_id": "c", "address": away_address},
            ]
        ) as stub,
    ):
        await publish_adapter(stub, "math", 3, lora_tensors(3), adapter_owner="alice")
        await publish_adapter(stub, "code", 1, lora_tensors(1))
        await wait_for_adapter(stub, "math", 3, 3)
        await wait_for_adapter(stub, "code", 1, 3)
        away.down = True

        async def seen_away() -> bool:
            return (await replica_adapters(stub))["c"] == ({}, {})

        await eventually(seen_away, what="replica c seen away")

        assert (await remove_adapter(stub, "math")).policy_version == 3
        assert dict((await status(stub)).latest_adapter_versions) == {"code": 1}  # at once
        await eventually(lambda: "math" not in first.adapters and "math" not in second.adapters, what="unloads")
        assert first.num_unload_calls == 2 and second.num_unload_calls == 1
        assert held(first) == held(second) == {"code": ("", 1)}
        assert "math" in away.adapters  # it did not answer

        # Back (the same process): unloaded then; a late one holding it (its own copy of that
        # adapter, loaded at start) too, but never an adapter this broadcaster did not remove.
        away.down = False
        late.hold("math", 3, "alice")
        late.hold("mine", 1)
        await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id="late", address=late_address))
        await wait_for_adapter(stub, "code", 1, 4)
        await eventually(lambda: "math" not in away.adapters and "math" not in late.adapters, what="unloads")
        assert held(away) == {"code": ("", 1)} and held(late) == {"code": ("", 1), "mine": ("", 1)}

        # A replica restarted still holding it (loaded back from its disk) gets it unloaded again.
        second.hold("math", 3, "alice")
        second.restart(keep_adapters=True)
        await eventually(lambda: "math" not in second.adapters, what="the restarted replica's copy unloaded")

        async def settled() -> bool:
            state = await replica_adapters(stub)
            return all(
                versions.keys() == {"code"} or versions.keys() == {"code", "mine"} for versions, _ in state.values()
            )

        await eventually(settled, what="no replica reported holding 'math'")
        state = await replica_adapters(stub)
        assert state["late"] == ({"code": 1, "mine": 1}, {})
        assert all(owners == {} for _, owners in state.values())

        # Removing it again, or an adapter never published: NOT_FOUND naming it; a bad name: the field.
        for name in ("math", "nope"):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await remove_adapter(stub, name)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert f"holds no adapter {name!r}" in error.value.details()
            assert error_details(error.value)[0].metadata["adapter_name"] == name
        for name in ("", "../etc", "x" * 65):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await remove_adapter(stub, name)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "adapter_name" in field_violations(error.value)

        # The name starts afresh: any version, any owner; every replica gets the new one.
        await publish_adapter(stub, "math", 0, lora_tensors(7), adapter_owner="bob")
        await eventually(
            lambda: all(held(r).get("math") == ("bob", 0) for r in (first, second, away, late)),
            what="the new 'math' on every replica",
        )
        assert same(late.adapters["math"][1], lora_tensors(7))
        for _, owners in (await replica_adapters(stub)).values():
            assert owners == {"math": "bob"}
        # ... and a restarted replica that lists it cannot tell its copy from the old one: pushed anew.
        first.restart(keep_adapters=True)
        # (A load is counted as it starts: wait for the adapter too.)
        await eventually(lambda: first.num_load_calls == 4 and "math" in first.adapters, what="'math' pushed again")
        assert held(first)["math"] == ("bob", 0) and len(first.adapters) == 2


async def test_a_removed_adapter_stays_removed_when_the_broadcaster_restarts(tmp_path: pathlib.Path):
    store = {"spill_folder": tmp_path / "spill"}
    folder = tmp_path / "spill" / "adapters"
    async with running_broadcaster(store=store) as stub:
        await publish_adapter(stub, "math", 2, lora_tensors(2), adapter_owner="alice")
        await publish_adapter(stub, "code", 1, lora_tensors(1))
        assert (folder / "math").is_dir()
        assert (await remove_adapter(stub, "math")).policy_version == 2
        assert sorted(p.name for p in folder.iterdir()) == [REMOVALS_FILE, "code"]
    # A removal a stop interrupted: renamed aside, not yet deleted.
    spill_rank_8_adapter(folder / ".removed-old-0123" / "v0000000004", version=4)

    replica = StandInReplica()
    replica.hold("old", 4)  # ... which it had been pushed: unloaded all the same
    async with (
        serving(replica) as address,
        running_broadcaster(replicas=[{"replica_id": "r", "address": address}], store=store) as stub,
    ):
        assert dict((await status(stub)).latest_adapter_versions) == {"code": 1}
        assert sorted(p.name for p in folder.iterdir()) == [REMOVALS_FILE, "code"]
        await wait_for_adapter(stub, "code", 1, 1)
        await eventually(lambda: "old" not in replica.adapters, what="the interrupted removal's adapter unloaded")
        assert held(replica) == {"code": ("", 1)}
        await publish_adapter(stub, "math", 0, lora_tensors(5), adapter_owner="bob")
        await wait_for_adapter(stub, "math", 0, 1)
        assert held(replica) == {"code": ("", 1), "math": ("bob", 0)}


async def test_a_removal_outlives_a_broadcaster_restart_and_a_name_published_again_is_served(tmp_path: pathlib.Path):
    """Removed while a replica was away, then the broadcaster restarts on the same spill folder:
    the replica is told to unload the removed adapter once it is back; a name removed and
    published again reaches it in its new form (the old copy never served as the new one)."""
    store = {"spill_folder": tmp_path / "spill"}
    replica = StandInReplica()
    async with serving(replica) as address:
        replicas = [{"replica_id": "r", "address": address}]
        async with running_broadcaster(replicas=replicas, store=store) as stub:
            await publish_adapter(stub, "math", 2, lora_tensors(2), adapter_owner="alice")
            await publish_adapter(stub, "code", 3, lora_tensors(3), adapter_owner="bob")
            await publish_adapter(stub, "chat", 1, lora_tensors(1))
            await wait_for_adapter(stub, "math", 2, 1)
            await wait_for_adapter(stub, "code", 3, 1)
            await wait_for_adapter(stub, "chat", 1, 1)
            replica.down = True

            async def seen_away() -> bool:
                return (await replica_adapters(stub))["r"] == ({}, {})

            await eventually(seen_away, what="the replica seen away")
            for name in ("math", "code"):
                await remove_adapter(stub, name)
            await publish_adapter(stub, "code", 0, lora_tensors(9), adapter_owner="carol")
            assert dict((await status(stub)).latest_adapter_versions) == {"chat": 1, "code": 0}
        # The broadcaster stopped before the replica was back: it still holds both old copies.
        assert held(replica) == {"math": ("alice", 2), "code": ("bob", 3), "chat": ("", 1)}

        replica.down = False
        async with running_broadcaster(replicas=replicas, store=store) as stub:
            assert dict((await status(stub)).latest_adapter_versions) == {"chat": 1, "code": 0}
            await eventually(
                lambda: held(replica) == {"code": ("carol", 0), "chat": ("", 1)},
                what="'math' unloaded, the new 'code' in place of the old",
            )
            assert same(replica.adapters["code"][1], lora_tensors(9))

            async def reported(wanted) -> bool:
                return (await replica_adapters(stub))["r"] == wanted

            await eventually(lambda: reported(({"code": 0, "chat": 1}, {"code": "carol"})), what="status settled")
            # Served from now on, not unloaded again; a removal after the restart counts as any.
            loads, unloads = replica.num_load_calls, replica.num_unload_calls
            await publish_adapter(stub, "chat", 2, lora_tensors(2))
            await wait_for_adapter(stub, "chat", 2, 1)
            assert held(replica) == {"code": ("carol", 0), "chat": ("", 2)}
            assert (replica.num_load_calls, replica.num_unload_calls) == (loads + 1, unloads)
            await remove_adapter(stub, "code")
            await eventually(lambda: held(replica) == {"chat": ("", 2)}, what="the new 'code' unloaded")

        # Restarted again, with the replica holding only what it should: nothing is unloaded.
        unloads = replica.num_unload_calls
        async with running_broadcaster(replicas=replicas, store=store) as stub:
            await eventually(lambda: reported_after_restart(stub, replica), what="the replica listed")
            assert dict((await status(stub)).latest_adapter_versions) == {"chat": 2}
            assert held(replica) == {"chat": ("", 2)} and replica.num_unload_calls == unloads


async def reported_after_restart(stub, replica: StandInReplica) -> bool:
    return (await replica_adapters(stub)).get("r", ({}, {}))[0] == replica.versions()


def spill_rank_8_adapter(path: pathlib.Path, *, version: int) -> None:
    """An adapter version written as a spill folder holds it (without an owner: as spilled
    before adapters had owners)."""
    write_weights(
        path,
        lora_tensors(version).items(),
        policy_version=version,
        weight_format=tensor_pb2.WEIGHT_FORMAT_HF,
        metadata={"rank": 8, "alpha": 16.0},
    )
