"""Tiny Qwen3 (dense), Qwen3-MoE and GLM-4.5 (`glm4_moe`) models for tests, made locally from a
seed.

The folder looks like a Hugging Face checkpoint of the real models (config.json in the
hub's style, safetensors with the hub's tensor names, a tokenizer and its chat template),
so the trainer, the weight broadcaster and vLLM load it through their ordinary paths;
nothing is downloaded.

The tokenizer is byte-level with no merges: token id == byte value for ids 0..255, so every
ASCII character is one token and a small model can learn character-level tasks such as
reversing a string.

    primerl-make-tiny-model --kind moe --seed 0 --dtype bfloat16 --out /tmp/tiny-moe
    primerl-make-tiny-model --kind glm4-moe --out /tmp/tiny-glm4-moe
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import tokenizers

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "IM_START_TOKEN",
    "IM_START_TOKEN_ID",
    "PAD_TOKEN",
    "PAD_TOKEN_ID",
    "SPECS",
    "STAMP_FILE",
    "TINY_GLM4_MOE_SPEC",
    "VOCAB_SIZE",
    "DType",
    "TinyGlm4MoeSpec",
    "TinyModelSpec",
    "build_tokenizer",
    "main",
    "make_tiny_model",
    "save_tokenizer",
]

NUM_BYTE_TOKENS = 256
PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Right after the bytes, in Qwen's order (151643..151645 there).
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)
PAD_TOKEN_ID, IM_START_TOKEN_ID, EOS_TOKEN_ID = range(NUM_BYTE_TOKENS, NUM_BYTE_TOKENS + len(SPECIAL_TOKENS))
# Bytes + specials, padded with reserved tokens to a multiple of 64 so that every id the
# model can sample is decodable (an untrained model samples all of them).
VOCAB_SIZE = 320

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DType = Literal["float32", "bfloat16"]
STAMP_FILE = "primerl_tiny_model.json"
# No sampling defaults: vLLM would apply them to every request that does not set them.
_GENERATION_CONFIG = {
    "bos_token_id": PAD_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, PAD_TOKEN_ID],
}
# Bump when the bytes written for the same arguments change, so old folders are remade.
_FORMAT_VERSION = 2


@dataclass(frozen=True)
class TinyModelSpec:
    """Shapes of a tiny model; `num_experts == 0` means dense (Qwen3), else Qwen3-MoE."""

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # vLLM's CPU attention supports head sizes 32..512 only.
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    # 0.02 (Qwen's value) gives near-uniform next-token distributions (logit std ~0.3 over
    # 320 tokens) and greedy outputs that repeat one token; 0.1 gives logit std ~1.6,
    # entropy ~4.6 nats and outputs that depend on the context, so logprob and KV-cache
    # tests can tell right from wrong.
    initializer_range: float = 0.1
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        """config.json as the hub's Qwen3 checkpoints write it (read by transformers 4.56+
        and 5.x alike)."""
        config: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_cache": True,
            # Qwen's configs name <|endoftext|> as bos too; the tokenizer adds no bos.
            "bos_token_id": PAD_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "dtype": dtype,
        }
        if self.is_moe:
            config |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
            }
        return config


@dataclass(frozen=True)
class TinyGlm4MoeSpec(TinyModelSpec):
    """GLM-4.5's particulars at the tiny shape: sigmoid routing with a correction bias (drawn
    at random, so that it changes choices) over `n_group` groups, shared experts, dense first
    layers, partial rotary, q/k norm and q/k/v bias; untied head, as GLM's checkpoints."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = True
    attention_bias: bool = True

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        """config.json as GLM-4.5's hub checkpoints write it."""
        config = super().config_dict(dtype)
        for qwen_only in ("num_experts", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"):
            del config[qwen_only]
        for qwen_only in ("use_sliding_window", "sliding_window"):
            del config[qwen_only]
        return config | {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "n_routed_experts": self.num_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "n_shared_experts": self.n_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "partial_rotary_factor": self.partial_rotary_factor,
            "use_qk_norm": self.use_qk_norm,
            "attention_bias": self.attention_bias,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False,
        }


TINY_GLM4_MOE_SPEC = TinyGlm4MoeSpec()
SPECS: dict[str, TinyModelSpec] = {
    "dense": TinyModelSpec(),
    "moe": TinyModelSpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
    "glm4-moe": TINY_GLM4_MOE_SPEC,
}


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> tokenizers.Tokenizer:
    """A byte-level BPE with no merges: id == byte value for 0..255, then the specials,
    then `<|reserved_N|>` up to `vocab_size`."""
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
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)])
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


def save_tokenizer(
    out_dir: str | os.PathLike[str], *, vocab_size: int = VOCAB_SIZE, model_max_length: int = 2048
) -> None:
    """Writes tokenizer.json and tokenizer_config.json (with the chat template)."""
    out = pathlib.Path(out_dir)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
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
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    kind: Literal["dense", "moe", "glm4-moe"],
    seed: int = 0,
    dtype: DType = "float32",
    spec: TinyModelSpec | None = None,
) -> pathlib.Path:
    """Writes a tiny model into `out_dir` and returns its path.

    Idempotent: a folder whose stamp records the same arguments is returned untouched.
    The weights are drawn in float32 from `seed` and then cast, so the bfloat16 model of a
    seed is the float32 one rounded."""
    if kind not in SPECS:
        raise ValueError(f"kind must be one of {sorted(SPECS)}, got {kind!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    spec = SPECS[kind] if spec is None else spec
    if spec.is_moe != (kind != "dense"):
        raise ValueError(f"spec has num_experts={spec.num_experts}, which does not fit kind={kind!r}")
    if isinstance(spec, TinyGlm4MoeSpec) != (kind == "glm4-moe"):
        raise ValueError(f"a {type(spec).__name__} does not fit kind={kind!r}")

    out = pathlib.Path(out_dir)
    stamp = {
        "format_version": _FORMAT_VERSION,
        "kind": kind,
        "seed": seed,
        "dtype": dtype,
        "spec": dataclasses.asdict(spec),
    }
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
        save_tokenizer(staging, vocab_size=spec.vocab_size, model_max_length=spec.max_position_embeddings)
        for path in sorted(staging.iterdir()):
            # save_pretrained writes through a private (0600) temp file; services that
            # run as another user (containers) must be able to read the model.
            path.chmod(0o644)
            os.replace(path, out / path.name)
    _write_json(out / STAMP_FILE, stamp)
    return out


def _save_weights(out: pathlib.Path, spec: TinyModelSpec, *, seed: int, dtype: DType) -> None:
    import torch
    from transformers import (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config_dict = spec.config_dict("float32")
    if isinstance(spec, TinyGlm4MoeSpec):
        config, model_cls = Glm4MoeConfig.from_dict(config_dict), Glm4MoeForCausalLM
    elif spec.is_moe:
        config, model_cls = Qwen3MoeConfig.from_dict(config_dict), Qwen3MoeForCausalLM
    else:
        config, model_cls = Qwen3Config.from_dict(config_dict), Qwen3ForCausalLM
    # The model's own init draws from the global generator: fork it so that the caller's
    # random state is left as it was.
    # On the CPU whatever the caller's default device: the draw differs per device.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = model_cls(config)
            # transformers zero-fills the pad token's embedding row, but the policy
            # samples <|endoftext|> and the trainer has no padding index: a zero row
            # sends ~1000x gradients through RMSNorm. Draw it like the others.
            embedding = model.get_input_embeddings().weight
            embedding.data[PAD_TOKEN_ID].normal_(0.0, config.initializer_range)
            # GLM's routers start with a zero correction bias; a random one makes it count.
            correction_biases = {
                name: buffer.normal_(0.0, config.initializer_range)
                for name, buffer in model.named_buffers()
                if name.endswith("e_score_correction_bias")
            }
    model.to(getattr(torch, dtype))
    # Kept in float32 whatever the dtype, as the hub's GLM checkpoints store them.
    for name, bias in correction_biases.items():
        module_name, _, buffer_name = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(buffer_name, bias)
    # save_pretrained writes the hub's tensor names (per-expert `experts.N.gate_proj`
    # rather than transformers 5's fused in-memory experts); its config is replaced.
    model.save_pretrained(out)
    for generated in ("config.json", "generation_config.json"):
        (out / generated).unlink(missing_ok=True)


def _read_stamp(out: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / STAMP_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


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
        description="Write a tiny random Qwen3 (dense), Qwen3-MoE or GLM-4.5 model with a byte-level "
        "tokenizer into a folder, in Hugging Face format.",
    )
    parser.add_argument("--kind", choices=sorted(SPECS), required=True)
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="folder to write")
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out, kind=args.kind, seed=args.seed, dtype=args.dtype)
    print(path)


if __name__ == "__main__":
    main()
