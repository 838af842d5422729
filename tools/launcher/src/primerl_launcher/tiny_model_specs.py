"""The tiny models' families, as primerl_launcher.tiny_model builds them: one frozen dataclass
per family deriving from `TinyModelSpec` (its shapes, its config.json as the hub writes it, the
transformers class that draws its random weights, its processor files) and one entry in
`FAMILIES`; and the token ids and chat templates of the byte-level tokenizer that those configs
name (bytes 0..255, then the specials, then the reserved and vision tokens up to VOCAB_SIZE).

Data only: nothing here draws weights or writes files (tiny_model.py does, and imports this).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "FAMILIES",
    "IMAGE_TOKEN_ID",
    "IM_START_TOKEN",
    "IM_START_TOKEN_ID",
    "KINDS",
    "NUM_BYTE_TOKENS",
    "PAD_TOKEN",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "VIDEO_TOKEN_ID",
    "VISION_CHAT_TEMPLATE",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "VISION_TOKENS",
    "VOCAB_SIZE",
    "DType",
    "TinyAfmoeSpec",
    "TinyGlm4MoeSpec",
    "TinyGlmMoeDsaSpec",
    "TinyGptOssSpec",
    "TinyLagunaSpec",
    "TinyMiniMaxM2Spec",
    "TinyModelSpec",
    "TinyMoeSpec",
    "TinyNemotronHSpec",
    "TinyQwen3MoeSpec",
    "TinyQwen3Spec",
    "TinyQwen3VLMoeSpec",
    "TinyQwen3VLSpec",
    "TinyQwen3_5MoeSpec",
    "TinyVisionLanguageSpec",
]

NUM_BYTE_TOKENS = 256
PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Right after the bytes, in Qwen's order (151643..151645 there).
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)
PAD_TOKEN_ID, IM_START_TOKEN_ID, EOS_TOKEN_ID = range(NUM_BYTE_TOKENS, NUM_BYTE_TOKENS + len(SPECIAL_TOKENS))
# The Qwen3-VL families' vision tokens, on the first reserved ids (<|reserved_0..3|> in the
# other families' tokenizers), under Qwen's names in theirs.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(
    NUM_BYTE_TOKENS + len(SPECIAL_TOKENS), NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + len(VISION_TOKENS)
)
# Bytes + specials, padded with reserved tokens to a multiple of 64 so that every id the
# model can sample is decodable (an untrained model samples all of them).
VOCAB_SIZE = 320

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# CHAT_TEMPLATE where a message's content is a string; a list of parts (OpenAI's and
# transformers' layouts) renders each image or video in Qwen3-VL's layout, in order with the text.
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DType = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class TinyModelSpec:
    """The shapes every family shares (tiny, CI-fast) and the config.json keys common to the
    hub's checkpoints. A family derives from it: its transformers class and model type, its own
    fields and config keys (`family_config`)."""

    # transformers' class that draws the random weights (its config_class reads config.json).
    model_class: ClassVar[str]
    model_type: ClassVar[str]
    # Router buffers transformers starts at zero (GLM's and MiniMax-M2's correction biases):
    # drawn at random so that they change choices, and kept in float32 whatever the dtype, as
    # the hub's checkpoints store them. Matched by the end of the buffer's name.
    float32_buffers: ClassVar[tuple[str, ...]] = ()
    # Parameters transformers starts at zero that would leave routing to ties (AFMoE's router
    # gate; AFMoE's and Laguna's router biases are parameters, not buffers): drawn at random,
    # then cast with the rest. Matched by the end of the parameter's name.
    random_parameters: ClassVar[tuple[str, ...]] = ()
    # Tensors the hub stores with their last two dims swapped from transformers 5's in-memory
    # layout, which save_pretrained writes (Qwen3-VL-MoE's fused experts): swapped after saving.
    # Matched by the end of the tensor's name.
    transposed_tensors: ClassVar[tuple[str, ...]] = ()
    # The tokenizer names the vision tokens (VISION_TOKENS) and renders VISION_CHAT_TEMPLATE.
    vision_tokens: ClassVar[bool] = False
    # Bumped when a family's own files change: in the stamp when non-zero, so that the family's
    # old folders are remade and the other families' stamps stay as they were.
    files_revision: ClassVar[int] = 0

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

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        """config.json as the family's hub checkpoints write it."""
        config: dict[str, Any] = {
            "architectures": [self.model_class],
            "model_type": self.model_type,
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
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "tie_word_embeddings": True,
            "use_cache": True,
            # Qwen's configs name <|endoftext|> as bos too; the tokenizer adds no bos.
            "bos_token_id": PAD_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "dtype": dtype,
        }
        return config | self.family_config()

    def family_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def processor_files(self) -> dict[str, str]:
        """The files besides the model and the tokenizer (file name -> text): none but the
        multimodal families'."""
        return {}

    def alternating_layer_types(self) -> list[str]:
        """Sliding-window and full attention layers alternating, the first sliding."""
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]


_QWEN3_ATTENTION = {"rope_scaling": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": None}


@dataclass(frozen=True)
class TinyQwen3Spec(TinyModelSpec):
    """Qwen3 (dense), tied embeddings; the config read by transformers 4.56+ and 5.x alike."""

    model_class: ClassVar[str] = "Qwen3ForCausalLM"
    model_type: ClassVar[str] = "qwen3"

    def family_config(self) -> dict[str, Any]:
        return dict(_QWEN3_ATTENTION)


@dataclass(frozen=True)
class TinyMoeSpec(TinyModelSpec):
    """The expert shapes the MoE families share."""

    # config.json's names of the number of routed experts and of their width.
    experts_key: ClassVar[str] = "num_experts"
    expert_width_key: ClassVar[str] = "moe_intermediate_size"

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128

    def experts_config(self) -> dict[str, Any]:
        """The routed experts' fields, under the family's names, and no router logits in the outputs."""
        return {
            self.experts_key: self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            self.expert_width_key: self.moe_intermediate_size,
            "output_router_logits": False,
        }


@dataclass(frozen=True)
class TinyQwen3MoeSpec(TinyMoeSpec):
    """Qwen3-MoE: every layer sparse, softmax top-k renormalised, tied embeddings."""

    model_class: ClassVar[str] = "Qwen3MoeForCausalLM"
    model_type: ClassVar[str] = "qwen3_moe"

    def family_config(self) -> dict[str, Any]:
        return {
            **_QWEN3_ATTENTION,
            **self.experts_config(),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
        }


@dataclass(frozen=True)
class TinyGlm4MoeSpec(TinyMoeSpec):
    """GLM-4.5's particulars at the tiny shape: sigmoid routing with a correction bias (drawn
    at random, so that it changes choices) over `n_group` groups, shared experts, dense first
    layers, partial rotary, q/k norm and q/k/v bias; untied head, as GLM's checkpoints."""

    model_class: ClassVar[str] = "Glm4MoeForCausalLM"
    model_type: ClassVar[str] = "glm4_moe"
    float32_buffers: ClassVar[tuple[str, ...]] = ("e_score_correction_bias",)
    experts_key: ClassVar[str] = "n_routed_experts"

    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = True
    attention_bias: bool = True

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "rope_scaling": None,
            "norm_topk_prob": True,
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


@dataclass(frozen=True)
class TinyMiniMaxM2Spec(TinyMoeSpec):
    """MiniMax-M2: every layer sparse, sigmoid routing with a correction bias (for the choice
    only, drawn at random), q/k RMSNorm over all heads, partial rotary through the hub's
    `rotary_dim`, untied head. Its config names the experts' width `intermediate_size` (there
    is no dense MLP): `moe_intermediate_size` is written there."""

    model_class: ClassVar[str] = "MiniMaxM2ForCausalLM"
    model_type: ClassVar[str] = "minimax_m2"
    float32_buffers: ClassVar[tuple[str, ...]] = ("e_score_correction_bias",)
    experts_key: ClassVar[str] = "num_local_experts"
    expert_width_key: ClassVar[str] = "intermediate_size"

    rotary_dim: int = 32

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "rotary_dim": self.rotary_dim,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "shared_intermediate_size": 0,
            "attn_type_list": [1] * self.num_hidden_layers,
            "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyQwen3_5MoeSpec(TinyMoeSpec):
    """Qwen3.5-MoE's language model (`qwen3_5_moe_text`; the hub's checkpoints are the multimodal
    model around it): Gated DeltaNet layers and gated full attention alternating (every kind of
    layer present), every layer sparse with a gated shared expert, RoPE on a quarter of each
    head, untied head. Its config has no dense MLP width and keeps rope_theta in rope_parameters."""

    model_class: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    model_type: ClassVar[str] = "qwen3_5_moe_text"

    full_attention_interval: int = 2
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 128
    partial_rotary_factor: float = 0.25

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        config = super().config_dict(dtype)
        del config["intermediate_size"], config["rope_theta"]
        return config

    def family_config(self) -> dict[str, Any]:
        interval = self.full_attention_interval
        return {
            "layer_types": [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ],
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "attention_bias": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyGptOssSpec(TinyMoeSpec):
    """GPT-OSS: every layer sparse (biased router, experts with biases and the clamped SwiGLU),
    attention with sinks and q/k/v/o bias, sliding-window and full layers alternating with a
    window shorter than typical test prompts, YaRN RoPE as the hub's config writes it
    (`rope_scaling`), untied head. The experts' width is `intermediate_size` (no dense MLP)."""

    model_class: ClassVar[str] = "GptOssForCausalLM"
    model_type: ClassVar[str] = "gpt_oss"
    experts_key: ClassVar[str] = "num_local_experts"
    expert_width_key: ClassVar[str] = "intermediate_size"

    sliding_window: int = 8
    yarn_factor: float = 8.0

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "layer_types": self.alternating_layer_types(),
            "sliding_window": self.sliding_window,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": self.yarn_factor,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": int(self.max_position_embeddings / self.yarn_factor),
            },
            "attention_bias": True,
            "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyAfmoeSpec(TinyMoeSpec):
    """Trinity / AFMoE: sliding-window layers (RoPE, a window shorter than typical test prompts)
    and full NoPE layers alternating, a dense first layer, sigmoid routing with a random expert
    bias and a random router (transformers starts both at zero), route_scale, a shared expert,
    gated attention, sandwich norms, muP embedding scale; untied head. Its config also names the
    routing fields the hub's files carry (score_func, route_norm, n_group, topk_group)."""

    model_class: ClassVar[str] = "AfmoeForCausalLM"
    model_type: ClassVar[str] = "afmoe"
    random_parameters: ClassVar[tuple[str, ...]] = ("mlp.router.gate.weight", "mlp.expert_bias")

    sliding_window: int = 8
    num_dense_layers: int = 1
    num_shared_experts: int = 1
    route_scale: float = 2.5

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "num_shared_experts": self.num_shared_experts,
            "num_dense_layers": self.num_dense_layers,
            "global_attn_every_n_layers": 2,
            "layer_types": self.alternating_layer_types(),
            "sliding_window": self.sliding_window,
            "route_scale": self.route_scale,
            "score_func": "sigmoid",
            "route_norm": True,
            "n_group": 1,
            "topk_group": 1,
            "mup_enabled": True,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyLagunaSpec(TinyMoeSpec):
    """Laguna: sliding-window layers (default RoPE over the whole head, a window shorter than
    typical test prompts) and full layers (YaRN over half of each head) alternating, per-layer
    query head counts, a dense first layer, sigmoid routing with a random correction bias
    (transformers starts it at zero; a parameter there) and soft-capped logits, a routed scaling
    factor, a shared expert, per-head softplus output gates; untied head. RoPE lives in
    rope_parameters, one dict per kind of layer."""

    model_class: ClassVar[str] = "LagunaForCausalLM"
    model_type: ClassVar[str] = "laguna"
    random_parameters: ClassVar[tuple[str, ...]] = ("mlp.gate.e_score_correction_bias",)

    sliding_window: int = 8
    shared_expert_intermediate_size: int = 128
    moe_routed_scaling_factor: float = 2.5
    moe_router_logit_softcapping: float = 8.0
    yarn_factor: float = 8.0

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        config = super().config_dict(dtype)
        del config["rope_theta"]
        return config

    def family_config(self) -> dict[str, Any]:
        layers = range(self.num_hidden_layers)
        return self.experts_config() | {
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "layer_types": self.alternating_layer_types(),
            "mlp_layer_types": ["dense" if i == 0 else "sparse" for i in layers],
            "num_attention_heads_per_layer": [self.num_attention_heads * (1 if i % 2 == 0 else 2) for i in layers],
            "sliding_window": self.sliding_window,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": 0.5,
                    "factor": self.yarn_factor,
                    "original_max_position_embeddings": int(self.max_position_embeddings / self.yarn_factor),
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0},
            },
            "gating": True,
            "attention_bias": False,
            "moe_routed_scaling_factor": self.moe_routed_scaling_factor,
            "moe_router_logit_softcapping": self.moe_router_logit_softcapping,
            "moe_apply_router_weight_on_input": False,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyNemotronHSpec(TinyMoeSpec):
    """Nemotron-H (Nemotron-3-Nano's family): one mixer per layer as the hub's
    `hybrid_override_pattern` names them (M Mamba-2, E mixture of experts, * attention without
    positions, - dense relu^2 MLP; every kind present), sigmoid routing with a correction bias
    (drawn at random) and a shared expert, non-gated relu^2 experts; chunks shorter than the usual
    test samples, so that the scan crosses chunks; random A_log and convolution bias; untied head.
    Its norms' epsilon is `layer_norm_epsilon`; it has no rope or hidden_act fields."""

    model_class: ClassVar[str] = "NemotronHForCausalLM"
    model_type: ClassVar[str] = "nemotron_h"
    float32_buffers: ClassVar[tuple[str, ...]] = ("e_score_correction_bias",)
    # Mamba-2's A_log (transformers: log(1..heads), the same for every seed) and convolution bias
    # (zeros) drawn like the rest.
    random_parameters: ClassVar[tuple[str, ...]] = ("A_log", "conv1d.bias")
    experts_key: ClassVar[str] = "n_routed_experts"

    num_hidden_layers: int = 6
    # One letter per layer: as many as num_hidden_layers.
    hybrid_override_pattern: str = "MEM*E-"
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    n_groups: int = 2
    ssm_state_size: int = 16
    conv_kernel: int = 4
    chunk_size: int = 16
    moe_shared_expert_intermediate_size: int = 128
    routed_scaling_factor: float = 2.5

    def __post_init__(self) -> None:
        if len(self.hybrid_override_pattern) != self.num_hidden_layers:
            raise ValueError(
                f"hybrid_override_pattern {self.hybrid_override_pattern!r} must name num_hidden_layers "
                f"({self.num_hidden_layers}) layers"
            )

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        config = super().config_dict(dtype)
        del config["rope_theta"], config["hidden_act"]
        config["layer_norm_epsilon"] = config.pop("rms_norm_eps")
        return config

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "hybrid_override_pattern": self.hybrid_override_pattern,
            "mamba_num_heads": self.mamba_num_heads,
            "mamba_head_dim": self.mamba_head_dim,
            "n_groups": self.n_groups,
            "ssm_state_size": self.ssm_state_size,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk_size,
            "mamba_hidden_act": "silu",
            "mlp_hidden_act": "relu2",
            "use_conv_bias": True,
            "use_bias": False,
            "mlp_bias": False,
            "attention_bias": False,
            "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyGlmMoeDsaSpec(TinyMoeSpec):
    """GLM-5: multi-head latent attention (q and kv latents, decoupled rope dims; `head_dim` is
    the rope dims, as transformers writes it) with DeepSeek sparse attention (an indexer keeping
    `index_topk` keys per query, fewer than the usual test samples hold; "shared" layers reuse
    the previous full layer's selection), GLM-4.5's routing (correction bias drawn at random,
    groups, shared expert, a dense first layer); untied head."""

    model_class: ClassVar[str] = "GlmMoeDsaForCausalLM"
    model_type: ClassVar[str] = "glm_moe_dsa"
    float32_buffers: ClassVar[tuple[str, ...]] = ("e_score_correction_bias",)
    experts_key: ClassVar[str] = "n_routed_experts"

    num_key_value_heads: int = 4
    head_dim: int = 32
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 64
    index_topk: int = 16
    index_head_dim: int = 64
    index_n_heads: int = 4
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "index_topk": self.index_topk,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            # Full and shared indexer layers alternating, the first full; also as the hub's
            # `index_topk_pattern`, which vLLM reads (it ignores indexer_types).
            "indexer_types": ["full" if i % 2 == 0 else "shared" for i in range(self.num_hidden_layers)],
            "index_topk_pattern": "".join("F" if i % 2 == 0 else "S" for i in range(self.num_hidden_layers)),
            # The routing fields of the hub's config that vLLM reads (its DeepSeek defaults are
            # softmax scores and no correction bias); transformers' GLM-5 routes so regardless.
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "attention_bias": False,
            "norm_topk_prob": True,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "n_shared_experts": self.n_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class TinyVisionLanguageSpec(TinyModelSpec):
    """What the Qwen3-VL families add to their language model: a vision tower (`vision_config`:
    3 blocks, deepstack mergers after the first and the last, images of 16-pixel patches merged
    2 x 2 into one token, a learned 8 x 8 position grid) and the vision token ids; config.json
    nests the language model's fields in `text_config`, with the hub's interleaved MRoPE
    (`rope_scaling.mrope_section`, sections of head_dim / 2). Biases (all zero in transformers'
    init) are drawn at random, so that each one counts."""

    random_parameters: ClassVar[tuple[str, ...]] = ("bias",)
    vision_tokens: ClassVar[bool] = True
    files_revision: ClassVar[int] = 1
    # The top level's keys; the rest is text_config.
    _top_level_keys: ClassVar[tuple[str, ...]] = ("architectures", "model_type", "tie_word_embeddings", "dtype")

    hidden_size: int = 64
    num_hidden_layers: int = 3
    head_dim: int = 32
    intermediate_size: int = 128
    mrope_section: tuple[int, int, int] = (6, 5, 5)
    vision_depth: int = 3
    vision_hidden_size: int = 32
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 64
    deepstack_visual_indexes: tuple[int, ...] = (0, 2)
    # The image processor resizes each image to multiples of 32 pixels (a merged 2 x 2 of
    # patches) holding between these many pixels: 1 to 16 image tokens.
    image_min_pixels: int = 32 * 32
    image_max_pixels: int = 128 * 128
    # A video's frames, together.
    video_max_pixels: int = 8 * 128 * 128
    video_max_frames: int = 8

    def config_dict(self, dtype: DType) -> dict[str, Any]:
        flat = super().config_dict(dtype)
        text = {key: value for key, value in flat.items() if key not in ("architectures", "model_type")}
        text |= {
            "model_type": f"{self.model_type}_text",
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
        }
        return {key: flat[key] for key in self._top_level_keys} | {
            "text_config": text,
            "vision_config": {
                "model_type": self.model_type,
                "depth": self.vision_depth,
                "hidden_size": self.vision_hidden_size,
                "hidden_act": "gelu_pytorch_tanh",
                "intermediate_size": self.vision_intermediate_size,
                "num_heads": self.vision_num_heads,
                "in_channels": 3,
                "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size,
                "spatial_merge_size": self.spatial_merge_size,
                "out_hidden_size": self.hidden_size,
                "num_position_embeddings": self.num_position_embeddings,
                "deepstack_visual_indexes": list(self.deepstack_visual_indexes),
                "initializer_range": self.initializer_range,
            },
            "image_token_id": IMAGE_TOKEN_ID,
            "video_token_id": VIDEO_TOKEN_ID,
            "vision_start_token_id": VISION_START_TOKEN_ID,
            "vision_end_token_id": VISION_END_TOKEN_ID,
        }

    def processor_files(self) -> dict[str, str]:
        """What transformers' AutoProcessor (Qwen3VLProcessor) and vLLM read, as the hub's
        Qwen3-VL checkpoints write it: the image processor's and the video processor's configs
        (the patch shapes of vision_config; pixel values scaled to [-1, 1]), the processor's class,
        and its chat template (the tokenizer's)."""
        pixels = {
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.spatial_merge_size,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "processor_class": "Qwen3VLProcessor",
        }
        image = pixels | {
            # transformers 5 falls back to Qwen2VLImageProcessorPil where torchvision is missing.
            "image_processor_type": "Qwen2VLImageProcessor",
            "size": {"shortest_edge": self.image_min_pixels, "longest_edge": self.image_max_pixels},
        }
        video = pixels | {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": self.image_min_pixels, "longest_edge": self.video_max_pixels},
            "fps": 2,
            "min_frames": self.temporal_patch_size,
            "max_frames": self.video_max_frames,
        }
        return {
            "preprocessor_config.json": _json_text(image),
            "video_preprocessor_config.json": _json_text(video),
            "processor_config.json": _json_text({"processor_class": "Qwen3VLProcessor"}),
            "chat_template.jinja": VISION_CHAT_TEMPLATE,
        }


@dataclass(frozen=True)
class TinyQwen3VLSpec(TinyVisionLanguageSpec):
    """Qwen3-VL (dense): Qwen3's language model, tied embeddings (as the hub's 2B and 4B)."""

    model_class: ClassVar[str] = "Qwen3VLForConditionalGeneration"
    model_type: ClassVar[str] = "qwen3_vl"

    def family_config(self) -> dict[str, Any]:
        return {"attention_bias": False}


@dataclass(frozen=True)
class TinyQwen3VLMoeSpec(TinyVisionLanguageSpec, TinyMoeSpec):
    """Qwen3-VL-MoE: Qwen3-MoE's language model (softmax top-k, renormalised) with its middle
    layer dense (`mlp_only_layers`), untied head as the hub's 30B-A3B. The experts are stored
    fused, in the hub's layout (`mlp.experts.gate_up_proj` [E, D, 2F], `down_proj` [E, F, D]);
    2F differs from D, so that transformers tells the layout from the shape."""

    model_class: ClassVar[str] = "Qwen3VLMoeForConditionalGeneration"
    model_type: ClassVar[str] = "qwen3_vl_moe"
    transposed_tensors: ClassVar[tuple[str, ...]] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

    moe_intermediate_size: int = 48
    mlp_only_layers: tuple[int, ...] = (1,)

    def family_config(self) -> dict[str, Any]:
        return self.experts_config() | {
            "attention_bias": False,
            # transformers' Qwen3-VL-MoE always renormalises and has no such field; the hub's
            # configs write it, and vLLM's Qwen3-MoE blocks read it (AttributeError without).
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(self.mlp_only_layers),
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        }


# One entry per family: its name on the command line -> its default tiny shape.
FAMILIES: dict[str, TinyModelSpec] = {
    "qwen3": TinyQwen3Spec(),
    "qwen3-moe": TinyQwen3MoeSpec(),
    "glm4-moe": TinyGlm4MoeSpec(),
    "minimax-m2": TinyMiniMaxM2Spec(),
    "qwen3.5-moe": TinyQwen3_5MoeSpec(),
    "gpt-oss": TinyGptOssSpec(),
    "afmoe": TinyAfmoeSpec(),
    "laguna": TinyLagunaSpec(),
    "nemotron-h": TinyNemotronHSpec(),
    "glm-moe-dsa": TinyGlmMoeDsaSpec(),
    "qwen3-vl": TinyQwen3VLSpec(),
    "qwen3-vl-moe": TinyQwen3VLMoeSpec(),
}
# The older names callers pick the Qwen3 models by (the launcher's tiny-dense / tiny-moe).
KINDS = {"dense": "qwen3", "moe": "qwen3-moe"}


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
