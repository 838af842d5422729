import pytest
import torch

from primerl_common.weights.fp8 import dequantize_blockwise, quantize_blockwise
from primerl_common.weights.fp8_blocks import block_pairs, dequantized_pairs, to_block_pairs, whole_blocks


def named() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.q_proj.weight", torch.randn(256, 128, generator=generator).bfloat16()),
        ("a.k_proj.weight", torch.randn(100, 128, generator=generator).bfloat16()),  # not whole blocks
        ("a.norm.weight", torch.randn(128, generator=generator).bfloat16()),
        ("a.embed.weight", torch.randn(128, 128, generator=generator).bfloat16()),  # not wanted
    ]


def wanted(name: str) -> bool:
    return "_proj" in name


def test_wanted_weights_of_whole_blocks_become_pairs_the_others_pass_as_they_are():
    pairs = list(to_block_pairs(named(), wanted))
    assert [name for name, _ in pairs] == [
        "a.q_proj.weight",
        "a.q_proj.weight_scale_inv",
        "a.k_proj.weight",
        "a.norm.weight",
        "a.embed.weight",
    ]
    quantized, scale_inv = quantize_blockwise(named()[0][1])
    assert torch.equal(pairs[0][1].view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(pairs[1][1], scale_inv) and pairs[1][1].shape == (2, 1)
    assert torch.equal(pairs[2][1], named()[1][1]) and pairs[2][1].dtype == torch.bfloat16


def test_meta_tensors_give_the_pairs_shapes_and_dtypes_a_publish_announces():
    meta = [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in named()]
    planned = [(name, t.shape, t.dtype, t.is_meta) for name, t in to_block_pairs(meta, wanted)]
    real = [(name, t.shape, t.dtype, True) for name, t in to_block_pairs(named(), wanted)]
    assert planned == real


def test_pairs_are_found_and_dequantized_and_bad_scales_named():
    tensors = dict(to_block_pairs(named(), wanted))
    assert block_pairs(tensors) == {"a.q_proj.weight": "a.q_proj.weight_scale_inv"}
    restored = dequantized_pairs(tensors, block_pairs(tensors), torch.bfloat16)
    assert "a.q_proj.weight_scale_inv" not in restored and restored["a.q_proj.weight"].dtype == torch.bfloat16
    expected = dequantize_blockwise(tensors["a.q_proj.weight"], tensors["a.q_proj.weight_scale_inv"])
    assert torch.equal(restored["a.q_proj.weight"], expected.bfloat16())
    tensors["a.q_proj.weight_scale_inv"] = tensors["a.q_proj.weight_scale_inv"][:1]
    with pytest.raises(ValueError, match=r"a\.q_proj\.weight_scale_inv.*\(2, 1\)"):
        block_pairs(tensors)


def test_only_unquantized_floating_matrices_of_whole_blocks_qualify():
    assert whole_blocks(torch.zeros(128, 256))
    assert not whole_blocks(torch.zeros(128, 200))
    assert not whole_blocks(torch.zeros(2, 128, 128))
    assert not whole_blocks(torch.zeros(128, 128, dtype=torch.int32))
    assert not whole_blocks(torch.zeros(128, 128).to(torch.float8_e4m3fn))
