import math
import re

import pytest
import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.errors import InvalidArgument
from primerl_common.weights.fp8 import BLOCK, dequantize_blockwise
from primerl_common.weights.fp8_blocks import to_block_pairs
from primerl_weight_broadcaster.formats import convert
from primerl_weight_broadcaster.store import WeightStore

HF, KERNEL, FP8 = tensor_pb2.WEIGHT_FORMAT_HF, tensor_pb2.WEIGHT_FORMAT_KERNEL, tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8
HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE, NUM_EXPERTS, EXPERT_INTERMEDIATE = 256, 64, 4, 2, 384, 4, 128


def qwen3(*, moe: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors of a two-layer Qwen3 (dense) or Qwen3-MoE; shapes not all multiples of 128."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    tensors = {"model.embed_tokens.weight": randn(320, HIDDEN), "model.norm.weight": randn(HIDDEN)}
    for i in range(2):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.input_layernorm.weight": randn(HIDDEN),
            f"{layer}.post_attention_layernorm.weight": randn(HIDDEN),
            f"{layer}.self_attn.q_proj.weight": randn(NUM_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": randn(HIDDEN, NUM_HEADS * HEAD_DIM),
            f"{layer}.self_attn.q_norm.weight": randn(HEAD_DIM),
            f"{layer}.self_attn.k_norm.weight": randn(HEAD_DIM),
        }
        if moe:
            tensors[f"{layer}.mlp.gate.weight"] = randn(NUM_EXPERTS, HIDDEN)
            for e in range(NUM_EXPERTS):
                tensors |= {
                    f"{layer}.mlp.experts.{e}.gate_proj.weight": randn(EXPERT_INTERMEDIATE, HIDDEN),
                    f"{layer}.mlp.experts.{e}.up_proj.weight": randn(EXPERT_INTERMEDIATE, HIDDEN),
                    f"{layer}.mlp.experts.{e}.down_proj.weight": randn(HIDDEN, EXPERT_INTERMEDIATE),
                }
        else:
            tensors |= {
                f"{layer}.mlp.gate_proj.weight": randn(INTERMEDIATE, HIDDEN),
                f"{layer}.mlp.up_proj.weight": randn(INTERMEDIATE, HIDDEN),
                f"{layer}.mlp.down_proj.weight": randn(HIDDEN, INTERMEDIATE),
            }
    return tensors


def test_dense_kernel_format_fuses_qkv_and_gate_up():
    hf = qwen3(moe=False)
    kernel = convert(hf, KERNEL).tensors
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    assert torch.equal(
        kernel[f"{attn}.qkv_proj.weight"],
        torch.cat([hf[f"{attn}.q_proj.weight"], hf[f"{attn}.k_proj.weight"], hf[f"{attn}.v_proj.weight"]]),
    )
    assert torch.equal(
        kernel[f"{mlp}.gate_up_proj.weight"], torch.cat([hf[f"{mlp}.gate_proj.weight"], hf[f"{mlp}.up_proj.weight"]])
    )
    # Names as vLLM's Qwen3ForCausalLM registers its parameters; the rest keep their HF names.
    fused = {
        f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
    }
    unfused = {n for n in hf if not n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight"))}
    unfused -= {n for n in hf if n.endswith("up_proj.weight")}
    assert set(kernel) == fused | unfused
    assert all(kernel[n] is hf[n] for n in unfused)  # passed through, not copied


def test_moe_kernel_format_stacks_experts():
    hf = qwen3(moe=True)
    kernel = convert(hf, KERNEL).tensors
    experts = "model.layers.0.mlp.experts"
    w13, w2 = kernel[f"{experts}.routed_experts.w13_weight"], kernel[f"{experts}.routed_experts.w2_weight"]
    assert w13.shape == (NUM_EXPERTS, 2 * EXPERT_INTERMEDIATE, HIDDEN)
    assert w2.shape == (NUM_EXPERTS, HIDDEN, EXPERT_INTERMEDIATE)
    for e in range(NUM_EXPERTS):  # gate rows first (vLLM's shard w1), then up (w3)
        assert torch.equal(w13[e, :EXPERT_INTERMEDIATE], hf[f"{experts}.{e}.gate_proj.weight"])
        assert torch.equal(w13[e, EXPERT_INTERMEDIATE:], hf[f"{experts}.{e}.up_proj.weight"])
        assert torch.equal(w2[e], hf[f"{experts}.{e}.down_proj.weight"])
    assert not any(".experts.0." in name for name in kernel)
    assert kernel["model.layers.0.mlp.gate.weight"] is hf["model.layers.0.mlp.gate.weight"]


def test_incomplete_groups_are_refused():
    hf = qwen3(moe=True)
    del hf["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight: v_proj missing"):
        convert(hf, KERNEL)
    hf = qwen3(moe=True)
    del hf["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match="expert 2 lacks up_proj"):
        convert(hf, KERNEL)


def _within_e4m3_bound(restored: torch.Tensor, original: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    # 3 mantissa bits: a value rounds within 2^-4 of itself; tiny values hit the subnormal floor.
    rows, cols = original.shape
    scales = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return bool(torch.all((restored - original).abs() <= original.abs() * 2**-4 + scales * 2**-10 + 1e-12))


@pytest.mark.parametrize("moe", [False, True])
def test_fp8_format_has_vllm_block_fp8_shapes_and_dequantizes_within_the_e4m3_bound(moe: bool):
    hf = qwen3(moe=moe)
    kernel = convert(hf, KERNEL).tensors
    fp8 = convert(hf, FP8).tensors
    quantized = {n[: -len("_scale_inv")] for n in fp8 if n.endswith("_scale_inv")}
    linear = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "w13_weight", "w2_weight")
    assert quantized == {n for n in kernel if n.endswith(linear)}
    assert set(fp8) == set(kernel) | {f"{n}_scale_inv" for n in quantized}
    for name, tensor in kernel.items():
        if name not in quantized:  # embeddings, norms, the router: as they were
            assert fp8[name] is tensor
            continue
        weight, scale_inv = fp8[name], fp8[f"{name}_scale_inv"]
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == tensor.shape
        assert scale_inv.dtype == torch.float32
        # vLLM's Fp8LinearMethod.create_weights: weight [out, in], weight_scale_inv
        # [ceil(out/128), ceil(in/128)]; Fp8MoEMethod: w13 [E, 2*ceil(I/128), ceil(H/128)],
        # w2 [E, ceil(H/128), ceil(I/128)] (vLLM requires I % 128 == 0 for block FP8 MoE).
        *experts, rows, cols = tensor.shape
        assert tuple(scale_inv.shape) == (*experts, math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
        for original, q, s in zip(
            tensor.reshape(-1, rows, cols),
            weight.reshape(-1, rows, cols),
            scale_inv.reshape(-1, *scale_inv.shape[-2:]),
            strict=True,
        ):
            assert _within_e4m3_bound(dequantize_blockwise(q, s), original, s)


async def test_deltas_carry_whole_engine_modules_in_every_format():
    store = WeightStore()
    first = store.publish(1, qwen3(moe=True))
    second_hf = qwen3(moe=True)
    second_hf["model.layers.1.self_attn.k_proj.weight"] = second_hf["model.layers.1.self_attn.k_proj.weight"] + 1
    second_hf["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(HIDDEN, EXPERT_INTERMEDIATE)
    second = store.publish(2, second_hf)
    # HF: q/k/v of layer 1 (one qkv_proj in the engine) and every expert of layer 0.
    assert sorted(name for name, _ in second.tensors_since(1)) == sorted(
        [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
        + [
            f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
            for e in range(NUM_EXPERTS)
            for p in ("gate", "up", "down")
        ]
    )
    assert second.num_changed_tensors == 3 + 3 * NUM_EXPERTS
    fp8 = await store.in_format(second, FP8)
    assert fp8 is await store.in_format(second, FP8)  # converted once
    experts = "model.layers.0.mlp.experts.routed_experts"
    assert sorted(name for name, _ in fp8.tensors_since(1)) == [
        f"{experts}.w13_weight",
        f"{experts}.w13_weight_scale_inv",
        f"{experts}.w2_weight",
        f"{experts}.w2_weight_scale_inv",
        "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.1.self_attn.qkv_proj.weight_scale_inv",
    ]
    assert len(fp8.tensors_since(None)) == len(fp8.tensors) and fp8.num_changed_tensors == 6
    assert fp8.tensors_since(2) == []
    assert (await store.in_format(first, HF)) is first


def family_layer(model_type: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors of one MoE layer (model.layers.0) of `model_type`, named as its hub
    checkpoints name them, with the embedding (the families' particulars; shapes small)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    layer = "model.layers.0"
    attention = {
        f"{layer}.self_attn.{p}_proj.weight": randn(rows, HIDDEN)
        for p, rows in (("q", NUM_HEADS * HEAD_DIM), ("k", NUM_KV_HEADS * HEAD_DIM), ("v", NUM_KV_HEADS * HEAD_DIM))
    }
    tensors = {"model.embed_tokens.weight": randn(320, HIDDEN), **attention}
    tensors[f"{layer}.self_attn.o_proj.weight"] = randn(HIDDEN, NUM_HEADS * HEAD_DIM)
    per_expert = {
        "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2")),
        "afmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
        "laguna": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    }
    if model_type in per_expert:
        block, (gate, up, down) = per_expert[model_type]
        for e in range(NUM_EXPERTS):
            tensors |= {
                f"{layer}.{block}.experts.{e}.{gate}.weight": randn(EXPERT_INTERMEDIATE, HIDDEN),
                f"{layer}.{block}.experts.{e}.{up}.weight": randn(EXPERT_INTERMEDIATE, HIDDEN),
                f"{layer}.{block}.experts.{e}.{down}.weight": randn(HIDDEN, EXPERT_INTERMEDIATE),
            }
    shared = {
        f"{layer}.mlp.{shared}.{p}.weight": randn(*shape)
        for shared in ("shared_experts" if model_type == "afmoe" else "shared_expert",)
        for p, shape in (
            ("gate_proj", (EXPERT_INTERMEDIATE, HIDDEN)),
            ("up_proj", (EXPERT_INTERMEDIATE, HIDDEN)),
            ("down_proj", (HIDDEN, EXPERT_INTERMEDIATE)),
        )
    }
    if model_type == "gpt_oss":
        tensors |= {name.replace(".weight", ".bias"): randn(t.shape[0]) for name, t in attention.items()}
        tensors |= {
            f"{layer}.self_attn.sinks": randn(NUM_HEADS),
            f"{layer}.mlp.router.weight": randn(NUM_EXPERTS, HIDDEN),
            f"{layer}.mlp.experts.gate_up_proj": randn(NUM_EXPERTS, HIDDEN, 2 * EXPERT_INTERMEDIATE),
            f"{layer}.mlp.experts.gate_up_proj_bias": randn(NUM_EXPERTS, 2 * EXPERT_INTERMEDIATE),
            f"{layer}.mlp.experts.down_proj": randn(NUM_EXPERTS, EXPERT_INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.experts.down_proj_bias": randn(NUM_EXPERTS, HIDDEN),
        }
    elif model_type == "afmoe":
        tensors |= shared | {
            f"{layer}.self_attn.gate_proj.weight": randn(NUM_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.mlp.router.gate.weight": randn(NUM_EXPERTS, HIDDEN),
            f"{layer}.mlp.expert_bias": randn(NUM_EXPERTS),
        }
    elif model_type == "laguna":
        tensors |= shared | {
            f"{layer}.self_attn.g_proj.weight": randn(NUM_HEADS, HIDDEN),
            f"{layer}.mlp.gate.weight": randn(NUM_EXPERTS, HIDDEN),
            f"{layer}.mlp.experts.e_score_correction_bias": randn(NUM_EXPERTS),
        }
    elif model_type == "minimax_m2":
        tensors |= {
            f"{layer}.block_sparse_moe.gate.weight": randn(NUM_EXPERTS, HIDDEN),
            f"{layer}.block_sparse_moe.e_score_correction_bias": randn(NUM_EXPERTS),
        }
    return tensors


def test_gpt_oss_kernel_format_transposes_its_stacked_experts_and_renames_as_vllm():
    hf = family_layer("gpt_oss")
    kernel = convert(hf, KERNEL, "gpt_oss").tensors
    layer, experts = "model.layers.0", "model.layers.0.mlp.experts"
    # vLLM's GptOssForCausalLM: `attn` for self_attn, `embedding` for embed_tokens; the
    # interleaved gate/up columns kept as they are, each expert's weights transposed.
    assert torch.equal(kernel[f"{experts}.routed_experts.w13_weight"], hf[f"{experts}.gate_up_proj"].transpose(1, 2))
    assert torch.equal(kernel[f"{experts}.routed_experts.w2_weight"], hf[f"{experts}.down_proj"].transpose(1, 2))
    assert kernel[f"{experts}.routed_experts.w13_bias"] is hf[f"{experts}.gate_up_proj_bias"]
    assert kernel[f"{experts}.routed_experts.w2_bias"] is hf[f"{experts}.down_proj_bias"]
    qkv_bias = [hf[f"{layer}.self_attn.{p}_proj.bias"] for p in "qkv"]
    assert torch.equal(kernel[f"{layer}.attn.qkv_proj.bias"], torch.cat(qkv_bias))
    assert kernel["model.embedding.weight"] is hf["model.embed_tokens.weight"]
    assert kernel[f"{layer}.attn.sinks"] is hf[f"{layer}.self_attn.sinks"]
    assert not any(".self_attn." in name for name in kernel)
    with pytest.raises(ValueError, match=r"no block-FP8 kernel format for model_type 'gpt_oss'.*MXFP4"):
        convert(hf, FP8, "gpt_oss")


def test_each_family_fuses_only_what_vllm_fuses_and_keeps_its_names():
    afmoe = convert(family_layer("afmoe"), KERNEL, "afmoe").tensors
    # The attention's output gate is no MLP half; the router sits at mlp.gate in vLLM.
    assert "model.layers.0.self_attn.gate_proj.weight" in afmoe
    assert "model.layers.0.mlp.shared_experts.gate_up_proj.weight" in afmoe
    assert "model.layers.0.mlp.gate.weight" in afmoe and "model.layers.0.mlp.router.gate.weight" not in afmoe

    laguna = convert(family_layer("laguna"), KERNEL, "laguna").tensors
    # Laguna's shared expert stays unfused; its correction bias lives on the routed experts.
    shared_expert = {f"model.layers.0.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert shared_expert <= set(laguna)
    assert "model.layers.0.mlp.experts.routed_experts.e_score_correction_bias" in laguna

    hf = family_layer("minimax_m2")
    minimax = convert(hf, KERNEL, "minimax_m2").tensors
    w13 = minimax["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"]
    experts = "model.layers.0.block_sparse_moe.experts"
    for e in range(NUM_EXPERTS):  # w1 (gate) rows, then w3 (up)
        assert torch.equal(w13[e], torch.cat([hf[f"{experts}.{e}.w1.weight"], hf[f"{experts}.{e}.w3.weight"]]))
    assert (
        minimax["model.layers.0.block_sparse_moe.e_score_correction_bias"]
        is hf["model.layers.0.block_sparse_moe.e_score_correction_bias"]
    )


@pytest.mark.parametrize(
    ("model_type", "also_quantized"),
    [("afmoe", {"self_attn.gate_proj"}), ("laguna", {"self_attn.g_proj", "mlp.shared_expert.gate_proj"})],
)
def test_fp8_quantizes_each_family_s_own_linear_layers(model_type: str, also_quantized: set[str]):
    fp8 = convert(family_layer(model_type), FP8, model_type).tensors
    quantized = {n.removeprefix("model.layers.0.").removesuffix("_scale_inv") for n in fp8 if "scale_inv" in n}
    expected = {"self_attn.qkv_proj", "self_attn.o_proj"} | also_quantized
    assert {f"{n}.weight" for n in expected} | {"mlp.experts.routed_experts.w13_weight"} <= quantized
    assert all(fp8[f"model.layers.0.{n}"].dtype == torch.float8_e4m3fn for n in quantized)
    assert not any(n.endswith(("gate.weight", "embed_tokens.weight", "bias")) for n in quantized)  # routers etc.


def test_unknown_families_are_refused_for_kernel_formats_only():
    hf = qwen3(moe=True)
    assert convert(hf, HF, "llama4").tensors is hf
    with pytest.raises(ValueError, match="no vLLM kernel layout is known for model_type 'llama4'"):
        convert(hf, KERNEL, "llama4")


async def test_the_publish_s_model_type_decides_the_kernel_layout_and_survives_a_restart(tmp_path):
    from primerl_weight_broadcaster.spill import SpillFolder

    from .helpers import publish, running_broadcaster

    async with running_broadcaster(store={"spill_folder": str(tmp_path)}) as stub:
        await publish(stub, 1, family_layer("gpt_oss"), model_type="gpt_oss")
    restarted = WeightStore(SpillFolder(tmp_path))
    assert restarted.latest.model_type == "gpt_oss"
    kernel = await restarted.in_format(restarted.latest, KERNEL)
    assert "model.embedding.weight" in kernel.tensors and kernel.model_type == "gpt_oss"


# --- block-FP8 publishes (the trainer's publish.fp8_blocks) -------------------------------------

# The projections the trainer publishes in block FP8 (primerl_trainer.export's, written out here).
PUBLISHED_FP8 = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def fp8_published(tensors: dict[str, torch.Tensor], wanted=PUBLISHED_FP8.search) -> dict[str, torch.Tensor]:
    """`tensors` as a trainer with publish.fp8_blocks publishes them (bf16 first, as it publishes)."""
    bf16 = {name: t.bfloat16() for name, t in tensors.items()}
    return dict(to_block_pairs(bf16.items(), lambda name: wanted(name) is not None))


def assert_same_bits(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def dequantized_by_hand(published: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each block-FP8 pair of `published` as its bf16 weight (value times its block's scale)."""
    return {
        name: dequantize_blockwise(t, published[f"{name}_scale_inv"]).bfloat16()
        if t.dtype == torch.float8_e4m3fn
        else t
        for name, t in published.items()
        if not name.endswith("_scale_inv")
    }


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fp8_blocks_published_by_the_trainer_are_what_the_broadcaster_s_quantizer_makes(moe: bool):
    """kernel_fp8 from block-FP8 pairs (fused and stacked, quantized nowhere) equals kernel_fp8 of
    the same bf16 publish quantized by the broadcaster, bit for bit; the pairs carry about half
    the bytes of those weights."""
    bf16 = {name: t.bfloat16() for name, t in qwen3(moe=moe).items()}
    published = fp8_published(bf16)
    pairs = {name for name, t in published.items() if t.dtype == torch.float8_e4m3fn}
    assert pairs and all(f"{name}_scale_inv" in published for name in pairs)
    assert {name for name in bf16 if PUBLISHED_FP8.search(name)} == pairs

    from_blocks = convert(published, FP8)
    assert_same_bits(from_blocks.tensors, convert(bf16, FP8).tensors)
    # A fused weight changes when any part, or any part's scales, does.
    qkv = from_blocks.sources["model.layers.0.self_attn.qkv_proj.weight"]
    assert "model.layers.0.self_attn.k_proj.weight_scale_inv" in qkv and "model.layers.0.self_attn.k_proj.weight" in qkv
    sent = sum(t.numel() * t.element_size() for n, t in published.items() if n in pairs or n.endswith("_scale_inv"))
    assert sent < 0.52 * sum(t.numel() * t.element_size() for n, t in bf16.items() if n in pairs)


def test_fp8_blocks_reach_other_formats_dequantized():
    bf16 = {name: t.bfloat16() for name, t in qwen3(moe=True).items()}
    published = fp8_published(bf16)
    dequantized = dequantized_by_hand(published)
    assert_same_bits(convert(published, HF).tensors, dequantized)
    assert_same_bits(convert(published, KERNEL).tensors, convert(dequantized, KERNEL).tensors)


def test_fp8_blocks_that_do_not_fuse_as_they_are_are_quantized_again_whole():
    """Only q_proj in block FP8: its qkv_proj mixes parts, so the pair is dequantized and the
    fused weight quantized whole, as a bf16 publish of those values would be."""
    bf16 = {name: t.bfloat16() for name, t in qwen3(moe=False).items()}
    published = fp8_published(bf16, re.compile(r"\.q_proj\.weight$").search)
    dequantized = dequantized_by_hand(published)
    assert_same_bits(convert(published, FP8).tensors, convert(dequantized, FP8).tensors)


async def test_a_store_of_fp8_block_publishes_tracks_changes_and_converts_even_for_hf():
    store = WeightStore()
    first = store.publish(1, fp8_published(qwen3(moe=True)))
    changed = qwen3(moe=True)
    changed["model.layers.1.self_attn.o_proj.weight"] = changed["model.layers.1.self_attn.o_proj.weight"] * 2
    second = store.publish(2, fp8_published(changed))
    assert sorted(name for name, _ in second.tensors_since(1)) == [
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.o_proj.weight_scale_inv",
    ]
    hf = await store.in_format(second, HF)
    assert hf is not second and not any(name.endswith("_scale_inv") for name in hf.tensors)
    assert [name for name, _ in hf.tensors_since(1)] == ["model.layers.1.self_attn.o_proj.weight"]
    assert first.holds_block_fp8 and second.holds_block_fp8


def test_block_fp8_scales_that_do_not_fit_their_weight_are_refused_naming_them():
    published = fp8_published(qwen3(moe=False))
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    published[name] = published[name][:1]
    with pytest.raises(InvalidArgument, match=name):
        WeightStore().publish(1, published)
