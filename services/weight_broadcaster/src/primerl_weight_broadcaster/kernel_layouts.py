"""Per model family, how HF-named tensors become the parameters vLLM 0.32's model class holds.

A family's `KernelLayout` says which sibling projections vLLM fuses into one parameter (rows
of each part in order), how its experts are stacked into `experts.routed_experts.w13_weight`
[E, 2*I, H] (non-gated experts: [E, I, H]) and `w2_weight` [E, H, I], which names it renames,
and which weights its block-FP8 method holds in FP8. Families are named by their HF config's
`model_type`; checked against vLLM's own parameters in tests/test_family_serving.py.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["LAYOUTS", "ExpertStacking", "Fusion", "KernelLayout", "layout_of"]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """`<parent>.<part>.<weight|bias>` of every part -> `<parent>.<fused>.<weight|bias>`, for
    parents whose name ends with one of `parents` (vLLM fuses per module, not per name)."""

    fused: str
    parts: tuple[str, ...]
    parents: tuple[str, ...]

    def pattern(self) -> re.Pattern[str]:
        parents = "|".join(re.escape(p) for p in self.parents)
        parts = "|".join(re.escape(p) for p in self.parts)
        return re.compile(rf"^(?P<prefix>.+\.(?:{parents}))\.(?P<part>{parts})\.(?P<suffix>weight|bias)$")


@dataclasses.dataclass(frozen=True)
class ExpertStacking:
    """Where a family's experts are in HF names.

    Per expert (`stacked=False`): `<...experts>.<e>.<gate>.weight`, `<up>`, `<down>`, each
    [I, H] or [H, I] as a linear layer's weight. Stacked (`stacked=True`, GPT-OSS and
    Qwen3-VL-MoE): `<...experts>.gate_up_proj` [E, H, 2*I], whose columns become w13's rows in
    their order (GPT-OSS: gate and up interleaved, which vLLM keeps interleaved as its
    activation reads them so; Qwen3-VL-MoE: gate columns, then up), `down_proj` [E, I, H], and
    GPT-OSS's biases `gate_up_proj_bias` [E, 2*I] and `down_proj_bias` [E, H]. `gate=None`:
    non-gated experts (Nemotron-H's relu^2), whose w13 holds the up rows alone."""

    gate: str | None = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    stacked: bool = False


# The weights vLLM's block-FP8 linear and MoE methods quantize in every family here.
_FP8_COMMON = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_QKV = Fusion("qkv_proj", ("q_proj", "k_proj", "v_proj"), ("self_attn",))


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    model_type: str
    fusions: tuple[Fusion, ...]
    experts: ExpertStacking | None
    # (regex, replacement) applied in order to every kernel-format name.
    renames: tuple[tuple[str, str], ...] = ()
    # Linear layers (by their last name part) whose `.weight` vLLM's block-FP8 method holds in
    # FP8, besides the stacked experts; None: vLLM loads no block-FP8 checkpoint of the family.
    fp8_linear: tuple[str, ...] | None = _FP8_COMMON
    # Why FP8 is refused, when fp8_linear is None.
    no_fp8_reason: str = ""

    def rename(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def fp8_pattern(self) -> re.Pattern[str]:
        assert self.fp8_linear is not None
        linear = "|".join(re.escape(n) for n in self.fp8_linear)
        return re.compile(rf"\.(?:{linear})\.weight$|\.routed_experts\.(?:w13_weight|w2_weight)$")


_QWEN3 = (_QKV, Fusion("gate_up_proj", ("gate_proj", "up_proj"), ("mlp",)))
# Gated DeltaNet layers: q/k/v with the output gate z in `in_proj_qkvz`, the beta and decay
# projections in `in_proj_ba` (b first); the gated attention's q_proj carries its gate rows.
_QWEN3_5 = (
    _QKV,
    Fusion("gate_up_proj", ("gate_proj", "up_proj"), ("mlp.shared_expert",)),
    Fusion("in_proj_qkvz", ("in_proj_qkv", "in_proj_z"), ("linear_attn",)),
    Fusion("in_proj_ba", ("in_proj_b", "in_proj_a"), ("linear_attn",)),
)
_QWEN3_5_NO_FP8 = "its block-FP8 layout (which DeltaNet projections vLLM quantizes) is not checked here"
# The hub's multimodal checkpoints, as vLLM's *ForConditionalGeneration mappers name them.
_LANGUAGE_MODEL_RENAMES = (
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
)
# Qwen3-VL's vision tower keeps the hub's names (its attention's qkv is fused there already,
# its MLPs' linear_fc1 / linear_fc2 are not fused by vLLM); only the prefix moves.
_QWEN3_VL_RENAMES = (*_LANGUAGE_MODEL_RENAMES, (r"^model\.visual\.", "visual."))
_QWEN3_VL_NO_FP8 = "its block-FP8 layout (which vision tower linears vLLM quantizes) is not checked here"

LAYOUTS: dict[str, KernelLayout] = {
    layout.model_type: layout
    for layout in (
        KernelLayout("qwen3", _QWEN3, None),
        KernelLayout("qwen3_moe", _QWEN3, ExpertStacking()),
        # Dense first layers and the shared experts fuse gate/up alike; the router's
        # correction bias stays under mlp.gate.
        KernelLayout(
            "glm4_moe",
            (_QKV, Fusion("gate_up_proj", ("gate_proj", "up_proj"), ("mlp", "mlp.shared_experts"))),
            ExpertStacking(),
        ),
        # Mixtral-style expert names: w1 (gate), w3 (up), w2 (down).
        KernelLayout("minimax_m2", (_QKV,), ExpertStacking(gate="w1", up="w3", down="w2")),
        KernelLayout(
            "gpt_oss",
            (_QKV,),  # with the q/k/v biases
            ExpertStacking(stacked=True),
            renames=((r"\.self_attn\.", ".attn."), (r"^model\.embed_tokens\.", "model.embedding.")),
            fp8_linear=None,
            no_fp8_reason="vLLM's GptOssForCausalLM loads quantized experts as MXFP4 only, not block FP8",
        ),
        # self_attn.gate_proj is the attention's output gate, not half of an MLP: not fused.
        KernelLayout(
            "afmoe",
            (_QKV, Fusion("gate_up_proj", ("gate_proj", "up_proj"), ("mlp", "mlp.shared_experts"))),
            ExpertStacking(),
            renames=((r"\.mlp\.router\.gate\.", ".mlp.gate."),),
            fp8_linear=(*_FP8_COMMON, "gate_proj"),
        ),
        # vLLM keeps Laguna's dense MLP and shared expert unfused, and holds the router's
        # correction bias on the routed experts.
        KernelLayout(
            "laguna",
            (_QKV,),
            ExpertStacking(),
            renames=((r"\.mlp\.experts\.(e_score_correction_bias)$", r".mlp.experts.routed_experts.\1"),),
            fp8_linear=("qkv_proj", "o_proj", "g_proj", "gate_proj", "up_proj", "down_proj"),
        ),
        KernelLayout("qwen3_5_moe_text", _QWEN3_5, ExpertStacking(), fp8_linear=None, no_fp8_reason=_QWEN3_5_NO_FP8),
        # The hub's multimodal checkpoints: the language model of vLLM's
        # Qwen3_5MoeForConditionalGeneration (the trainer publishes no vision tower).
        KernelLayout(
            "qwen3_5_moe",
            _QWEN3_5,
            ExpertStacking(),
            renames=_LANGUAGE_MODEL_RENAMES,
            fp8_linear=None,
            no_fp8_reason=_QWEN3_5_NO_FP8,
        ),
        # Qwen3-VL-MoE: the hub stores each layer's experts stacked and transposed, as GPT-OSS does.
        *(
            KernelLayout(
                model_type, _QWEN3, experts, renames=_QWEN3_VL_RENAMES, fp8_linear=None, no_fp8_reason=_QWEN3_VL_NO_FP8
            )
            for model_type, experts in (("qwen3_vl", None), ("qwen3_vl_moe", ExpertStacking(stacked=True)))
        ),
        # One `mixer` per layer (Mamba-2, attention, MLP or MoE); non-gated relu^2 experts; the
        # hub's `backbone.` prefix, `embeddings` and `A_log` renamed as vLLM's mapper does (its
        # loader for `A` computes -exp(A_log) from the value sent).
        KernelLayout(
            "nemotron_h",
            (Fusion("qkv_proj", ("q_proj", "k_proj", "v_proj"), ("mixer",)),),
            ExpertStacking(gate=None, up="up_proj", down="down_proj"),
            renames=((r"^backbone\.", "model."), (r"\.embeddings\.", ".embed_tokens."), (r"\.A_log$", ".A")),
            fp8_linear=None,
            no_fp8_reason="its block-FP8 layout (Mamba-2 projections, non-gated experts) is not checked here",
        ),
        # Multi-head latent attention: the q and kv down-projections fused; the sparse-attention
        # indexer's key projection and head weights fused (only layers whose indexer runs have one).
        KernelLayout(
            "glm_moe_dsa",
            (
                Fusion("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"), ("self_attn",)),
                Fusion("wk_weights_proj", ("wk", "weights_proj"), ("self_attn.indexer",)),
                Fusion("gate_up_proj", ("gate_proj", "up_proj"), ("mlp", "mlp.shared_experts")),
            ),
            ExpertStacking(),
            fp8_linear=None,
            no_fp8_reason=(
                "its block-FP8 layout (vLLM loads the indexer's wk in FP8 beside an unquantized "
                "weights_proj in one fused parameter) is not checked here"
            ),
        ),
    )
}

# What a publish without a model type gets: the layout of the publishers that predate the field.
_DEFAULT_MODEL_TYPE = "qwen3_moe"


def layout_of(model_type: str) -> KernelLayout:
    """The layout of `model_type` ("" for Qwen3 / Qwen3-MoE); ValueError for a family whose
    vLLM parameters are not known here."""
    layout = LAYOUTS.get(model_type or _DEFAULT_MODEL_TYPE)
    if layout is None:
        raise ValueError(
            f"no vLLM kernel layout is known for model_type {model_type!r} (known: {', '.join(sorted(LAYOUTS))}); "
            "replicas of it must load WEIGHT_FORMAT_HF"
        )
    return layout
