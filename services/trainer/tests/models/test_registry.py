"""impl = auto | custom | hf, loading errors, export from transformers' model."""

import pathlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from primerl_trainer.models import HFCausalLM, export_hf_state_dict, load_model, model_spec_of, read_hf_state_dict
from primerl_trainer.models.qwen3.model import Qwen3Model
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel

from .conftest import random_ids


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A model type with no own implementation."""
    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_auto_picks_the_own_implementation(dense_path: pathlib.Path, moe_path: pathlib.Path) -> None:
    dense, moe = load_model(dense_path), load_model(moe_path)
    assert type(dense) is Qwen3Model
    assert type(moe) is Qwen3MoeModel
    assert model_spec_of(moe).model_type == "qwen3_moe"


def test_hf_returns_transformers_model(dense_path: pathlib.Path, moe_path: pathlib.Path) -> None:
    dense, moe = load_model(dense_path, impl="hf"), load_model(moe_path, impl="hf")
    assert isinstance(dense, HFCausalLM) and isinstance(dense.hf_model, Qwen3ForCausalLM)
    assert isinstance(moe, HFCausalLM) and isinstance(moe.hf_model, Qwen3MoeForCausalLM)
    with pytest.raises(ValueError, match="routed_experts"):
        moe(random_ids(1, 4), routed_experts=torch.zeros(4, 4, 2, dtype=torch.long))


def test_auto_falls_back_to_transformers_and_custom_refuses(llama_path: pathlib.Path) -> None:
    model = load_model(llama_path, impl="auto")
    assert isinstance(model.hf_model, LlamaForCausalLM)
    assert model(random_ids(1, 5) % 64).logits.shape == (1, 5, 64)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_model(llama_path, impl="custom")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_from_transformers_model_gives_checkpoint_names(request: pytest.FixtureRequest, kind: str) -> None:
    path = request.getfixturevalue(f"{kind}_path")
    original = read_hf_state_dict(path)
    exported = export_hf_state_dict(load_model(path, impl="hf"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_dtype_and_device_are_applied(moe_path: pathlib.Path) -> None:
    model = load_model(moe_path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model(random_ids(1, 6)).logits.dtype == torch.bfloat16


def test_loading_errors_raise_value_error(tmp_path: pathlib.Path, dense_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="impl must be one of"):
        load_model(dense_path, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="attn_backend"):
        load_model(dense_path, attn_backend="flash")(random_ids(1, 4))  # type: ignore[arg-type]
    (tmp_path / "config.json").write_text((dense_path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(tmp_path)
