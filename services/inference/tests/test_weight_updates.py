"""UpdateWeights against a fresh engine, for the MoE tiny model in float32 and bfloat16 and
the dense one in bfloat16 (dense float32 is checked in test_servicer.py, on its engine): after
an update the service computes what an engine started on those weights computes, and
restoring the original weights restores the original logprobs. On CPU this covers the two
layouts vLLM's own reload leaves stale (see worker_extension.py): prepacked MoE experts, and
the GEMM handle of lm_head, tied to the embedding. Kernel-format weights, delta updates,
folders on a shared filesystem and in shared memory end in exactly the logprobs of full HF
updates of the same weights.

On the same engines: routed experts are returned for MoE models and refused for dense ones."""

import pathlib
import shutil
import tempfile

import grpc
import numpy as np
import pytest
import pytest_asyncio

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.tensors import tensor_from_proto
from primerl_common.weights.manifest import write_weights
from primerl_common.weights.shared_memory import write_raw_weights
from primerl_launcher.tiny_model import FAMILIES

from .serving import (
    TOLERANCE,
    assert_update_matches_a_fresh_engine,
    checkpoint,
    final_output,
    kernel_format,
    perturbed_model,
    policy_version,
    running_service,
    sample,
    status_of,
    tiny_model,
    update_stream,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODELS = [("moe", "float32"), ("dense", "bfloat16"), ("moe", "bfloat16")]


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=MODELS, ids=["-".join(m) for m in MODELS])
async def model(request: pytest.FixtureRequest, model_root: pathlib.Path):
    kind, dtype = request.param
    model_dir = tiny_model(model_root, kind, dtype)
    async with running_service(model=model_dir, dtype=dtype) as served:
        yield kind, dtype, model_dir, served.stub


async def test_an_update_computes_what_a_fresh_engine_computes_and_restoring_restores(
    model, tmp_path_factory: pytest.TempPathFactory
) -> None:
    kind, dtype, model_dir, stub = model
    scratch_dir = tmp_path_factory.mktemp("perturbed") / f"{kind}-{dtype}"

    await assert_update_matches_a_fresh_engine(stub, model_dir, dtype, scratch_dir, tolerance=TOLERANCE[dtype])


async def test_kernel_format_deltas_and_shared_folders_end_in_the_weights_of_full_hf_updates(
    model, tmp_path_factory: pytest.TempPathFactory
) -> None:
    kind, dtype, model_dir, stub = model
    original = checkpoint(model_dir)
    perturbed = perturbed_model(model_dir, tmp_path_factory.mktemp("perturbed") / f"{kind}-{dtype}", seed=2)
    # Layer 1 perturbed, the rest original: whole modules change.
    layer_1 = {name: t for name, t in perturbed.items() if ".layers.1." in name}
    partial = {**original, **layer_1}
    kernel = tensor_pb2.WEIGHT_FORMAT_KERNEL
    folders = tmp_path_factory.mktemp("shared")
    prompts = [list(range(40, 72)), [(7 * i) % 200 + 30 for i in range(24)]]

    shm_root = pathlib.Path(tempfile.mkdtemp(prefix="primerl-test-", dir="/dev/shm"))

    async def update(tensors: dict, *, shared: bool = False, shm: bool = False, **begin) -> list[list[float]]:
        version = await policy_version(stub) + 1
        path = shm_path = None
        fields = {"delta": begin.get("delta", False), "base_policy_version": begin.get("base_policy_version", 0)}
        weight_format = begin.get("weight_format", tensor_pb2.WEIGHT_FORMAT_HF)
        if shared:
            path = folders / f"v{version}"
            write_weights(path, tensors.items(), policy_version=version, weight_format=weight_format, **fields)
        if shm:  # as the weight broadcaster places a version in shared memory: fused parts back to back
            shm_path = shm_root / f"v{version}"
            write_raw_weights(shm_path, tensors.items(), policy_version=version, weight_format=weight_format, **fields)
        await stub.UpdateWeights(update_stream(tensors, version, shared_fs_path=path, shm_path=shm_path, **begin))
        return await sample(stub, prompts, num_tokens=4, seed=5)

    before = await sample(stub, prompts, num_tokens=4, seed=5)
    full_hf = await update(perturbed)
    restored_by_kernel = await update(kernel_format(original), weight_format=kernel)
    kernel_from_folder = await update(kernel_format(perturbed), weight_format=kernel, shared=True)
    partial_hf = await update(partial)
    await update(original)
    base = await policy_version(stub)
    delta_hf = await update(layer_1, delta=True, base_policy_version=base)
    kernel_delta_back = await update(
        {n: t for n, t in kernel_format(original).items() if ".layers.1." in n},
        weight_format=kernel,
        delta=True,
        base_policy_version=base + 1,
        shared=True,
    )
    try:
        hf_from_shm = await update(perturbed, shm=True)
        kernel_from_shm = await update(kernel_format(original), weight_format=kernel, shm=True)
    finally:
        shutil.rmtree(shm_root)

    assert full_hf != before  # the updates take effect
    assert restored_by_kernel == before
    assert kernel_from_folder == full_hf
    assert partial_hf not in (before, full_hf)
    assert delta_hf == partial_hf
    assert kernel_delta_back == before
    assert hf_from_shm == full_hf
    assert kernel_from_shm == before


async def test_routed_experts_come_with_moe_models_only(model) -> None:
    kind, _, _, stub = model
    prompt = list(range(50, 70))
    request = generation_pb2.GenerationInput(
        prompt_token_ids=prompt,
        sampling=generation_pb2.SamplingParams(max_tokens=5, seed=0, ignore_eos=True),
        return_routed_experts=True,
    )
    capabilities = (await stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info.capabilities

    if kind == "dense":
        assert "generate.routed_experts" not in capabilities
        status = await status_of(stub.Generate(inference_pb2.GenerateRequest(input=request)))
        assert status == grpc.StatusCode.FAILED_PRECONDITION
        return
    routed = tensor_from_proto((await final_output(stub, request)).routed_experts).numpy()
    spec = FAMILIES["qwen3-moe"]

    assert "generate.routed_experts" in capabilities
    assert routed.dtype == np.uint8
    assert routed.shape == (len(prompt) + 5, spec.num_hidden_layers, spec.num_experts_per_tok)
    assert routed.max() < spec.num_experts
    assert all(len(set(row)) == spec.num_experts_per_tok for row in routed.reshape(-1, spec.num_experts_per_tok))
