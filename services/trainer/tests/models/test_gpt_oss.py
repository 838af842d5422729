"""Own GPT-OSS (`gpt_oss`) against transformers' GptOssForCausalLM on tiny random checkpoints
(float32, transformers' eager attention: it has no SDPA path for sinks): logits and router
choices with sliding and full layers, sinks, biases, clamped SwiGLU and YaRN; packed rows with a
window shorter than the samples; router replay; the gradient of one loss; the HF state-dict round
trip, MXFP4 expert checkpoints and the Hugging Face export; refused configs; the attention
windows and sinks themselves (sdpa and flex, batched, packed); expert parallel over 2 CPU ranks."""

import functools
import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from primerl_launcher.tiny_model import TinyGptOssSpec, make_tiny_model
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.common.attention import attention, build_attention_mask, document_ids
from primerl_trainer.models.gpt_oss.model import GptOssModel
from primerl_trainer.models.gpt_oss.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from primerl_trainer.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from primerl_trainer.models.registry import read_hf_config

from . import hf_parity
from .hf_parity import TOLERANCE, reference_forward

VOCAB_SIZE, NUM_LAYERS, NUM_EXPERTS, WINDOW = 96, 3, 8, 4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000.0,
    "factor": 4.0,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
# Sliding, full, sliding layers (window 4, shorter than every test prompt), YaRN, q/k/v/o bias,
# a SwiGLU limit low enough that both clamps act.
FULL = {
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": WINDOW,
    "rope_parameters": YARN,
    "attention_bias": True,
    "num_experts_per_tok": 2,
    "swiglu_limit": 0.4,
}
# The other branches: full attention everywhere, default RoPE, no attention bias, top-3, hub limit.
PLAIN = {
    "layer_types": ["full_attention"] * NUM_LAYERS,
    "sliding_window": WINDOW,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    "attention_bias": False,
    "num_experts_per_tok": 3,
    "swiglu_limit": 7.0,
}


def make_config(variant: dict):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=NUM_EXPERTS,
        max_position_embeddings=256,
        initializer_range=0.2,
        dtype="float32",
        **variant,
    )


def make_checkpoint(path: pathlib.Path, variant: dict, *, seed: int = 0) -> pathlib.Path:
    """A tiny GptOssForCausalLM with random weights, biases and sinks (transformers initialises
    expert biases at zero), saved as a Hugging Face folder."""
    from transformers import GptOssForCausalLM

    def random_biases(model: nn.Module) -> None:
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                parameter.normal_(std=0.5)

    return hf_parity.save_random_checkpoint(
        path, GptOssForCausalLM, make_config(variant), perturb=random_biases, seed=seed
    )


reference = functools.partial(hf_parity.reference, attn_implementation="eager")


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return hf_parity.random_ids(*shape, vocab_size=VOCAB_SIZE, seed=seed)


checkpoint, full_checkpoint, plain_checkpoint = hf_parity.checkpoint_fixtures(
    make_checkpoint, "gpt-oss", full=FULL, plain=PLAIN
)


def test_auto_picks_the_own_implementation(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="auto")
    assert isinstance(model, GptOssModel)
    args = model.args
    assert args.layer_windows == (WINDOW, None, WINDOW) and args.moe_layers == (0, 1, 2)
    assert (args.rope.factor, args.swiglu_limit, args.top_k) == (4.0, 0.4, 2)
    assert model.layers["0"].attention.sinks.abs().sum() > 0


def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_batch_matches(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    """Samples of 6, 13 and 3 tokens in one row; the window (4) is shorter than two of them.
    (Not against transformers' packed forward: GptOssModel builds its masks without the position
    ids, so its packed rows attend across samples.)"""
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    hf_parity.assert_packed_matches_separate_runs(own, hf, hf_packs=False)


def test_flex_backend_equals_sdpa(full_checkpoint: pathlib.Path) -> None:
    """The flex path (windows as BlockMasks, sinks through the log-sum-exp) on packed rows."""
    hf_parity.assert_flex_equals_sdpa(full_checkpoint)


def test_replaying_transformers_routing_gives_its_logits(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)


def test_replay_weighs_forced_experts_by_the_softmax_over_their_logits(full_checkpoint: pathlib.Path) -> None:
    """Experts outside the router's choice: weights are the softmax of the biased router logits
    at them; the router's weight and bias get gradients."""
    own = load_model(full_checkpoint, impl="custom")
    router = own.layers["1"].moe.router
    x = torch.randn(4, own.args.dim)
    forced = torch.tensor([[0, 1], [7, 3], [5, 4], [2, 6]])
    scores, ids = router(x, forced)
    assert torch.equal(ids, forced)
    torch.testing.assert_close(scores, router.gate(x).gather(-1, forced).softmax(dim=-1))

    num_tokens = 12
    input_ids = random_ids(1, num_tokens, seed=2)
    first = torch.arange(num_tokens) % NUM_EXPERTS
    routed = torch.stack([first, (first + 3) % NUM_EXPERTS], dim=-1)[:, None].expand(num_tokens, NUM_LAYERS, 2)
    out = own(input_ids, routed_experts=routed)
    assert torch.equal(out.routed_experts, routed)
    assert out.tokens_per_expert.sum() == num_tokens * 2 * NUM_LAYERS
    out.logits.pow(2).mean().backward()
    for layer in own.layers.values():
        assert layer.moe.router.gate.weight.grad.abs().sum() > 0 and layer.moe.router.gate.bias.grad.abs().sum() > 0


def test_one_step_gradients_equal_transformers(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    # One sample per row: transformers' GPT-OSS lets packed samples see each other.
    hf_parity.assert_one_step_gradients_match(own, hf, GptOssStateDictAdapter, packed=False)


def test_hf_to_own_to_hf_is_bit_exact(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(checkpoint)


def test_unknown_and_incomplete_expert_tensors_are_refused(full_checkpoint: pathlib.Path) -> None:
    hf_state_dict = read_hf_state_dict(full_checkpoint)
    adapter = GptOssStateDictAdapter(load_model(full_checkpoint, impl="custom").args)
    with pytest.raises(ValueError, match="unexpected tensor"):
        adapter.from_hf(hf_state_dict | {"model.layers.1.mlp.unknown.weight": torch.zeros(1)})
    del hf_state_dict["model.layers.1.mlp.experts.down_proj_bias"]
    with pytest.raises(ValueError, match=r"layer 1 must hold mlp.experts.gate_up_proj and down_proj"):
        adapter.from_hf(hf_state_dict)


def test_mxfp4_codes_round_trip() -> None:
    """Values MXFP4 holds exactly (e2m1 magnitudes times a power of two per 32) come back exactly;
    others round to the nearest code of their block's scale."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = magnitudes[torch.randint(0, 8, (3, 4, 64), generator=generator)]
    signs = torch.where(torch.rand(3, 4, 64, generator=generator) < 0.5, -1.0, 1.0)
    exponents = torch.randint(-6, 3, (3, 4, 2, 1), generator=generator).float()
    exact = (codes * signs).unflatten(-1, (2, 32)) * torch.exp2(exponents)
    exact[..., 0] = 6.0 * torch.exp2(exponents[..., 0])  # each block's largest magnitude sets its scale
    exact = exact.flatten(-2)
    blocks, scales = quantize_mxfp4(exact)
    assert blocks.shape == (3, 4, 2, 16) and scales.shape == (3, 4, 2) and blocks.dtype == scales.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=torch.float32), exact)
    assert torch.equal(dequantize_mxfp4(blocks, scales), exact.bfloat16())
    # transformers' dequantization (it returns the experts' input-major layout), and in slices.
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), exact)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("primerl_trainer.models.gpt_oss.mxfp4._BLOCKS_PER_SLICE", 5)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=torch.float32), exact)
    noisy = torch.randn(5, 64, generator=generator)
    error = (dequantize_mxfp4(*quantize_mxfp4(noisy), dtype=torch.float32) - noisy).abs()
    # Half the largest gap between codes (2 between 4 and 6) at each block's scale.
    block_scale = torch.exp2(torch.ceil(torch.log2(noisy.unflatten(-1, (2, 32)).abs().amax(-1) / 6)))
    assert (error.unflatten(-1, (2, 32)) <= block_scale[..., None] + 1e-7).all()


def make_mxfp4_checkpoint(source: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """`source` with its experts' weights quantized to MXFP4 as the hub stores them
    (`<proj>_blocks`/`_scales`, output-major) and config.json's quantization_config saying so."""
    path.mkdir()
    tensors = {}
    for key, value in read_hf_state_dict(source).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(value.transpose(1, 2))
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        else:
            tensors[key] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = read_hf_config(source) | {
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@torch.no_grad()
def test_mxfp4_checkpoint_loads_and_equals_transformers_dequantized(
    full_checkpoint: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from transformers import Mxfp4Config

    path = make_mxfp4_checkpoint(full_checkpoint, tmp_path / "mxfp4")
    own = load_model(path, impl="auto", dtype=torch.float32)
    assert isinstance(own, GptOssModel)
    # The experts hold the dequantized values, not the originals.
    original = load_model(full_checkpoint, impl="custom")
    assert not torch.equal(own.layers["0"].moe.experts.w13, original.layers["0"].moe.experts.w13)
    assert torch.equal(own.layers["0"].moe.experts.w13_bias, original.layers["0"].moe.experts.w13_bias)
    # transformers dequantizes the experts into bf16 whatever the dtype asked: run it in float32.
    hf = reference(path, quantization_config=Mxfp4Config(dequantize=True)).float()
    assert hf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    input_ids = random_ids(2, 20, seed=6)
    logits, expert_ids = reference_forward(hf, input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= TOLERANCE
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)
    # bf16 loading dequantizes to the same values.
    bf16 = load_model(path, impl="auto", dtype=torch.bfloat16)
    assert torch.equal(bf16.layers["2"].moe.experts.w2.float(), own.layers["2"].moe.experts.w2)
    # Export is unquantized: the Hugging Face names of the dequantized weights, a config without
    # the source's quantization_config, and transformers loads it back as it is.
    hf_parity.assert_export_loads_back(path, tmp_path / "export", names_of=full_checkpoint, load_reference=reference)


def test_export_loads_back_in_transformers(full_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    hf_parity.assert_export_loads_back(full_checkpoint, tmp_path / "export", load_reference=reference)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, r"layer_types must name 3"),
        ({"layer_types": ["full_attention"] * 2}, r"layer_types must name 3"),
        ({"sliding_window": None}, r"sliding_window must be a positive"),
        ({"sliding_window": 0}, r"sliding_window must be a positive"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"original_max_position"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must lie in"),
        ({"num_local_experts": 0}, r"num_local_experts 0"),
        ({"swiglu_limit": 0.0}, r"swiglu_limit must be positive"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config \(quant_method 'fp8'\)"),
    ],
)
def test_bad_configs_are_refused(full_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    hf_parity.assert_config_refused(full_checkpoint, change, match)


def _reference_attention(q, k, v, position_ids, *, window, sinks):
    """Masked softmax over [scores, sink] in float64, the definition."""
    docs = document_ids(position_ids)
    rows = torch.arange(q.shape[1])
    allowed = (rows[:, None] >= rows) & (docs[:, :, None] == docs[:, None, :])
    if window is not None:
        allowed &= rows[:, None] - rows < window
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks[None, :, None, None].expand(*scores.shape[:-1], 1)), dim=-1)
    probs = scores.softmax(dim=-1)[..., : k.shape[1]]
    return torch.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("rows", ["batch", "packed", "layout-packed", "layout-one-sample", "layout-long"])
def test_attention_windows_and_sinks_are_the_definition(backend: str, rows: str) -> None:
    """Batched rows, a packed row, and rows given with their RowLayout (as the trainer gives
    them; one sample: sdpa's mask-free path without a window; long: flex's tiles of 128 keys
    empty, full and partial by the window)."""
    from primerl_trainer.distributed.context_parallel import RowLayout

    generator = torch.Generator().manual_seed(0)
    lengths, windows = ((390, 10), (3, 130)) if rows == "layout-long" else ((6, 13, 3), (3, 5))
    batch, seq_len, heads, kv_heads, head_dim = (2 if rows == "batch" else 1), sum(lengths), 4, 2, 8
    q = torch.randn(batch, seq_len, heads, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, seq_len, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    sinks = torch.randn(heads, generator=generator, dtype=torch.float64)
    if rows.endswith(("packed", "long")):
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    else:
        position_ids = torch.arange(seq_len).expand(batch, seq_len)
    layout = RowLayout.of(position_ids[0], cp_rank=0, cp_size=1) if rows.startswith("layout") else None
    mask = build_attention_mask(
        position_ids if rows == "packed" else None,
        backend=backend,
        batch_size=batch,
        seq_len=seq_len,
        device=q.device,
        layout=layout,
        sliding_windows=windows,
    )
    for window in (None, *windows):
        for sink in (None, sinks):
            out = attention(q, k, v, mask, sliding_window=window, sinks=sink)
            wanted = _reference_attention(q, k, v, position_ids, window=window, sinks=sink)
            assert (out - wanted).abs().max() <= 1e-12, (window, sink is not None)
    with pytest.raises(ValueError, match=r"sliding_window 4 was not among"):
        attention(q, k, v, mask, sliding_window=4)


def test_sink_gradients_equal_the_definition() -> None:
    """The sdpa path's gradients (q, k, v and the sinks) on a packed row with a window."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 22, h, 8, generator=generator, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=generator, dtype=torch.float64)
    position_ids = torch.cat([torch.arange(n) for n in (6, 13, 3)])[None]
    mask = build_attention_mask(
        position_ids, backend="sdpa", batch_size=1, seq_len=22, device=q.device, sliding_windows=[3]
    )
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    attention(*inputs[:3], mask, sliding_window=3, sinks=inputs[3]).pow(2).sum().backward()
    wanted = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    _reference_attention(*wanted[:3], position_ids, window=3, sinks=wanted[3]).pow(2).sum().backward()
    for got, ref in zip(inputs, wanted, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny-model maker's GPT-OSS (tiny vocabulary, window 8, sliding and full layers, YaRN)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss") / "gpt-oss", family="gpt-oss", dtype="bfloat16")


def test_tiny_model_maker_writes_a_gpt_oss_checkpoint(tiny_checkpoint: pathlib.Path) -> None:
    weights = read_hf_state_dict(tiny_checkpoint)
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert weights["model.layers.0.self_attn.sinks"].abs().sum() > 0
    own = hf_parity.assert_maker_checkpoint_equals_transformers(tiny_checkpoint, GptOssModel, load_reference=reference)
    assert own.args.layer_windows == (8, None, 8, None) and own.args.rope.factor == 8.0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(narrow_tiny_checkpoint: pathlib.Path, lora: bool) -> None:
    """hf_parity.assert_rl_step_changes_loss: with LoRA, q/k/v/o and the experts' stacks."""
    hf_parity.assert_rl_step_changes_loss(narrow_tiny_checkpoint, lora=lora)


@torch.no_grad()
def test_lora_adapter_of_fused_experts_is_the_merged_delta(full_checkpoint: pathlib.Path) -> None:
    """LoRA on GPT-OSS's experts: one A and B per expert for the fused gate_up (and for down);
    the published adapter (PEFT's 3D layout as vLLM reads it: gate_up under experts.base_layer,
    A [E * r, in], B [out, r * E] with HF's interleaved rows) times the scale is the merged
    weights' change under the hub's names."""
    from primerl_trainer.config import LoRAConfig
    from primerl_trainer.export import exported_tensors
    from primerl_trainer.lora import apply_lora

    model = load_model(full_checkpoint, impl="custom")
    base = hf_parity.export_hf_state_dict(model)
    rank, alpha = 2, 4.0
    adapted = apply_lora(model, LoRAConfig(enabled=True, rank=rank, alpha=alpha, target_modules=["q", "o", "experts"]))
    assert "layers.0.moe.experts.w13" in adapted and "layers.0.attention.wo.weight" in adapted
    generator = torch.Generator().manual_seed(3)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    state = list(model.state_dict().items())
    merged = dict(exported_tensors(model, iter(state), kind="weights", dtype=torch.float32, lora_scale=alpha / rank))
    adapter = dict(exported_tensors(model, iter(state), kind="adapter", dtype=torch.float32, lora_scale=None))
    prefix = "base_model.model.model.layers.1.mlp.experts"
    for hf_name, module in (("gate_up_proj", f"{prefix}.base_layer"), ("down_proj", prefix)):
        a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
        weight = f"model.layers.1.mlp.experts.{hf_name}"
        num_experts, in_features, out_features = base[weight].shape
        assert a.shape == (num_experts * rank, in_features) and b.shape == (out_features, rank * num_experts)
        a, b = a.view(num_experts, rank, in_features), b.view(out_features, rank, num_experts)
        for expert in range(num_experts):
            delta = (alpha / rank) * b[..., expert] @ a[expert]
            torch.testing.assert_close(merged[weight][expert] - base[weight][expert], delta.T)
    assert "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight" in adapter


@pytest.fixture(scope="module")
def narrow_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The maker's GPT-OSS at a smaller width, 2 layers (sliding, full), window 4 (CI time): the RL
    step and the runs over 2 ranks."""
    spec = TinyGptOssSpec(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        moe_intermediate_size=32, sliding_window=4,
    )  # fmt: skip
    return make_tiny_model(tmp_path_factory.mktemp("narrow-gpt-oss") / "gpt-oss", family="gpt-oss", spec=spec)


# ep=2 and cp=2 over 2 CPU ranks on the narrow checkpoint, in one launch (hf_parity.run_expert_and_context_parallel).
parallel_runs = hf_parity.parallel_runs_fixture("gpt-oss", "narrow_tiny_checkpoint")


def test_expert_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Losses, replay, LoRA (the fused experts' adapters split too) and resume under FSDP2 as one
    process; the experts' biases split with their weights."""
    hf_parity.assert_expert_parallel_matches(parallel_runs, num_routers=0)


def test_cp2_with_router_replay_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Context parallel over 2 CPU ranks (test_context_parallel's cp_worker, float64, replayed
    routing): windows by row index and sinks on this rank's queries over the gathered keys, with
    sdpa (dense and chunked masks) and flex (forward), equal one process."""
    # Softmax routing in float64 throughout: float64's bounds hold.
    hf_parity.assert_context_parallel_matches(parallel_runs, tolerances=(1e-10, 1e-10))


def test_flex_tiles_of_a_windowed_row_layout_follow_the_window() -> None:
    """The BlockMask's tiles (128 x 128) of a row layout with a window: every tile holding an
    allowed (query, key) pair is kept, a tile left unmasked ("full") holds only allowed pairs, and
    the window skips tiles the document rule alone keeps and keeps some full."""
    from primerl_trainer.distributed.context_parallel import RowLayout

    position_ids = torch.cat([torch.arange(n) for n in (600, 3, 100)])
    layout = RowLayout.of(position_ids, cp_rank=0, cp_size=1)
    mask = build_attention_mask(
        None, backend="flex", batch_size=1, seq_len=703, device=torch.device("cpu"), layout=layout,
        sliding_windows=[300],
    )  # fmt: skip
    docs, rows = layout.document_ids, torch.arange(703)
    causal = (rows[:, None] >= rows) & (docs[:, None] == docs)

    def tiles(block) -> tuple[torch.Tensor, torch.Tensor]:
        kept = torch.zeros(6, 6, dtype=torch.bool)
        full = torch.zeros(6, 6, dtype=torch.bool)
        for q_tile in range(6):
            kept[q_tile, block.kv_indices[0, 0, q_tile, : block.kv_num_blocks[0, 0, q_tile]]] = True
            full[q_tile, block.full_kv_indices[0, 0, q_tile, : block.full_kv_num_blocks[0, 0, q_tile]]] = True
        return kept | full, full

    def tile_any_all(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        padded = torch.nn.functional.pad(allowed, (0, 768 - 703, 0, 768 - 703))
        per_tile = padded.view(6, 128, 6, 128).transpose(1, 2).flatten(2)
        real = torch.nn.functional.pad(torch.ones(703, 703, dtype=torch.bool), (0, 65, 0, 65))
        real = real.view(6, 128, 6, 128).transpose(1, 2).flatten(2)
        return per_tile.any(-1), (per_tile | ~real).all(-1)

    for block, allowed in ((mask.block, causal), (mask.windowed[300].block, causal & (rows[:, None] - rows < 300))):
        kept, full = tiles(block)
        any_allowed, all_allowed = tile_any_all(allowed)
        assert torch.equal(kept, any_allowed) and (full <= all_allowed).all()
    windowed_kept, windowed_full = tiles(mask.windowed[300].block)
    assert windowed_kept.sum() < tiles(mask.block)[0].sum() and windowed_full.sum() > 0
