import math

import pytest
import torch

from primerl_common.weights.fp8 import (
    BLOCK,
    FP8_MAX,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_blockwise_reference,
    scale_shape,
)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 128), (1, 129), (1000, 77)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_within_e4m3_bound_and_shapes_match_vllm(shape, dtype):
    torch.manual_seed(sum(shape))
    weight = (torch.randn(shape) * torch.rand(shape[0], 1) * 3).to(dtype)
    quantized, scale_inv = quantize_blockwise(weight)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape
    assert scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))

    restored = dequantize_blockwise(quantized, scale_inv)
    original = weight.float()
    # e4m3 keeps 3 mantissa bits: a value rounds within 2^-4 of itself relative,
    # and values far below the block's amax hit the subnormal floor (2^-9 * scale).
    scales = scale_inv.repeat_interleave(BLOCK, 0)[: shape[0]].repeat_interleave(BLOCK, 1)[:, : shape[1]]
    bound = original.abs() * 2**-4 + scales * 2**-10
    assert torch.all((restored - original).abs() <= bound + 1e-12)


def test_scale_is_block_amax_over_448_with_partial_blocks_zero_padded():
    weight = torch.zeros(130, 260)
    weight[0, 0] = -4.48
    weight[129, 259] = 0.896  # alone in a partial corner block
    _, scale_inv = quantize_blockwise(weight)
    expected = torch.zeros(2, 3)
    expected[0, 0] = 4.48 / FP8_MAX
    expected[1, 2] = 0.896 / FP8_MAX
    assert torch.allclose(scale_inv, expected, rtol=0, atol=1e-9)


def test_block_maximum_maps_to_fp8_max_and_zero_blocks_stay_zero():
    weight = torch.zeros(256, 256)
    weight[:128, :128] = torch.linspace(-2, 7, 128 * 128).view(128, 128)
    quantized, scale_inv = quantize_blockwise(weight)
    assert quantized[:128, :128].float().abs().max().item() == FP8_MAX
    assert torch.count_nonzero(quantized[128:].float()) == 0 and scale_inv[1, 1] == 0


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.zeros(4))
    with pytest.raises(ValueError, match="cannot quantize"):
        quantize_blockwise(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_blockwise(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.zeros(1, 1))


def test_scale_shape():
    assert scale_shape(4096, 11008) == (32, 86)


@pytest.mark.gpu
def test_triton_kernel_equals_reference_bit_for_bit_and_a_cpu_s():
    """The GPU's blocks are the CPU's: a trainer quantizing on its GPU (publish.fp8_blocks) sends
    what the broadcaster would make on its CPU."""
    torch.manual_seed(0)
    for shape in [(4096, 4096), (1000, 3000), (129, 7)]:
        weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        quantized, scale_inv = quantize_blockwise(weight)
        for ref_q, ref_s in (quantize_blockwise_reference(weight), quantize_blockwise_reference(weight.cpu())):
            assert torch.equal(scale_inv.cpu(), ref_s.cpu())
            assert torch.equal(quantized.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu())
