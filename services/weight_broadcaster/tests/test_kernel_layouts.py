"""The kernel layouts of the hybrid, latent-attention and vision-language families (Qwen3.5-MoE,
Nemotron-H, GLM-5, Qwen3-VL):
which rows go where in each fused parameter, which vLLM's parameter table (names and shapes,
tests/test_family_serving.py) cannot tell apart."""

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl_weight_broadcaster.formats import convert
from primerl_weight_broadcaster.kernel_layouts import LAYOUTS

KERNEL, FP8 = tensor_pb2.WEIGHT_FORMAT_KERNEL, tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8
HIDDEN, NUM_EXPERTS, EXPERT_INTERMEDIATE = 64, 4, 32


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def experts(prefix: str, projections: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    shapes = {"down_proj": (HIDDEN, EXPERT_INTERMEDIATE)}
    return {
        f"{prefix}.experts.{e}.{p}.weight": shapes.get(p, (EXPERT_INTERMEDIATE, HIDDEN))
        for e in range(NUM_EXPERTS)
        for p in projections
    }


def test_qwen3_5_deltanet_projections_fuse_as_vllm_s_in_proj_qkvz_and_in_proj_ba() -> None:
    layer = "model.layers.0"
    hf = random_tensors(
        {
            f"{layer}.linear_attn.in_proj_qkv.weight": (96, HIDDEN),
            f"{layer}.linear_attn.in_proj_z.weight": (32, HIDDEN),
            f"{layer}.linear_attn.in_proj_b.weight": (4, HIDDEN),
            f"{layer}.linear_attn.in_proj_a.weight": (4, HIDDEN),
            f"{layer}.linear_attn.A_log": (4,),
            f"{layer}.linear_attn.conv1d.weight": (96, 1, 4),
            f"{layer}.mlp.shared_expert.gate_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.shared_expert.up_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.shared_expert.down_proj.weight": (HIDDEN, EXPERT_INTERMEDIATE),
            f"{layer}.mlp.shared_expert_gate.weight": (1, HIDDEN),
            **experts(f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj")),
        }
    )
    kernel = convert(hf, KERNEL, "qwen3_5_moe_text").tensors
    attention = f"{layer}.linear_attn"
    assert torch.equal(
        kernel[f"{attention}.in_proj_qkvz.weight"],
        torch.cat([hf[f"{attention}.in_proj_qkv.weight"], hf[f"{attention}.in_proj_z.weight"]]),
    )
    # b (beta) rows first, then a (decay): vLLM's shard order, not the alphabet's.
    assert torch.equal(
        kernel[f"{attention}.in_proj_ba.weight"],
        torch.cat([hf[f"{attention}.in_proj_b.weight"], hf[f"{attention}.in_proj_a.weight"]]),
    )
    assert kernel[f"{attention}.A_log"] is hf[f"{attention}.A_log"]
    assert f"{layer}.mlp.shared_expert.gate_up_proj.weight" in kernel
    assert kernel[f"{layer}.mlp.shared_expert_gate.weight"] is hf[f"{layer}.mlp.shared_expert_gate.weight"]
    w13 = kernel[f"{layer}.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (NUM_EXPERTS, 2 * EXPERT_INTERMEDIATE, HIDDEN)


def test_qwen3_5_moe_multimodal_names_are_vllm_s_language_model_s() -> None:
    hf = random_tensors(
        {
            "model.language_model.embed_tokens.weight": (320, HIDDEN),
            "model.language_model.layers.0.linear_attn.in_proj_b.weight": (4, HIDDEN),
            "model.language_model.layers.0.linear_attn.in_proj_a.weight": (4, HIDDEN),
            "lm_head.weight": (320, HIDDEN),
        }
    )
    kernel = convert(hf, KERNEL, "qwen3_5_moe").tensors
    assert sorted(kernel) == [
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.0.linear_attn.in_proj_ba.weight",
    ]


def test_nemotron_h_renames_as_vllm_and_stacks_its_non_gated_experts() -> None:
    mamba, moe, attention = "backbone.layers.0.mixer", "backbone.layers.1.mixer", "backbone.layers.2.mixer"
    hf = random_tensors(
        {
            "backbone.embeddings.weight": (320, HIDDEN),
            f"{mamba}.A_log": (8,),
            f"{mamba}.in_proj.weight": (200, HIDDEN),
            f"{moe}.gate.e_score_correction_bias": (NUM_EXPERTS,),
            f"{moe}.shared_experts.up_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
            f"{moe}.shared_experts.down_proj.weight": (HIDDEN, EXPERT_INTERMEDIATE),
            **experts(moe, ("up_proj", "down_proj")),
            **{f"{attention}.{p}_proj.weight": (HIDDEN if p == "q" else 32, HIDDEN) for p in "qkv"},
            "backbone.layers.3.mixer.up_proj.weight": (128, HIDDEN),
            "backbone.norm_f.weight": (HIDDEN,),
            "lm_head.weight": (320, HIDDEN),
        }
    )
    kernel = convert(hf, KERNEL, "nemotron_h").tensors
    assert kernel["model.embed_tokens.weight"] is hf["backbone.embeddings.weight"]
    # Named as vLLM's parameter; the value sent is A_log (vLLM's loader takes -exp of it).
    assert kernel["model.layers.0.mixer.A"] is hf[f"{mamba}.A_log"]
    assert kernel["model.norm_f.weight"] is hf["backbone.norm_f.weight"]
    w13 = kernel["model.layers.1.mixer.experts.routed_experts.w13_weight"]
    assert w13.shape == (NUM_EXPERTS, EXPERT_INTERMEDIATE, HIDDEN)  # up rows alone
    for e in range(NUM_EXPERTS):
        assert torch.equal(w13[e], hf[f"{moe}.experts.{e}.up_proj.weight"])
    assert "model.layers.1.mixer.shared_experts.up_proj.weight" in kernel  # not fused
    assert "model.layers.2.mixer.qkv_proj.weight" in kernel
    assert "model.layers.3.mixer.up_proj.weight" in kernel
    assert not any(name.startswith("backbone.") for name in kernel)

    del hf[f"{moe}.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match="expert 2 lacks up_proj"):
        convert(hf, KERNEL, "nemotron_h")


def test_glm_moe_dsa_fuses_the_latent_down_projections_and_the_indexer_s_key_and_weights() -> None:
    attention = "model.layers.1.self_attn"
    hf = random_tensors(
        {
            f"{attention}.q_a_proj.weight": (32, HIDDEN),
            f"{attention}.kv_a_proj_with_mqa.weight": (48, HIDDEN),
            f"{attention}.q_b_proj.weight": (128, 32),
            f"{attention}.kv_b_proj.weight": (192, 32),
            f"{attention}.indexer.wq_b.weight": (64, 32),
            f"{attention}.indexer.wk.weight": (16, HIDDEN),
            f"{attention}.indexer.weights_proj.weight": (4, HIDDEN),
            "model.layers.0.mlp.gate_proj.weight": (128, HIDDEN),
            "model.layers.0.mlp.up_proj.weight": (128, HIDDEN),
            "model.layers.1.mlp.gate.e_score_correction_bias": (NUM_EXPERTS,),
            "model.layers.1.mlp.shared_experts.gate_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
            "model.layers.1.mlp.shared_experts.up_proj.weight": (EXPERT_INTERMEDIATE, HIDDEN),
            **experts("model.layers.1.mlp", ("gate_proj", "up_proj", "down_proj")),
        }
    )
    kernel = convert(hf, KERNEL, "glm_moe_dsa").tensors
    assert torch.equal(
        kernel[f"{attention}.fused_qkv_a_proj.weight"],
        torch.cat([hf[f"{attention}.q_a_proj.weight"], hf[f"{attention}.kv_a_proj_with_mqa.weight"]]),
    )
    assert torch.equal(
        kernel[f"{attention}.indexer.wk_weights_proj.weight"],
        torch.cat([hf[f"{attention}.indexer.wk.weight"], hf[f"{attention}.indexer.weights_proj.weight"]]),
    )
    assert {f"{attention}.q_b_proj.weight", f"{attention}.kv_b_proj.weight", f"{attention}.indexer.wq_b.weight"} <= set(
        kernel
    )
    assert {"model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.shared_experts.gate_up_proj.weight"} <= set(
        kernel
    )
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in kernel


def test_qwen3_vl_moe_transposes_the_hub_s_stacked_experts_and_keeps_the_vision_tower_s_names() -> None:
    layer, block = "model.language_model.layers.0", "model.visual.blocks.0"
    hf = random_tensors(
        {
            **{f"{layer}.self_attn.{p}_proj.weight": (HIDDEN, HIDDEN) for p in "qkv"},
            f"{layer}.mlp.gate.weight": (NUM_EXPERTS, HIDDEN),
            # The hub's layout: gate columns, then up; [E, H, 2*I] and [E, I, H].
            f"{layer}.mlp.experts.gate_up_proj": (NUM_EXPERTS, HIDDEN, 2 * EXPERT_INTERMEDIATE),
            f"{layer}.mlp.experts.down_proj": (NUM_EXPERTS, EXPERT_INTERMEDIATE, HIDDEN),
            f"{block}.attn.qkv.weight": (96, 32),
            f"{block}.mlp.linear_fc1.weight": (64, 32),
            "model.visual.merger.linear_fc2.weight": (HIDDEN, 128),
            "lm_head.weight": (320, HIDDEN),
        }
    )
    kernel = convert(hf, KERNEL, "qwen3_vl_moe").tensors
    experts = "language_model.model.layers.0.mlp.experts.routed_experts"
    w13 = kernel[f"{experts}.w13_weight"]
    assert w13.shape == (NUM_EXPERTS, 2 * EXPERT_INTERMEDIATE, HIDDEN)
    gate_up = hf[f"{layer}.mlp.experts.gate_up_proj"]
    for e in range(NUM_EXPERTS):  # gate rows, then up rows: the order vLLM's w1 and w3 shards take
        assert torch.equal(w13[e, :EXPERT_INTERMEDIATE], gate_up[e, :, :EXPERT_INTERMEDIATE].T)
        assert torch.equal(w13[e, EXPERT_INTERMEDIATE:], gate_up[e, :, EXPERT_INTERMEDIATE:].T)
    assert torch.equal(kernel[f"{experts}.w2_weight"], hf[f"{layer}.mlp.experts.down_proj"].transpose(1, 2))
    assert sorted(kernel) == [
        "language_model.lm_head.weight",
        "language_model.model.layers.0.mlp.experts.routed_experts.w13_weight",
        "language_model.model.layers.0.mlp.experts.routed_experts.w2_weight",
        "language_model.model.layers.0.mlp.gate.weight",
        "language_model.model.layers.0.self_attn.qkv_proj.weight",
        "visual.blocks.0.attn.qkv.weight",
        "visual.blocks.0.mlp.linear_fc1.weight",
        "visual.merger.linear_fc2.weight",
    ]
    assert kernel["visual.blocks.0.attn.qkv.weight"] is hf[f"{block}.attn.qkv.weight"]


@pytest.mark.parametrize(
    "model_type", ["qwen3_5_moe_text", "qwen3_5_moe", "nemotron_h", "glm_moe_dsa", "qwen3_vl", "qwen3_vl_moe"]
)
def test_fp8_is_refused_with_the_reason(model_type: str) -> None:
    hf = {"model.embed_tokens.weight": torch.zeros(4, HIDDEN)}
    with pytest.raises(ValueError, match=rf"no block-FP8 kernel format for model_type '{model_type}'.*not checked"):
        convert(hf, FP8, model_type)
    assert LAYOUTS[model_type].fp8_linear is None
