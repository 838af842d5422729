"""Tiny models of each supported family for tests, made locally from a seed: Qwen3 (dense),
Qwen3-MoE, GLM-4.5 (`glm4_moe`), MiniMax-M2 (`minimax_m2`), ..., and the multimodal Qwen3-VL
(`qwen3_vl`, `qwen3_vl_moe`: a vision tower in front of the language model). This module builds
and saves them (the tokenizer, the weights, the configs, the stamp file) and is the command line.

The folder looks like a Hugging Face checkpoint of the real models (config.json in the
hub's style, safetensors with the hub's tensor names, a tokenizer and its chat template;
the Qwen3-VL families also the image and video processors' configs and a chat template that
places images), so the trainer, the weight broadcaster and vLLM load it through their
ordinary paths; nothing is downloaded.

A family is one frozen dataclass deriving from `TinyModelSpec` (its shapes, its config.json
as the hub writes it, the transformers class that draws its random weights) and one entry in
`FAMILIES`, both in `primerl_launcher.tiny_model_specs` (with the token ids and chat templates);
this module re-exports their public names.

The tokenizer is byte-level with no merges: token id == byte value for ids 0..255, so every
ASCII character is one token and a small model can learn character-level tasks such as
reversing a string.

    primerl-make-tiny-model --family qwen3-moe --seed 0 --dtype bfloat16 --out /tmp/tiny-moe
    primerl-make-tiny-model --family glm4-moe --out /tmp/tiny-glm4-moe
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile
from typing import TYPE_CHECKING, Any, Literal

from primerl_launcher import tiny_model_specs
from primerl_launcher.tiny_model_specs import *  # noqa: F403
from primerl_launcher.tiny_model_specs import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    FAMILIES,
    KINDS,
    NUM_BYTE_TOKENS,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    VISION_CHAT_TEMPLATE,
    VISION_TOKENS,
    VOCAB_SIZE,
    DType,
    TinyModelSpec,
    _json_text,
)

if TYPE_CHECKING:
    import tokenizers

# The specs' public names (families, token ids, chat templates) are this module's too: callers
# import them from here.
__all__ = [
    *tiny_model_specs.__all__,
    "STAMP_FILE",
    "build_tokenizer",
    "main",
    "make_tiny_model",
    "save_tokenizer",
]

STAMP_FILE = "primerl_tiny_model.json"
# No sampling defaults: vLLM would apply them to every request that does not set them.
_GENERATION_CONFIG = {
    "bos_token_id": PAD_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, PAD_TOKEN_ID],
}
# Bump when the bytes written for the same arguments change, so old folders are remade.
_FORMAT_VERSION = 3


def build_tokenizer(vocab_size: int = VOCAB_SIZE, *, vision_tokens: bool = False) -> tokenizers.Tokenizer:
    """A byte-level BPE with no merges: id == byte value for 0..255, then the specials,
    then `<|reserved_N|>` up to `vocab_size`; with `vision_tokens` the first four of those are
    named VISION_TOKENS instead (the others keep their names)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    num_fixed = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
    if vocab_size < num_fixed:
        raise ValueError(f"vocab_size must be at least {num_fixed}, got {vocab_size}")
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges it would only cost time, the tokens are the same.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - num_fixed)]
    if vision_tokens:
        if len(reserved) < len(VISION_TOKENS):
            raise ValueError(f"vocab_size must be at least {num_fixed + len(VISION_TOKENS)} with vision tokens")
        reserved[: len(VISION_TOKENS)] = VISION_TOKENS
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)])
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


def save_tokenizer(
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int = VOCAB_SIZE,
    model_max_length: int = 2048,
    vision_tokens: bool = False,
) -> None:
    """Writes tokenizer.json and tokenizer_config.json (with the chat template: with
    `vision_tokens`, those named and VISION_CHAT_TEMPLATE)."""
    out = pathlib.Path(out_dir)
    build_tokenizer(vocab_size, vision_tokens=vision_tokens).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        # The generic class loads tokenizer.json as written; a Qwen2Tokenizer would
        # rebuild the pre-tokenizer with Qwen's own settings.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": VISION_CHAT_TEMPLATE if vision_tokens else CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    family: str | None = None,
    kind: Literal["dense", "moe"] | None = None,
    seed: int = 0,
    dtype: DType = "float32",
    spec: TinyModelSpec | None = None,
) -> pathlib.Path:
    """Writes a tiny model of `family` (a key of FAMILIES; or `kind`, the older name of the
    Qwen3 ones: dense, moe) into `out_dir` and returns its path. `spec` replaces the family's
    default shape and must be of its class.

    Idempotent: a folder whose stamp records the same arguments is returned untouched.
    The weights are drawn in float32 from `seed` and then cast, so the bfloat16 model of a
    seed is the float32 one rounded."""
    if (family is None) == (kind is None):
        raise ValueError(f"give one of family and kind, got family={family!r} and kind={kind!r}")
    if kind is not None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
        family = KINDS[kind]
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    default = FAMILIES[family]
    spec = default if spec is None else spec
    if type(spec) is not type(default):
        raise ValueError(f"a {type(spec).__name__} does not fit family={family!r}: give a {type(default).__name__}")

    out = pathlib.Path(out_dir)
    stamp = {
        "format_version": _FORMAT_VERSION,
        "family": family,
        "seed": seed,
        "dtype": dtype,
        # As the stamp file reads back (tuple fields as lists).
        "spec": json.loads(json.dumps(dataclasses.asdict(spec))),
    }
    if spec.files_revision:
        stamp["files_revision"] = spec.files_revision
    if _read_stamp(out) == stamp:
        return out

    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP_FILE).unlink(missing_ok=True)
    # Built beside the target and moved in file by file, the stamp last: a crash or a
    # concurrent maker never leaves a stamped folder with partial files.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staging = pathlib.Path(tmp)
        _save_weights(staging, spec, seed=seed, dtype=dtype)
        _write_json(staging / "config.json", spec.config_dict(dtype))
        _write_json(staging / "generation_config.json", _GENERATION_CONFIG)
        save_tokenizer(
            staging,
            vocab_size=spec.vocab_size,
            model_max_length=spec.max_position_embeddings,
            vision_tokens=spec.vision_tokens,
        )
        for name, text in spec.processor_files().items():
            (staging / name).write_text(text)
        for path in sorted(staging.iterdir()):
            # save_pretrained writes through a private (0600) temp file; services that
            # run as another user (containers) must be able to read the model.
            path.chmod(0o644)
            os.replace(path, out / path.name)
    _write_json(out / STAMP_FILE, stamp)
    return out


def _save_weights(out: pathlib.Path, spec: TinyModelSpec, *, seed: int, dtype: DType) -> None:
    import torch
    import transformers

    model_cls = getattr(transformers, spec.model_class)
    config = model_cls.config_class.from_dict(spec.config_dict("float32"))
    # The model's own init draws from the global generator: fork it so that the caller's
    # random state is left as it was.
    # On the CPU whatever the caller's default device: the draw differs per device.
    # Multimodal configs keep it in their text config (get_text_config: the config itself otherwise).
    std = config.get_text_config().initializer_range
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = model_cls(config)
            # transformers zero-fills the pad token's embedding row, but the policy
            # samples <|endoftext|> and the trainer has no padding index: a zero row
            # sends ~1000x gradients through RMSNorm. Draw it like the others.
            embedding = model.get_input_embeddings().weight
            embedding.data[PAD_TOKEN_ID].normal_(0.0, std)
            float32_buffers = {
                name: buffer.normal_(0.0, std)
                for name, buffer in model.named_buffers()
                if name.endswith(spec.float32_buffers)
            }
            for name, parameter in model.named_parameters():
                if name.endswith(spec.random_parameters):
                    parameter.data.normal_(0.0, std)
    model.to(getattr(torch, dtype))
    for name, buffer in float32_buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(buffer_name, buffer)
    # save_pretrained writes the hub's tensor names (per-expert `experts.N.gate_proj`
    # rather than transformers 5's fused in-memory experts); its config is replaced.
    model.save_pretrained(out)
    for generated in ("config.json", "generation_config.json"):
        (out / generated).unlink(missing_ok=True)
    if spec.transposed_tensors:
        _transpose_saved_tensors(out, spec.transposed_tensors)


def _transpose_saved_tensors(out: pathlib.Path, suffixes: tuple[str, ...]) -> None:
    """Swaps the last two dims of the saved tensors whose names end with `suffixes` (one
    model.safetensors: the tiny models are a single shard)."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith(suffixes):
            tensors[name] = tensor.transpose(-1, -2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _read_stamp(out: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / STAMP_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(_json_text(data))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one the ByteLevel pre-tokenizer
    emits (kept here so the tokenizer does not depend on transformers)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="primerl-make-tiny-model",
        description="Write a tiny random model of one family with a byte-level tokenizer into a "
        "folder, in Hugging Face format.",
    )
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="folder to write")
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out, family=args.family, seed=args.seed, dtype=args.dtype)
    print(path)


if __name__ == "__main__":
    main()
