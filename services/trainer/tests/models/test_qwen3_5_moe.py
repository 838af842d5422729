"""Own Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`) against transformers' Qwen3_5MoeForCausalLM
on tiny random checkpoints (float32): logits and router choices, rows longer than a chunk, packed
rows against the samples run alone, router replay, the gradients of one loss, the HF state-dict
round trip (text and multimodal checkpoints); the Gated DeltaNet's forms (chunked against
recurrent, its causal convolution and state carried over, packed rows restarting both) and
against transformers' PyTorch path; the tiny-model maker's `qwen3.5-moe` family.

transformers runs its own PyTorch path on the CPU (`transformers_torch_path`: where
flash-linear-attention or causal-conv1d import, transformers binds their kernels in place of its
PyTorch functions whatever the device, and they cannot read host tensors); that path ignores
sample boundaries in packed rows (its DeltaNet state and convolution run across them), so packed
rows are compared with transformers' runs of each sample alone."""

import inspect
import pathlib

import pytest
import torch
import torch.nn.functional as F

from primerl_launcher.tiny_model import VOCAB_SIZE as TINY_VOCAB_SIZE
from primerl_launcher.tiny_model import TinyQwen3_5MoeSpec, make_tiny_model
from primerl_trainer.distributed.context_parallel import RowLayout
from primerl_trainer.models import export_hf_state_dict, load_model, read_hf_state_dict
from primerl_trainer.models.common.gated_delta_net import (
    GatedDeltaNet,
    fla_hopper_triton_problem,
    fla_unusable_reason,
    segments_of,
)
from primerl_trainer.models.common.gated_delta_rule import (
    causal_conv1d,
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from primerl_trainer.models.qwen3_5_moe.model import Qwen3_5MoeModel, Qwen3_5MoeModelArgs
from primerl_trainer.models.qwen3_5_moe.state_dict_adapter import Qwen3_5MoeStateDictAdapter
from primerl_trainer.models.registry import read_hf_config

from . import hf_parity
from .conftest import packed_inputs
from .hf_parity import reference, reference_forward

VOCAB_SIZE, NUM_EXPERTS = 96, 8
# The bounds (float32): logits against transformers, the chunked rule against the recurrent one.
LOGIT_TOLERANCE, RULE_TOLERANCE = 1e-4, 1e-5

TEXT = {
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    # Two value heads per key head.
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "tie_word_embeddings": True,
}
# The multimodal checkpoint: transformers' default layer rule (every 4th layer full), one value
# head per key head, an untied head (transformers' causal LM does not tie a multimodal
# checkpoint's head, whatever its config says).
MULTIMODAL = {
    "num_hidden_layers": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
}


@pytest.fixture(autouse=True, scope="module")
def transformers_torch_path():
    """transformers' Qwen3.5-MoE DeltaNet on its PyTorch functions (the CPU reference), even where
    fla's or causal-conv1d's kernels import and transformers bound those instead."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    with pytest.MonkeyPatch.context() as patch:
        for name in (
            "torch_chunk_gated_delta_rule",
            "torch_recurrent_gated_delta_rule",
            "causal_conv1d_fn",
            "causal_conv1d_update",
        ):
            torch_function = inspect.unwrap(getattr(modeling, name))
            assert torch_function.__module__ == modeling.__name__, f"{name}: {torch_function.__module__}"
            patch.setattr(modeling, name, torch_function)
        yield


def text_config(variant: dict) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 3,
        "initializer_range": 0.1,
        "dtype": "float32",
        **variant,
    }


def perturb(model: torch.nn.Module) -> None:
    """Every parameter moved off its init (zero-centred norm weights at 0, dt_bias at 1, ...)."""
    for parameter in model.parameters():
        parameter.add_(0.1 * torch.randn_like(parameter))


def make_checkpoint(path: pathlib.Path, variant: dict, *, multimodal: bool = False) -> pathlib.Path:
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    text = text_config(variant)
    if not multimodal:
        return hf_parity.save_random_checkpoint(
            path, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**text), perturb=perturb
        )
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    return hf_parity.save_random_checkpoint(path, Qwen3_5MoeForConditionalGeneration, config, perturb=perturb)


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return hf_parity.random_ids(*shape, vocab_size=VOCAB_SIZE, seed=seed)


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-5-moe-text"), TEXT)


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-5-moe-vl"), MULTIMODAL, multimodal=True)


@pytest.fixture(scope="module", params=["text", "multimodal"])
def checkpoint(request: pytest.FixtureRequest) -> pathlib.Path:
    return request.getfixturevalue(f"{request.param}_checkpoint")


def test_auto_picks_the_own_implementation(text_checkpoint: pathlib.Path, multimodal_checkpoint: pathlib.Path) -> None:
    text = load_model(text_checkpoint, impl="auto")
    assert isinstance(text, Qwen3_5MoeModel) and not text.args.multimodal
    assert text.args.layer_types == tuple(TEXT["layer_types"]) and text.args.rotary_dim == 4
    assert text.args.moe_layers == (0, 1, 2) and text.lm_head is None
    vl = load_model(multimodal_checkpoint, impl="auto")
    assert isinstance(vl, Qwen3_5MoeModel) and vl.args.multimodal and vl.lm_head is not None
    assert vl.args.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    # The DeltaNet's chunked form rounds otherwise than transformers' (1.2e-5 seen on a CI machine).
    hf_parity.assert_batch_matches(
        load_model(checkpoint, impl="custom"), reference(checkpoint), tolerance=LOGIT_TOLERANCE
    )


@pytest.mark.parametrize("chunk_size", [64, 16])
@torch.no_grad()
def test_rows_longer_than_a_chunk_equal_transformers(text_checkpoint: pathlib.Path, chunk_size: int) -> None:
    own, hf = load_model(text_checkpoint, impl="custom"), reference(text_checkpoint)
    for module in own.modules():
        if isinstance(module, GatedDeltaNet):
            module.chunk_size = chunk_size
    input_ids = random_ids(2, 150, seed=3)
    logits, expert_ids = reference_forward(hf, input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= 1e-4
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)


@torch.no_grad()
def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    """Samples shorter than the convolution (1, 2 tokens) and longer than a chunk (70)."""
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    samples, input_ids, position_ids = packed_inputs([6, 1, 13, 2, 70, 3], seed=5)
    samples = [sample % VOCAB_SIZE for sample in samples]
    packed = own(input_ids % VOCAB_SIZE, position_ids)
    separate = [reference_forward(hf, sample) for sample in samples]
    assert (packed.logits - torch.cat([logits for logits, _ in separate], dim=1)).abs().max() <= LOGIT_TOLERANCE
    assert torch.equal(packed.routed_experts.sort(dim=-1).values, torch.cat([ids for _, ids in separate]))
    # The trainer's row layout (no context parallel) gives the same.
    layout = RowLayout.of(position_ids[0], cp_rank=0, cp_size=1)
    laid_out = own(input_ids % VOCAB_SIZE, position_ids, row_layout=layout)
    assert (laid_out.logits - packed.logits).abs().max() <= LOGIT_TOLERANCE


def test_replaying_transformers_routing_gives_its_logits(text_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(text_checkpoint, impl="custom"), reference(text_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)


def test_one_step_gradients_equal_transformers(text_checkpoint: pathlib.Path) -> None:
    """Packed rows against transformers running each sample alone (its packed rows would leak the
    DeltaNet state)."""
    own, hf = load_model(text_checkpoint, impl="custom"), reference(text_checkpoint)
    # As the logits: 3 of 3,072 embedding gradients 2.1e-5 apart on a CI machine.
    hf_parity.assert_packed_gradients_match_samples_alone(
        own, hf, Qwen3_5MoeStateDictAdapter, [9, 30, 7], atol=LOGIT_TOLERANCE
    )


def test_hf_to_own_to_hf_is_bit_exact(text_checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(text_checkpoint)


def test_multimodal_round_trip_keeps_the_language_model(multimodal_checkpoint: pathlib.Path) -> None:
    """The vision tower is not the trainer's: the rest comes back under its names, bit-exact."""
    original = read_hf_state_dict(multimodal_checkpoint)
    exported = export_hf_state_dict(load_model(multimodal_checkpoint, impl="custom"))
    vision = {key for key in original if key.startswith("model.visual.")}
    assert vision and exported.keys() == original.keys() - vision
    assert all(key.startswith("model.language_model.") for key in exported.keys() - {"lm_head.weight"})
    for name, tensor in exported.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name


def test_mtp_layers_are_dropped(text_checkpoint: pathlib.Path) -> None:
    mtp = {"mtp.fc.weight": torch.zeros(32, 64), "mtp.layers.0.mlp.gate.weight": torch.zeros(8, 32)}
    hf_parity.assert_extra_layers_dropped(
        text_checkpoint, Qwen3_5MoeStateDictAdapter, mtp=mtp, unknown="model.layers.0.linear_attn.unknown.weight"
    )


def test_stacked_experts_load_like_per_expert_ones(text_checkpoint: pathlib.Path) -> None:
    model = load_model(text_checkpoint, impl="custom")
    adapter = Qwen3_5MoeStateDictAdapter(model.args)
    hf_state_dict = read_hf_state_dict(text_checkpoint)
    stacked = {key: value for key, value in hf_state_dict.items() if ".mlp.experts." not in key}
    for layer in range(model.args.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(NUM_EXPERTS)
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [hf_state_dict[f"{prefix}.{e}.gate_proj.weight"], hf_state_dict[f"{prefix}.{e}.up_proj.weight"]]
                )
                for e in experts
            ]
        )
        stacked[f"{prefix}.down_proj"] = torch.stack([hf_state_dict[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    loaded, wanted = adapter.from_hf(stacked), adapter.from_hf(hf_state_dict)
    assert loaded.keys() == wanted.keys()
    assert all(torch.equal(loaded[key], wanted[key]) for key in wanted)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"attention_bias": True}, r"attention_bias"),
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, r"layer_types must name"),
        ({"layer_types": ["full_attention"]}, r"layer_types must name"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.05}},
            r"partial_rotary",
        ),
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\) must be a multiple"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
    ],
)
def test_bad_configs_are_refused(text_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    config = read_hf_config(text_checkpoint) | change
    with pytest.raises(ValueError, match=match):
        Qwen3_5MoeModel(Qwen3_5MoeModelArgs.from_hf_config(config))


# The Gated DeltaNet's own forms.


def rule_inputs(num_seqs: int, seq_len: int, *, num_heads: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "q": l2_normalize(randn(num_seqs, seq_len, num_heads, 8)),
        "k": l2_normalize(randn(num_seqs, seq_len, num_heads, 8)),
        "v": randn(num_seqs, seq_len, num_heads, 6),
        # Decays from ~0.4 to ~1 per token, write strengths in (0, 1).
        "g": -F.softplus(randn(num_seqs, seq_len, num_heads)),
        "beta": torch.sigmoid(randn(num_seqs, seq_len, num_heads)),
    }


@pytest.mark.parametrize("chunk_size", [64, 16, 7])
def test_chunked_and_recurrent_forms_agree(chunk_size: int) -> None:
    inputs = rule_inputs(2, 100)
    initial_state = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    for state in (None, initial_state):
        chunked, chunked_final = chunked_gated_delta_rule(
            **inputs, scale=8**-0.5, chunk_size=chunk_size, initial_state=state
        )
        recurrent, recurrent_final = recurrent_gated_delta_rule(**inputs, scale=8**-0.5, initial_state=state)
        assert (chunked - recurrent).abs().max() <= RULE_TOLERANCE
        assert (chunked_final - recurrent_final).abs().max() <= RULE_TOLERANCE


def test_rule_state_carries_over_a_split() -> None:
    """A sequence run in two parts, the second from the first's final state, equals one run."""
    inputs = rule_inputs(1, 90, seed=2)
    whole, whole_final = chunked_gated_delta_rule(**inputs, scale=0.5, chunk_size=16)
    first, state = chunked_gated_delta_rule(**{k: v[:, :37] for k, v in inputs.items()}, scale=0.5, chunk_size=16)
    second, final = chunked_gated_delta_rule(
        **{k: v[:, 37:] for k, v in inputs.items()}, scale=0.5, chunk_size=16, initial_state=state
    )
    assert (torch.cat([first, second], dim=1) - whole).abs().max() <= RULE_TOLERANCE
    assert (final - whole_final).abs().max() <= RULE_TOLERANCE


def test_rules_equal_transformers_torch_path() -> None:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    inputs = rule_inputs(2, 80, seed=3)
    raw_q, raw_k = inputs["q"] * 3.0, inputs["k"] * 0.5  # transformers normalises them itself
    reference_args = {"query": raw_q, "key": raw_k, "value": inputs["v"], "g": inputs["g"], "beta": inputs["beta"]}
    ours = {
        "q": l2_normalize(raw_q),
        "k": l2_normalize(raw_k),
        "v": inputs["v"],
        "g": inputs["g"],
        "beta": inputs["beta"],
    }
    chunked, _ = chunked_gated_delta_rule(**ours, scale=8**-0.5)
    recurrent, _ = recurrent_gated_delta_rule(**ours, scale=8**-0.5)
    theirs_chunked, _ = torch_chunk_gated_delta_rule(**reference_args, use_qk_l2norm_in_kernel=True)
    theirs_recurrent, _ = torch_recurrent_gated_delta_rule(**reference_args, use_qk_l2norm_in_kernel=True)
    assert (chunked - theirs_chunked).abs().max() <= RULE_TOLERANCE
    assert (recurrent - theirs_recurrent).abs().max() <= RULE_TOLERANCE


def test_causal_conv_state_carries_over_a_split() -> None:
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(2, 11, 5, generator=generator), torch.randn(5, 4, generator=generator)
    whole, whole_state = causal_conv1d(x, weight)
    # The reference: silu of a plain zero-padded depthwise convolution.
    expected = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None], groups=5)).transpose(1, 2)
    assert (whole - expected).abs().max() <= 1e-6
    for split in (1, 2, 6):
        first, state = causal_conv1d(x[:, :split], weight)
        second, final = causal_conv1d(x[:, split:], weight, initial_state=state)
        assert (torch.cat([first, second], dim=1) - whole).abs().max() <= 1e-6
        assert torch.equal(final, whole_state)


def gated_delta_net(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(
        dim=16, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=4, conv_width=4, norm_eps=1e-6, impl="torch"
    )
    with torch.no_grad():
        perturb(layer)
    return layer


@torch.no_grad()
def test_packed_rows_restart_the_state_at_each_sample() -> None:
    layer = gated_delta_net()
    lengths = [1, 2, 5, 40, 3]
    x = torch.randn(1, sum(lengths), 16, generator=torch.Generator().manual_seed(5))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    segments = segments_of(position_ids)
    assert segments is not None and segments.num_samples == len(lengths) and segments.max_len == 40
    packed = layer(x, segments)
    alone = torch.cat([layer(part) for part in x.split(lengths, dim=1)], dim=1)
    assert (packed - alone).abs().max() <= RULE_TOLERANCE
    # Run as one sample, the later samples would read the earlier ones' state.
    assert (layer(x) - alone)[:, lengths[0] :].abs().max() > 1e-3
    # Two rows of packed samples: no sample crosses a row's end.
    rows = torch.cat([x, x.flip(1)])
    two_rows = layer(rows, segments_of(position_ids.expand(2, -1)))
    second_row = torch.cat([layer(part) for part in x.flip(1).split(lengths, dim=1)], dim=1)
    assert (two_rows - torch.cat([alone, second_row])).abs().max() <= RULE_TOLERANCE
    # Rows that are one sample each need no segments.
    assert segments_of(torch.arange(9)[None].expand(2, 9)) is None


def test_packed_gradients_equal_separate_runs() -> None:
    layer = gated_delta_net(seed=1)
    lengths = [3, 20, 1, 9]
    x = torch.randn(1, sum(lengths), 16, generator=torch.Generator().manual_seed(6), requires_grad=True)
    segments = segments_of(torch.cat([torch.arange(n) for n in lengths])[None])
    layer(x, segments).pow(2).sum().backward()
    packed = {name: p.grad.clone() for name, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x.grad = None
    sum(layer(part).pow(2).sum() for part in x.split(lengths, dim=1)).backward()
    alone = {name: p.grad for name, p in layer.named_parameters()} | {"x": x.grad}
    for name, grad in packed.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, alone[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("capability", "triton", "tilelang", "usable"),
    [
        ((9, 0), "3.6.0", False, False),
        ((9, 0), "3.4.0", False, False),
        ((9, 0), "3.7.0+git1234", False, False),
        ((9, 0), "3.7.1", False, True),
        ((9, 0), "3.3.1", False, True),
        ((9, 0), "3.6.0", True, True),
        ((8, 0), "3.6.0", False, True),
        ((10, 0), "3.6.0", False, True),
    ],
)
def test_fla_is_unusable_on_hopper_with_the_triton_fla_refuses(
    capability: tuple[int, int], triton: str, tilelang: bool, usable: bool
) -> None:
    reason = fla_hopper_triton_problem(capability, triton, tilelang)
    assert (reason is None) == usable
    if reason is not None:
        assert triton in reason and "tilelang" in reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernels_equal_the_torch_path_on_cuda(dtype: torch.dtype) -> None:
    """flash-linear-attention's varlen kernels (impl "fla") against the PyTorch path on packed rows
    with samples shorter than the convolution and longer than a chunk: outputs and gradients."""
    if (reason := fla_unusable_reason(torch.cuda.current_device())) is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    layer = GatedDeltaNet(
        dim=256, num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64, conv_width=4, norm_eps=1e-6
    )
    with torch.no_grad():
        perturb(layer)
    layer = layer.to("cuda", dtype)
    lengths = [3, 200, 1, 70, 130]
    x = torch.randn(1, sum(lengths), 256, device="cuda", dtype=dtype)
    segments = segments_of(torch.cat([torch.arange(n) for n in lengths])[None].cuda())
    results = {}
    for impl in ("torch", "fla"):
        layer.impl = impl
        layer.zero_grad()
        out = layer(x, segments)
        out.float().pow(2).mean().backward()
        results[impl] = [out, *(p.grad for p in layer.parameters())]
    # fla's float32 products may run in TF32.
    tolerance = 5e-3 if dtype == torch.float32 else 5e-2
    for got, wanted in zip(results["fla"], results["torch"], strict=True):
        error = (got.float() - wanted.float()).norm() / wanted.float().norm()
        assert error <= tolerance, error


@pytest.mark.gpu
@torch.no_grad()
def test_model_on_cuda_equals_transformers(tiny_checkpoint: pathlib.Path) -> None:
    """float32 on CUDA, packed rows, against transformers' runs of each sample on the CPU: the
    PyTorch path within the CPU's bound, fla's kernels (when importable) within TF32's."""
    own = load_model(tiny_checkpoint, impl="custom", dtype=torch.float32, device="cuda")
    samples, input_ids, position_ids = packed_inputs([6, 1, 90, 13], seed=8)
    hf = reference(tiny_checkpoint)
    expected = torch.cat([reference_forward(hf, sample)[0] for sample in samples], dim=1)
    impls = {"torch": LOGIT_TOLERANCE}
    if fla_unusable_reason(torch.cuda.current_device()) is None:
        impls["fla"] = 5e-3
    for impl, tolerance in impls.items():
        for module in own.modules():
            if isinstance(module, GatedDeltaNet):
                module.impl = impl
        logits = own(input_ids.cuda(), position_ids.cuda()).logits.cpu()
        assert (logits - expected).abs().max() <= tolerance, impl


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny-model maker's Qwen3.5-MoE (tiny vocabulary, DeltaNet and full attention layers)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-5-moe") / "qwen3.5", family="qwen3.5-moe")


@torch.no_grad()
def test_tiny_model_maker_writes_a_qwen3_5_moe_checkpoint(tiny_checkpoint: pathlib.Path) -> None:
    path = tiny_checkpoint
    own = load_model(path, impl="auto", dtype=torch.float32)
    assert isinstance(own, Qwen3_5MoeModel) and set(own.args.layer_types) == {"linear_attention", "full_attention"}
    samples, input_ids, position_ids = packed_inputs([30, 12], seed=7)
    hf = reference(path)
    separate = [reference_forward(hf, sample) for sample in samples]
    out = own(input_ids, position_ids)
    assert (out.logits - torch.cat([logits for logits, _ in separate], dim=1)).abs().max() <= 1e-4
    assert torch.equal(out.routed_experts.sort(dim=-1).values, torch.cat([ids for _, ids in separate]))


GDN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(tiny_checkpoint: pathlib.Path, lora: bool) -> None:
    """hf_parity.assert_rl_step_changes_loss; with LoRA its targets (attention, shared expert and
    routed experts) are adapted, the routers and the shared expert's gate are not, nor the
    DeltaNet projections, which that check does not name (the next test does)."""
    hf_parity.assert_rl_step_changes_loss(
        tiny_checkpoint, lora=lora, unadapted=("router.gate", "shared_experts_gate", *GDN_PROJECTIONS)
    )


def test_lora_adapts_the_linear_attention_projections(tiny_checkpoint: pathlib.Path) -> None:
    """The DeltaNet projections as LoRA targets: adapted, trained by a backward, exported under
    PEFT's names of the hub's modules."""
    from primerl_trainer.config import LoRAConfig
    from primerl_trainer.export import exported_tensors
    from primerl_trainer.lora import apply_lora

    model = load_model(tiny_checkpoint, impl="custom", dtype=torch.float32)
    linear_layers = [i for i, kind in enumerate(model.args.layer_types) if kind == "linear_attention"]
    adapted = apply_lora(model, LoRAConfig(enabled=True, rank=4, target_modules=list(GDN_PROJECTIONS)))
    assert set(adapted) == {f"layers.{i}.attention.{name}.weight" for i in linear_layers for name in GDN_PROJECTIONS}
    model(random_ids(1, 12) % TINY_VOCAB_SIZE).logits.pow(2).mean().backward()
    lora_grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    # B starts at zero, so only B gets a gradient on the first step.
    assert all(grad.abs().sum() > 0 for name, grad in lora_grads.items() if name.endswith("lora_B"))
    state = model.state_dict().items()
    adapter = dict(exported_tensors(model, state, kind="adapter", dtype=torch.float32, lora_scale=2.0))
    assert adapter.keys() == {
        f"base_model.model.model.layers.{i}.linear_attn.{name}.lora_{ab}.weight"
        for i in linear_layers
        for name in GDN_PROJECTIONS
        for ab in "AB"
    }
    layer = f"base_model.model.model.layers.{linear_layers[0]}.linear_attn"
    # q and k of 2 key heads, v of 4 value heads, 32 dims each.
    assert adapter[f"{layer}.in_proj_qkv.lora_B.weight"].shape == (2 * 2 * 32 + 4 * 32, 4)
    assert adapter[f"{layer}.out_proj.lora_A.weight"].shape == (4, 4 * 32)


def test_expert_parallel_trains_as_one_process(tiny_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """ep=2 over 2 CPU ranks, as hf_parity.assert_expert_parallel_trains_as_one_process runs it, with
    the DeltaNet layers and the gated shared expert beside the split experts (no correction
    biases). The step resumed under plain FSDP is held to test_expert_parallel's bounds, whose
    gradient norm after an Adam step is 1e-4 relative (2.6e-5 seen here; the hf_parity check asks
    1e-5)."""
    from ..test_expert_parallel import METRICS, _assert_matches_one_process, _run_workers, make_ep_data

    batches, data = make_ep_data(tiny_checkpoint, tmp_path)
    torch.save(torch.load(batches) | {"resume": True}, batches)
    out = tmp_path / "out"
    out.mkdir()
    result = _run_workers(tiny_checkpoint, batches, out, nproc=2, ep=2)
    _assert_matches_one_process(result, data["reference"], data["probe_routed_experts"])
    for key in METRICS:
        wanted = data["reference"]["metrics"][2][key]
        rel = 1e-4 if key == "grad_norm" else 1e-5
        assert result["resumed_metrics"][key] == pytest.approx(wanted, rel=rel, abs=1e-5), key


def test_context_parallel_trains_as_one_process(tmp_path: pathlib.Path) -> None:
    """cp=2 over 2 CPU ranks (hf_parity.assert_context_parallel_trains_as_one_process: packed rows,
    a one-sample row, a row shorter than 2 * cp, replayed routing): the DeltaNet layers pass
    their recurrent and convolution states between the ranks (dropping either fails this), the
    gated attention gathers keys and values."""
    spec = TinyQwen3_5MoeSpec(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    model_dir = make_tiny_model(tmp_path / "cp-qwen3.5-moe", family="qwen3.5-moe", spec=spec)
    hf_parity.assert_context_parallel_trains_as_one_process(model_dir, tmp_path)
