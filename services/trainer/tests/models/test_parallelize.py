"""The parallelize functions on one CPU rank (gloo): FSDP2 + activation checkpointing leave
the forward, the gradients and the exported names as they were."""

import json
import pathlib

import pytest
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

from primerl_trainer.models import load_model, model_spec_of, read_hf_state_dict

from .conftest import random_ids
from .hf_parity import assert_sharded_model_matches


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_untied_path(moe_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny MoE with a head of its own (as Qwen3-30B-A3B has)."""
    path = tmp_path_factory.mktemp("moe-untied")
    config = json.loads((moe_path / "config.json").read_text()) | {"tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    tensors = read_hf_state_dict(moe_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].flip(0).contiguous()
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("kind", ["dense", "moe", "moe_untied"])
def test_fsdp_and_activation_checkpointing_keep_forward_and_gradients(
    request: pytest.FixtureRequest, mesh, kind: str
) -> None:
    path: pathlib.Path = request.getfixturevalue(f"{kind}_path")
    reference, model = load_model(path), load_model(path)
    model_spec_of(model).parallelize_fn(model, dp_mesh=mesh, param_dtype=None, activation_checkpointing=True)
    assert_sharded_model_matches(reference, model, {"input_ids": random_ids(2, 12)}, path)
