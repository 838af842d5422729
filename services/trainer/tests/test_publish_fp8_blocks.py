"""publish.fp8_blocks: the trainer publishes its projections as block-FP8 pairs, quantized by the
quantizer the weight broadcaster's kernel_fp8 format uses, and announces what it sends."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from primerl_common.config import ConfigError, load_config
from primerl_common.weights.fp8 import quantize_blockwise
from primerl_trainer.config import TrainerConfig
from primerl_trainer.export import count_tensors, exported_tensors, plan_export, published_tensors

from .tiny_training import load_tiny_model

PROJECTIONS = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def test_the_projections_go_as_block_fp8_pairs_and_the_plan_announces_them(moe_dir: pathlib.Path) -> None:
    model = load_tiny_model(moe_dir)
    exported = dict(
        exported_tensors(model, iter(model.state_dict().items()), kind="full", dtype=torch.bfloat16, lora_scale=None)
    )
    published = dict(published_tensors(iter(exported.items()), fp8_blocks=True))
    # The tiny MoE's projections are all of whole 128x128 blocks (hidden 256, experts of 128).
    projections = {name for name in exported if PROJECTIONS.search(name)}
    assert any(".experts." in name for name in projections)
    assert {name for name, t in published.items() if t.dtype == torch.float8_e4m3fn} == projections
    assert set(published) == set(exported) | {f"{name}_scale_inv" for name in projections}
    for name in set(exported) - projections:  # norms, router, embedding, head: as they were
        assert torch.equal(published[name], exported[name]), name
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    quantized, scale_inv = quantize_blockwise(exported[name])
    assert torch.equal(published[name].view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(published[f"{name}_scale_inv"], scale_inv)

    planned = plan_export(model, kind="full", dtype=torch.bfloat16, lora_scale=None, fp8_blocks=True)
    assert planned == count_tensors(published.items())
    assert planned[1] < 0.8 * count_tensors(exported.items())[1]


@pytest.mark.parametrize(
    "argv",
    [["--publish.transport", "collective"], ["--publish.kind", "adapter", "--lora.enabled", "true"]],
    ids=["collective", "adapter"],
)
def test_fp8_blocks_outside_a_full_grpc_publish_are_refused_naming_the_fields(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"publish\.fp8_blocks.*publish\.kind 'full'.*transport 'grpc'"):
        load_config(TrainerConfig, ["--model.path", "m", "--publish.fp8_blocks", "true", *argv])
