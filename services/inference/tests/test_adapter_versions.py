"""Policy versions and owners of LoRA adapters through the service (a real vLLM engine, tiny
dense model, float32, LoRA on, behind a real gRPC server): a newer version replaces an adapter
in place under running requests, whose later tokens carry it; stale versions are refused;
requests with an adapter are checked and tagged with the adapter's version, those without with
the base's. An adapter's owner is reported, kept by replacements, and the only caller (with
operators) its requests are served to."""

import pathlib

import grpc
import pytest
import pytest_asyncio
import torch
from google.rpc import error_details_pb2

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common import security
from primerl_common.errors import InvalidArgument, error_details, field_violations
from primerl_common.lora import check_adapter_name
from primerl_inference.engine_versions import engine_version_stamp, parse_engine_version_stamp
from primerl_inference.servicer import generate_request_from_proto

from .serving import (
    Served,
    checkpoint,
    final_output,
    perturbed_model,
    policy_version,
    running_service,
    update_weights,
)
from .test_adapters import adapter_spec, adapter_stream, adapter_tensors, generation_input

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = list(range(32, 72))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served_lora(model_dir: pathlib.Path):
    async with running_service(model=model_dir, dtype="float32", enable_lora=True, max_lora_rank=8) as served:
        yield served


@pytest.fixture
def stub(served_lora: Served):
    return served_lora.stub


async def load_adapter(stub, name: str, version: int, seed: int) -> inference_pb2.LoadAdapterResponse:
    return await stub.LoadAdapter(adapter_stream(adapter_spec(name, policy_version=version), adapter_tensors(seed)))


async def refused_load(stub, name: str, version: int, tensors: dict[str, torch.Tensor]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.LoadAdapter(adapter_stream(adapter_spec(name, policy_version=version), tensors))
    return error.value


async def refused_load_of(stub, spec: inference_pb2.AdapterSpec) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.LoadAdapter(adapter_stream(spec, adapter_tensors(seed=9)))
    return error.value


def reasons(error: grpc.aio.AioRpcError) -> list[str]:
    return [d.reason for d in error_details(error) if isinstance(d, error_details_pb2.ErrorInfo)]


async def test_the_version_stamp_reads_back() -> None:
    stamp = engine_version_stamp(7, {"math-v2": 3, "code_1.5": 12})

    assert engine_version_stamp(7, {}) == "7"  # what vLLM is told without adapters, as before
    versions = parse_engine_version_stamp(stamp)
    assert (versions.policy_version(), versions.policy_version("math-v2"), versions.policy_version("code_1.5")) == (
        7,
        3,
        12,
    )
    with pytest.raises(RuntimeError):
        versions.policy_version("absent")
    for name in ("", "a;b", "a=1", "org/math", "with space", "x" * 65):
        with pytest.raises(InvalidArgument, match=r"spec\.name"):
            check_adapter_name(name, field="spec.name")


async def test_a_newer_version_replaces_the_adapter_under_a_running_request(
    stub,
) -> None:
    v2 = adapter_tensors(seed=1)
    await load_adapter(stub, "policy", version=1, seed=0)
    long_input = generation_pb2.GenerationInput(
        prompt_token_ids=PROMPT,
        sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=64, seed=7, ignore_eos=True),
        stream=generation_pb2.StreamOptions(every_n_tokens=4),
        lora_adapter="policy",
    )
    responses = aiter(stub.Generate(inference_pb2.GenerateRequest(input=long_input)))
    outputs = [(await anext(responses)).output]  # running, at version 1
    with pytest.raises(grpc.aio.AioRpcError) as unload_in_use:
        await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="policy"))
    replaced = await stub.LoadAdapter(adapter_stream(adapter_spec("policy", policy_version=2), v2))
    outputs += [response.output async for response in responses]
    after = await final_output(stub, generation_input("policy"))
    # The same sample from version 2 loaded afresh (not in place), under another name.
    await stub.LoadAdapter(adapter_stream(adapter_spec("fresh", policy_version=2), v2))
    fresh = await final_output(stub, generation_input("fresh"))
    await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="fresh"))
    await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="policy"))

    assert unload_in_use.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert replaced.replaced
    versions = [v for output in outputs for v in output.policy_versions]
    assert outputs[-1].finished and outputs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert len(versions) == 64
    assert versions == sorted(versions) and set(versions) == {1, 2}  # 1 up to the swap, 2 after
    assert set(after.policy_versions) == {2}
    assert list(after.token_ids) == list(fresh.token_ids)
    assert list(after.logprobs) == pytest.approx(list(fresh.logprobs), abs=1e-6)


async def test_a_stale_or_failed_replacement_leaves_the_adapter_serving(stub) -> None:
    await load_adapter(stub, "stale", version=3, seed=2)
    before = await final_output(stub, generation_input("stale"))

    stale = [await refused_load(stub, "stale", version, adapter_tensors(seed=3)) for version in (2, 3)]
    broken = await refused_load(stub, "stale", 4, {"bogus.lora_A.weight": torch.zeros(8, 8)})
    bad_name = await refused_load(stub, "stale;4", 4, adapter_tensors(seed=3))
    after = await final_output(stub, generation_input("stale"))
    listed = (await stub.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
    await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="stale"))

    for error in stale:
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reasons(error) == ["ADAPTER_VERSION_NOT_NEWER"]
        assert "not newer than the loaded 3" in error.details()
    assert broken.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec" in field_violations(broken)
    assert bad_name.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.name" in field_violations(bad_name)
    assert [(a.name, a.policy_version) for a in listed] == [("stale", 3)]
    assert list(after.token_ids) == list(before.token_ids) and set(after.policy_versions) == {3}
    assert list(after.logprobs) == pytest.approx(list(before.logprobs), abs=1e-6)


async def test_min_policy_version_and_load_reports_are_per_adapter(stub) -> None:
    await load_adapter(stub, "tenant", version=5, seed=4)
    await stub.LoadAdapter(adapter_stream(adapter_spec("unversioned"), adapter_tensors(seed=5)))
    base = await policy_version(stub)

    served = await final_output(stub, generation_input("tenant", min_policy_version=5))
    too_new = inference_pb2.GenerateRequest(input=generation_input("tenant", min_policy_version=6))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.Generate(too_new):
            pass
    load = (await stub.GetLoad(inference_pb2.GetLoadRequest())).load
    listed = (await stub.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
    # Unversioned adapters are replaced at will.
    assert (await stub.LoadAdapter(adapter_stream(adapter_spec("unversioned"), adapter_tensors(seed=6)))).replaced
    for name in ("tenant", "unversioned"):
        await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=name))
    unloaded = (await stub.GetLoad(inference_pb2.GetLoadRequest())).load

    assert set(served.policy_versions) == {5}
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reasons(refused.value) == ["POLICY_VERSION_TOO_OLD"]
    assert "adapter 'tenant' at policy version 5" in refused.value.details()
    assert load.policy_version == base and dict(load.adapter_versions) == {"tenant": 5, "unversioned": 0}
    assert sorted((a.name, a.policy_version) for a in listed) == [("tenant", 5), ("unversioned", 0)]
    assert not unloaded.adapter_versions


async def test_a_full_update_keeps_adapter_versions_and_tags_base_requests_with_its_own(
    stub, model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    perturbed = perturbed_model(model_dir, tmp_path_factory.mktemp("perturbed") / "dense", seed=2)
    await load_adapter(stub, "kept", version=7, seed=0)
    version = await policy_version(stub)

    await update_weights(stub, perturbed)
    load = (await stub.GetLoad(inference_pb2.GetLoadRequest())).load
    base = await final_output(stub, generation_input())
    with_adapter = await final_output(stub, generation_input("kept"))
    await update_weights(stub, checkpoint(model_dir))
    await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="kept"))

    assert load.policy_version == version + 1 and dict(load.adapter_versions) == {"kept": 7}
    assert set(base.policy_versions) == {version + 1}
    assert set(with_adapter.policy_versions) == {7}


async def test_an_adapter_owner_is_reported_and_kept_by_replacements(stub) -> None:
    await stub.LoadAdapter(adapter_stream(adapter_spec("run-a", policy_version=1, owner="alice"), adapter_tensors(0)))
    await load_adapter(stub, "shared", version=1, seed=1)
    before = await final_output(stub, generation_input("run-a"))

    other = await refused_load_of(stub, adapter_spec("run-a", policy_version=2, owner="bob"))
    unowned = await refused_load_of(stub, adapter_spec("run-a", policy_version=2))
    listed = (await stub.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
    load = (await stub.GetLoad(inference_pb2.GetLoadRequest())).load
    after = await final_output(stub, generation_input("run-a"))
    same_owner = await stub.LoadAdapter(
        adapter_stream(adapter_spec("run-a", policy_version=2, owner="alice"), adapter_tensors(2))
    )
    for name in ("run-a", "shared"):
        await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=name))
    unloaded = (await stub.GetLoad(inference_pb2.GetLoadRequest())).load

    for error in (other, unowned):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reasons(error) == ["ADAPTER_OWNER_MISMATCH"]
    assert "owned by 'alice'" in other.details() and "'bob'" in other.details()
    assert "owned by 'alice'" in unowned.details() and "no one" in unowned.details()
    assert sorted((a.name, a.policy_version, a.owner) for a in listed) == [("run-a", 1, "alice"), ("shared", 1, "")]
    assert dict(load.adapter_owners) == {"run-a": "alice"}  # only adapters that have an owner
    assert dict(load.adapter_versions) == {"run-a": 1, "shared": 1}
    assert list(after.token_ids) == list(before.token_ids) and set(after.policy_versions) == {1}
    assert same_owner.replaced
    assert not unloaded.adapter_owners


async def test_an_owned_adapter_serves_its_owner_operators_and_routers_only(served_lora: Served) -> None:
    """In plaintext every caller is LOCAL (all roles): the engine is asked as the identities an
    mTLS replica would find (the servicer passes `caller_of(context)`)."""
    stub, engine = served_lora.stub, served_lora.engine
    await stub.LoadAdapter(adapter_stream(adapter_spec("run-b", policy_version=3, owner="alice"), adapter_tensors(3)))
    await load_adapter(stub, "open", version=1, seed=4)
    alice = security.Caller(name="alice", roles=frozenset({security.TENANT}))
    bob = security.Caller(name="bob", roles=frozenset({security.TENANT}))
    operator = security.Caller(name="ops", roles=frozenset({security.OPERATOR}))
    # The router forwards its callers' requests under its own identity, having checked the owner.
    router = security.Caller(name="router", roles=frozenset({security.ROUTER}))

    async def final(adapter: str, caller: security.Caller, **fields: object) -> list[int]:
        request = generate_request_from_proto(generation_input(adapter, **fields))
        chunks = [chunk async for chunk in engine.generate(request, caller=caller)]
        return chunks[-1].policy_versions

    refusals = []
    # A version the adapter does not have yet: refused as not bob's all the same (nothing about
    # the adapter is told to him).
    for fields in ({}, {"min_policy_version": 9}):
        with pytest.raises(security.PermissionDenied) as refused:
            await final("run-b", bob, **fields)
        refusals.append(refused.value)
    num_unfinished = engine.llm.get_num_unfinished_requests()
    served = {
        name: await final("run-b", caller) for name, caller in (("alice", alice), ("ops", operator), ("router", router))
    }
    served["local"] = await final("run-b", security.LOCAL)
    open_to_bob = await final("open", bob)
    through_the_service = await final_output(stub, generation_input("run-b"))  # plaintext: LOCAL
    for name in ("run-b", "open"):
        await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=name))

    for refusal in refusals:
        assert refusal.reason == "NOT_ADAPTER_OWNER"
        assert "adapter 'run-b' is not bob" in refusal.message
    assert num_unfinished == 0  # refused before anything reached vLLM
    assert all(set(versions) == {3} for versions in served.values())
    assert set(open_to_bob) == {1}
    assert set(through_the_service.policy_versions) == {3}
