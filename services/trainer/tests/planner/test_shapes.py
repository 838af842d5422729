import json

import pytest

from primerl_trainer.planner.shapes import BUILTIN_SHAPES, builtin_shape, shape_from_hf_config, shape_from_model_path


# Published totals / active parameters (model cards; Kimi-K2's technical report: 1.04T / 32B).
@pytest.mark.parametrize(
    ("name", "total", "active", "tolerance"),
    [
        ("Qwen3-30B-A3B", 30.5e9, 3.3e9, 0.02),
        ("GLM-4.5-Air", 106e9, None, 0.02),
        ("GLM-5", 744e9, None, 0.02),
        ("Kimi-K2", 1.04e12, 32e9, 0.03),
    ],
)
def test_builtin_parameter_counts_match_the_published_ones(name, total, active, tolerance):
    shape = builtin_shape(name)
    assert shape.total_params == pytest.approx(total, rel=tolerance)
    if active is not None:
        assert shape.active_params == pytest.approx(active, rel=tolerance)


def test_glm_active_counts_leave_the_embedding_and_head_out():
    # GLM's cards count 12B (4.5-Air) and 40B (5) active parameters without the vocabulary matrices.
    for name, active in (("GLM-4.5-Air", 12e9), ("GLM-5", 40e9)):
        shape = builtin_shape(name)
        assert shape.active_params - shape.embedding_params - shape.head_params == pytest.approx(active, rel=0.02)


def test_dense_qwen3_shape_counts_by_hand():
    # bench/trainer_throughput.py's dense shape: 8 layers of 2048, 16 heads (8 KV) of 128, MLP 6144, tied.
    config = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
              "tie_word_embeddings": True}  # fmt: skip
    shape = shape_from_hf_config(config)
    attention = 2048 * (16 * 128 + 2 * 8 * 128) + 16 * 128 * 2048 + 2 * 128  # q, k, v, o, q/k norms
    mlp = 3 * 2048 * 6144
    layer = attention + mlp + 2 * 2048
    assert shape.attention_params == attention
    assert shape.total_params == 8 * layer + 2048 + 151936 * 2048
    assert shape.active_params == shape.total_params
    assert shape.matmul_params_per_token == 8 * (attention + mlp) + 151936 * 2048


def test_qwen3_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = dict(BUILTIN_SHAPES["Qwen3-30B-A3B"], decoder_sparse_step=2, mlp_only_layers=[1])
    shape = shape_from_hf_config(config)
    # Layers 1, 3, 5, ... are sparse ((i + 1) % 2 == 0) except layer 1 (mlp_only): 23 MoE layers.
    assert shape.num_moe_layers == 23
    assert shape.num_dense_layers == 25


def test_mla_attention_parameters_by_hand():
    shape = builtin_shape("Kimi-K2")
    q = 7168 * 1536 + 1536 + 1536 * 64 * 192
    kv = 7168 * (512 + 64) + 512 + 512 * 64 * (128 + 128)
    out = 64 * 128 * 7168
    assert shape.attention_params == q + kv + out
    assert shape.is_mla and "MLA" in shape.note
    # Context parallel gathers the latent and the rope key, not 64 heads of K and V.
    assert shape.kv_elements_per_token == 512 + 64
    assert builtin_shape("Qwen3-30B-A3B").kv_elements_per_token == 4 * (128 + 128)


def test_model_path_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_SHAPES["GLM-4.5-Air"]))
    assert shape_from_model_path(tmp_path).total_params == builtin_shape("glm-4.5-air").total_params
    with pytest.raises(ValueError, match=r"no config\.json"):
        shape_from_model_path(tmp_path / "missing")
    with pytest.raises(ValueError, match="'hidden_size'"):
        shape_from_hf_config({"num_attention_heads": 2})
    with pytest.raises(ValueError, match="unknown shape"):
        builtin_shape("GPT-9")
