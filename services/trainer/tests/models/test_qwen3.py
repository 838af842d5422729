"""Own Qwen3 (dense) against transformers on the tiny model (float32)."""

import json
import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.models import export_hf_state_dict, load_model, read_hf_state_dict
from primerl_trainer.models.qwen3.model import Qwen3Model, Qwen3ModelArgs

from .conftest import packed_inputs, random_ids

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(dense_path: pathlib.Path):
    return load_model(dense_path, impl="custom"), load_model(dense_path, impl="hf")


@torch.no_grad()
def test_logits_equal_transformers_on_a_batch(models) -> None:
    own, hf = models
    input_ids = random_ids(3, 24)
    logits = own(input_ids).logits
    assert logits.shape == (3, 24, own.args.vocab_size)
    assert (logits - hf(input_ids).logits).abs().max() <= TOLERANCE


@torch.no_grad()
def test_packed_samples_equal_separate_runs(models) -> None:
    own, hf = models
    samples, input_ids, position_ids = packed_inputs([9, 1, 14])
    packed = own(input_ids, position_ids).logits
    separate = torch.cat([hf(sample).logits for sample in samples], dim=1)
    assert (packed - separate).abs().max() <= TOLERANCE
    assert (packed - torch.cat([own(sample).logits for sample in samples], dim=1)).abs().max() <= TOLERANCE


@torch.no_grad()
def test_flex_attention_backend_equals_sdpa(dense_path: pathlib.Path, models) -> None:
    own, _ = models
    flex = load_model(dense_path, impl="custom", attn_backend="flex")
    _, input_ids, position_ids = packed_inputs([5, 11])
    assert (flex(input_ids, position_ids).logits - own(input_ids, position_ids).logits).abs().max() <= TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_to_own_to_hf_is_bit_exact(model_root: pathlib.Path, dtype: str) -> None:
    path = make_tiny_model(model_root / f"dense-{dtype}", kind="dense", seed=1, dtype=dtype)
    original = read_hf_state_dict(path)
    exported = export_hf_state_dict(load_model(path, impl="custom"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def test_untied_head_is_its_own_parameter_and_exported() -> None:
    args = Qwen3ModelArgs(
        vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, hidden_dim=32,
        norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
    )  # fmt: skip
    exported = export_hf_state_dict(Qwen3Model(args))
    assert "lm_head.weight" in exported
    assert "model.embed_tokens.weight" in exported


@torch.no_grad()
def test_bad_inputs_raise_value_error(models) -> None:
    own, _ = models
    with pytest.raises(ValueError, match="input_ids"):
        own(random_ids(8))
    with pytest.raises(ValueError, match="position_ids"):
        own(random_ids(1, 8), torch.arange(7)[None])
    with pytest.raises(ValueError, match="routed_experts"):
        own(random_ids(1, 8), routed_experts=torch.zeros(8, 4, 2, dtype=torch.long))


@pytest.mark.parametrize(
    "override",
    [{"attention_bias": True}, {"use_sliding_window": True}, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}],
)
def test_unsupported_config_raises_value_error(dense_path: pathlib.Path, override: dict) -> None:
    config = json.loads((dense_path / "config.json").read_text()) | override
    with pytest.raises(ValueError, match="impl='hf'"):
        Qwen3ModelArgs.from_hf_config(config)
