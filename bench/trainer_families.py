"""The model families of bench/trainer_throughput.py's --family mode, and how the benchmark sizes a model.

FAMILIES: each family at its hub widths (Family: its hub config, its tiny --smoke widths, its
activation estimate for the fit, which attention each implementation takes; a hybrid family adds
its sequence length, its least layer count and its layer pattern), with the helpers that list a
family's layers (layer_types, a Nemotron-H pattern; layer_kinds). The sizing: family_config (a
family's config at a layer count), parameter_counts and flops_per_token (on transformers' model
built on the meta device; the MFU of both the --kinds and the --family modes), and the fit of
--layers auto: activation_bytes, predicted_peak_bytes and fit_layers. No module of the bench is
imported here: trainer_throughput.py imports these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def no_layer_fields(num_layers: int) -> dict[str, Any]:
    return {}


def alternating_sliding_and_full(num_layers: int) -> dict[str, Any]:
    """GPT-OSS's layer_types: sliding-window attention on even layers, full on odd ones."""
    return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]}


def full_attention_every_fourth(num_layers: int) -> dict[str, Any]:
    """Qwen3.5's layer_types (transformers' rule for full_attention_interval 4): Gated DeltaNet,
    with full attention on every fourth layer."""
    return {"layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]}


# Nemotron-3-Nano-30B-A3B's hybrid_override_pattern (M Mamba-2, E MoE, * attention): 23 M, 23 E, 6 *.
NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
# transformers' layers_block_type names of the pattern's letters.
NEMOTRON_H_KINDS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def nemotron_3_nano_prefix(num_layers: int) -> dict[str, Any]:
    """The hub pattern's first `num_layers` layers."""
    return {"hybrid_override_pattern": NEMOTRON_3_NANO_PATTERN[:num_layers]}


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each layer's kind as transformers names it (layer_types, or a Nemotron-H pattern's
    layers_block_type); full_attention for a family without either."""
    if config.get("hybrid_override_pattern"):
        return [NEMOTRON_H_KINDS[c] for c in config["hybrid_override_pattern"]]
    return list(config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"])


@dataclass(frozen=True)
class Family:
    """A model family benchmarked at its hub widths.

    config: the hub's config.json (what both implementations read); its num_hidden_layers is the
    hub's depth, the most layers the fit takes. layer_fields: the fields that list every layer
    (layer_types, a hybrid pattern) for a given layer count; min_layers: the fewest layers, at
    least one of every kind. smoke: --smoke's tiny widths. activation_bytes_per_token_layer:
    what transformers' model holds for the backward per token and layer in bf16, an estimate
    for fit_layers (the table's peak GiB checks it), one figure or one per layer kind
    (layer_kinds); own_activation_bytes_per_token_layer: the own model's (None: the same).
    hf_attention: transformers' attention on CUDA (None: its default); own_attention: the own
    model's backend (common/attention.py)."""

    config: dict[str, Any]
    smoke: dict[str, Any]
    activation_bytes_per_token_layer: int | dict[str, int]
    own_activation_bytes_per_token_layer: int | dict[str, int] | None = None
    seq_len: int = 4096
    min_layers: int = 2
    layer_fields: Callable[[int], dict[str, Any]] = no_layer_fields
    hf_attention: str | None = None
    own_attention: str = "sdpa"


FAMILIES: dict[str, Family] = {
    # GLM-4.5-Air (zai-org/GLM-4.5-Air's config.json): 128 routed experts of 1408 (top-8, sigmoid
    # scores with correction bias, one group), one shared expert, the first layer dense (10944),
    # 96 query heads / 8 KV heads of 128 with q/k/v bias, RoPE on half of each head.
    # Activations per token and MoE layer: attention ~60k bf16 values (norms, q/k/v before and
    # after RoPE, output, projections), experts 8 x (4096 in + 2816 gate/up + 1408 + 2 x 4096
    # out) + the shared expert ~145k: ~205k values, 410 KB; 460 KB with slack.
    "glm4_moe": Family(
        config={
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "vocab_size": 151552,
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": False,
            "n_routed_experts": 128,
            "num_experts_per_tok": 8,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rope_theta": 1_000_000,
            "rope_scaling": None,
            "rms_norm_eps": 1e-5,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        smoke={
            "vocab_size": 1000,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
        },
        activation_bytes_per_token_layer=460_000,
    ),
    # GPT-OSS-20B (openai/gpt-oss-20b's config.json, experts in bf16 rather than MXFP4): 32
    # experts of 2880 (top-4, softmax over the top-k, expert biases, clamped SwiGLU), 64 query
    # heads / 8 KV heads of 64 with bias and a learned sink per head, sliding window 128 on
    # every other layer, YaRN RoPE (factor 32 over 4096). transformers' default attention for it
    # is eager (no SDPA: the sinks); flex_attention is the fused one it offers on CUDA.
    # Activations per token and layer: attention ~30k values, experts 4 x (2880 in + 5760
    # gate/up + ~2 x 2880 clamped/gated + 2 x 2880 out) ~80k: ~110k values, 220 KB; 300 KB with slack.
    "gpt_oss": Family(
        config={
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "experts_per_token": 4,
            "sliding_window": 128,
            "attention_bias": True,
            "swiglu_limit": 7.0,
            "hidden_act": "silu",
            "initial_context_length": 4096,
            "max_position_embeddings": 131072,
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
            "rms_norm_eps": 1e-5,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": False,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        smoke={
            "vocab_size": 1000,
            "hidden_size": 128,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "experts_per_token": 2,
            "sliding_window": 16,
        },
        activation_bytes_per_token_layer=300_000,
        layer_fields=alternating_sliding_and_full,
        hf_attention="flex_attention",
        own_attention="flex",
    ),
    # Qwen3.5-35B-A3B (Qwen/Qwen3.5-35B-A3B's text_config as recalled, without network here; every
    # width equals transformers' Qwen3_5MoeTextConfig defaults, which were read): 2048 wide, 40
    # layers, Gated DeltaNet on three of every four (16 key heads and 32 value heads of 128,
    # convolution 4), gated attention on every fourth (16 query heads / 2 KV heads of 256, RoPE on
    # a quarter of each head), 256 routed experts of 512 (top-8) and a gated shared expert of 512
    # in every layer, vocabulary 248,320, untied. Not verified against the hub file: rope_theta
    # 10,000,000 (transformers' default is 10,000; the Qwen3.5 dense models' Megatron recipes
    # use 1e7) and the multimodal rotary sections, which equal plain RoPE on text. The benchmark
    # takes the text model (qwen3_5_moe_text), the language model of the hub's multimodal one.
    # Both DeltaNets take fla's chunked kernels on CUDA where fla imports (transformers through
    # its kernel fallback, the own model through gated_delta_net.py), else their PyTorch paths.
    "qwen3_5_moe": Family(
        config={
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 248320,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "full_attention_interval": 4,
            "hidden_act": "silu",
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        smoke={
            "vocab_size": 1000,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
        # Saved for the backward per token and layer, measured on the CPU in bf16 at 512 tokens
        # (saved-tensor hooks, the own model uncompiled, both DeltaNets on their PyTorch chunked
        # path and attention on the CPU's SDPA): DeltaNet + MoE hf 510 KB, own 567; attention +
        # MoE hf 228 KB, own 319. Upper bounds on CUDA, where fla's kernels and compiled blocks
        # hold less.
        activation_bytes_per_token_layer={"linear_attention": 520_000, "full_attention": 240_000},
        own_activation_bytes_per_token_layer={"linear_attention": 570_000, "full_attention": 320_000},
        seq_len=16384,
        min_layers=4,
        layer_fields=full_attention_every_fourth,
    ),
    # Nemotron-3-Nano-30B-A3B (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json as recalled
    # and as a third-party port transcribes it; 52 layers of 23 Mamba-2, 23 MoE and 6 attention
    # layers, 128 experts + 1 shared, top-6, are also in NVIDIA's model card): 2688 wide;
    # Mamba-2 with 64 heads of 64 (inner 4096), state 128, 8 groups, convolution 4 with bias,
    # chunk 128; 128 routed relu^2 experts of 1856 (top-6, sigmoid scores with correction bias,
    # one group, normalised, scaled by 2.5) and a shared one of 3712; attention 32 query heads / 2
    # KV heads of 128 without positions; vocabulary 131,072, untied. Not verified against the hub
    # file: the exact pattern string (its counts are), the dense intermediate_size 1856 (unused:
    # no '-' layer) and the time-step fields. The pattern's first six layers hold every kind
    # (MEMEM*), hence min_layers 6. Both Mamba-2s run their PyTorch chunked scans where mamba-ssm
    # and causal-conv1d do not import (the device image).
    "nemotron_h": Family(
        config={
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "vocab_size": 131072,
            "hidden_size": 2688,
            "intermediate_size": 1856,
            "num_hidden_layers": len(NEMOTRON_3_NANO_PATTERN),
            "hybrid_override_pattern": NEMOTRON_3_NANO_PATTERN,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mamba_num_heads": 64,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
            "chunk_size": 128,
            "expand": 2,
            "use_conv_bias": True,
            "mamba_proj_bias": False,
            "mamba_hidden_act": "silu",
            "time_step_min": 0.001,
            "time_step_max": 0.1,
            "time_step_floor": 1e-4,
            "n_routed_experts": 128,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 1856,
            "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": 3712,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "use_bias": False,
            "layer_norm_epsilon": 1e-5,
            "residual_in_fp32": False,
            "num_nextn_predict_layers": 0,
            "max_position_embeddings": 262144,
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        smoke={
            "vocab_size": 1000,
            "hidden_size": 128,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 16,
            "chunk_size": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 64,
        },
        # Saved for the backward per token and layer, measured on the CPU in bf16 at 512 tokens
        # (saved-tensor hooks, the own model uncompiled), with slack: Mamba-2 (both in PyTorch:
        # chunk-by-chunk [C, C] float32 products per head, 32 KB a token each) hf 532 KB, own 495;
        # MoE 162 KB both; attention hf 44 KB, own 93 (the CPU's SDPA).
        activation_bytes_per_token_layer={"linear_attention": 600_000, "moe": 200_000, "full_attention": 60_000},
        own_activation_bytes_per_token_layer={"linear_attention": 560_000, "moe": 200_000, "full_attention": 110_000},
        seq_len=16384,
        min_layers=6,
        layer_fields=nemotron_3_nano_prefix,
    ),
}


def family_config(family: Family, num_layers: int, *, smoke: bool) -> dict[str, Any]:
    config = family.config | family.layer_fields(num_layers) | {"num_hidden_layers": num_layers}
    return config | (family.smoke if smoke else {})


def meta_model(config: dict[str, Any]) -> torch.nn.Module:
    """transformers' model of `config` on the meta device (no memory, no initialisation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def parameter_counts(config: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, the active ones a token passes through). Active: every matrix but the
    embedding lookup (the vocabulary projection counts, tied or not); stacked experts' tensors
    ([experts, ...], named `.experts.`) count top_k / experts of theirs."""
    model = meta_model(config)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    top_k = config.get("num_experts_per_tok", 0)
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if param.ndim < 2 or (param is embedding and param is not head):
            continue
        active += param.numel() // param.shape[0] * top_k if ".experts." in name else param.numel()
    return total, active


def flops_per_token(config: dict[str, Any], seq_len: int) -> float:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layer_types = layer_kinds(config)
    window = config.get("sliding_window") or seq_len
    mean_keys = {
        "full_attention": seq_len / 2,
        # query i sees min(i + 1, window) keys (itself included)
        "sliding_attention": sum(min(i + 1, window) for i in range(seq_len)) / seq_len,
    }
    attention = sum(6 * heads * head_dim * mean_keys.get(kind, 0.0) for kind in layer_types)
    return 6 * parameter_counts(config)[1] + attention


def activation_bytes(per_token_layer: int | dict[str, int], config: dict[str, Any], seq_len: int) -> float:
    per_layer = [per_token_layer] * config["num_hidden_layers"] if isinstance(per_token_layer, int) else [
        per_token_layer[kind] for kind in layer_kinds(config)
    ]  # fmt: skip
    return seq_len * sum(per_layer)


def predicted_peak_bytes(family: Family, config: dict[str, Any], seq_len: int, *, impl: str = "hf") -> float:
    """An implementation's peak as fit_layers models it: 8 B per parameter (bf16 weights,
    gradients and AdamW's two moments), the activations of every layer, and the loss:
    transformers' bf16 logits, their float32 copy, float32 log-softmax and its gradient (16 B per
    logit); the own fused loss's chunk of logits (~1 GiB) with its float32 work (4 GiB in all)
    and the vocabulary projection's float32 gradient."""
    parameters, _ = parameter_counts(config)
    if impl == "hf":
        activations = activation_bytes(family.activation_bytes_per_token_layer, config, seq_len)
        loss = 16 * seq_len * config["vocab_size"]
    else:
        own = family.own_activation_bytes_per_token_layer
        activations = activation_bytes(family.activation_bytes_per_token_layer if own is None else own, config, seq_len)
        loss = 4 * 2**30 + 4 * config["vocab_size"] * config["hidden_size"]
    return 8 * parameters + activations + loss


def fit_layers(family: Family, seq_len: int, budget_bytes: float) -> tuple[int, float, str]:
    """The most layers (at least family.min_layers, at most the hub's) whose predicted peak
    stays within `budget_bytes`, that peak, and whose peak it is: transformers' (the larger),
    unless transformers' exceeds the budget even at min_layers (it is then expected to fail at
    this length, shown in the table), when the own model's fit is taken."""
    layers = family.min_layers
    impl = "hf"
    peak = predicted_peak_bytes(family, family_config(family, layers, smoke=False), seq_len, impl=impl)
    if peak > budget_bytes:
        impl = "own"
        peak = predicted_peak_bytes(family, family_config(family, layers, smoke=False), seq_len, impl=impl)
    while layers < family.config["num_hidden_layers"]:
        bigger = predicted_peak_bytes(family, family_config(family, layers + 1, smoke=False), seq_len, impl=impl)
        if bigger > budget_bytes:
            break
        layers, peak = layers + 1, bigger
    return layers, peak, impl
