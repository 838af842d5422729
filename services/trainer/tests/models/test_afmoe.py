"""Own AFMoE / Trinity (`afmoe`) against transformers' AfmoeForCausalLM on tiny random checkpoints
(float32): logits and router choices, packed rows, router replay, the gradient of one loss, the HF
state-dict round trip and the Hugging Face export, configs it cannot run; the tiny-model maker's
`afmoe` family; the RL step with and without LoRA; expert parallel over 2 CPU ranks."""

import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import TinyAfmoeSpec, make_tiny_model
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.afmoe.model import AfmoeModel
from primerl_trainer.models.afmoe.state_dict_adapter import AfmoeStateDictAdapter
from primerl_trainer.models.common.norms import RMSNorm

from . import hf_parity
from .hf_parity import reference

VOCAB_SIZE, NUM_LAYERS, NUM_EXPERTS = 96, 4, 8

# Every particular on: sliding layers (window 5, RoPE) between full ones (NoPE), muP embedding
# scale, q/k/v/o bias, route_scale, 2 shared experts, a dense first layer.
FULL = {
    "global_attn_every_n_layers": 2,
    "sliding_window": 5,
    "mup_enabled": True,
    "attention_bias": True,
    "route_scale": 2.5,
    "num_experts_per_tok": 3,
    "num_shared_experts": 2,
    "num_dense_layers": 1,
}
# The other branches: full attention only, no scale, no bias, no shared expert, no dense layer.
PLAIN = {
    "layer_types": ["full_attention"] * NUM_LAYERS,
    "mup_enabled": False,
    "attention_bias": False,
    "route_scale": 1.0,
    "num_experts_per_tok": 2,
    "num_shared_experts": 0,
    "num_dense_layers": 0,
}


def make_checkpoint(path: pathlib.Path, variant: dict, *, seed: int = 0) -> pathlib.Path:
    """A tiny AfmoeForCausalLM with random weights (large enough that routing is decided by the
    router, not by ties; transformers starts the router at zero), random expert biases and norm
    weights away from one, saved as a Hugging Face folder."""
    from transformers import AfmoeConfig, AfmoeForCausalLM

    fields = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": NUM_EXPERTS,
        "initializer_range": 0.2,
        "dtype": "float32",
    }
    config = AfmoeConfig(**(fields | variant))

    def perturb(model: torch.nn.Module) -> None:
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.normal_(std=0.1)
        for layer in model.model.layers[config.num_dense_layers :]:
            layer.mlp.expert_bias.normal_(std=0.1)
            layer.mlp.router.gate.weight.normal_(std=0.2)

    return hf_parity.save_random_checkpoint(path, AfmoeForCausalLM, config, perturb=perturb, seed=seed)


checkpoint, full_checkpoint, plain_checkpoint = hf_parity.checkpoint_fixtures(
    make_checkpoint, "afmoe", full=FULL, plain=PLAIN
)


def test_auto_picks_the_own_implementation(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="auto")
    assert isinstance(model, AfmoeModel)
    args = model.args
    assert args.moe_layers == (1, 2, 3) and args.num_shared_experts == 2 and args.mup
    assert args.layer_types == ("sliding_attention", "full_attention") * 2 and args.sliding_window == 5
    assert args.routing.scaling_factor == 2.5 and args.norm_topk_prob
    assert [block.attention.sliding_window for block in model.layers.values()] == [5, None, 5, None]
    assert model.layers["1"].moe.router.e_score_correction_bias.abs().sum() > 0


def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_batch_matches(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    """Samples packed in one row (longer than the window) equal transformers run on each alone.
    (transformers' AFMoE builds its masks without the position ids, so its own packed forward
    lets samples see each other: it is no reference here.)"""
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    hf_parity.assert_packed_matches_separate_runs(own, hf, hf_packs=False)


def test_flex_attention_equals_sdpa_with_sliding_windows(full_checkpoint: pathlib.Path) -> None:
    hf_parity.assert_flex_equals_sdpa(full_checkpoint)


def test_replaying_transformers_routing_gives_its_logits(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)


def test_replay_takes_other_experts_with_the_same_weight_rule(full_checkpoint: pathlib.Path) -> None:
    """Experts the router would not choose, weighed by the unbiased scores, renormalised, x 2.5."""
    own = load_model(full_checkpoint, impl="custom")
    hf_parity.assert_forced_experts_weighted_and_trained(own, scaling_factor=2.5)


def test_one_step_gradients_equal_transformers(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    # One sample per row: transformers' AFMoE does not keep packed samples apart.
    hf_parity.assert_one_step_gradients_match(own, hf, AfmoeStateDictAdapter, packed=False)


def test_hf_to_own_to_hf_is_bit_exact(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(checkpoint)


def test_norms_scale_before_the_cast_as_transformers_does(full_checkpoint: pathlib.Path) -> None:
    """In bf16 AFMoE's norms scale the float32 normalised values and cast once; the other
    families' norm (cast, then scale) rounds differently."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(full_checkpoint, dtype=torch.bfloat16)
    own = load_model(full_checkpoint, impl="custom", dtype=torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    hf_norm, own_norm = hf.model.layers[1].post_mlp_layernorm, own.layers["1"].post_ffn_norm
    assert torch.equal(own_norm(x), hf_norm(x))
    assert not torch.equal(RMSNorm.forward(own_norm, x), hf_norm(x))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_dense_layers": NUM_LAYERS}, r"num_dense_layers \(4\) must lie in"),
        ({"layer_types": ["full_attention"] * 3}, r"layer_types must name 4 layers"),
        ({"layer_types": ["chunked_attention"] * 4}, r"layer_types must name 4 layers"),
        ({"sliding_window": None}, r"sliding_window \(None\)"),
        ({"num_experts_per_tok": NUM_EXPERTS + 1}, r"top_k \(9\) exceeds"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"score_func": "softmax"}, r"score_func 'softmax'"),
        ({"route_norm": False}, r"route_norm False"),
        ({"n_group": 4, "topk_group": 2}, r"n_group 4 with topk_group 2"),
        ({"attention_dropout": 0.1}, r"attention_dropout 0.1"),
        ({"num_experts": 0}, r"num_experts 0"),
    ],
)
def test_bad_configs_are_refused(full_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    hf_parity.assert_config_refused(full_checkpoint, change, match)


def test_export_loads_back_in_transformers(full_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    hf_parity.assert_export_loads_back(full_checkpoint, tmp_path / "export")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-afmoe") / "afmoe", family="afmoe")


def test_tiny_model_maker_writes_an_afmoe_checkpoint(tiny_path: pathlib.Path) -> None:
    weights = read_hf_state_dict(tiny_path)
    assert weights["model.layers.1.mlp.expert_bias"].abs().sum() > 0
    assert weights["model.layers.1.mlp.router.gate.weight"].abs().sum() > 0
    own = hf_parity.assert_maker_checkpoint_equals_transformers(tiny_path, AfmoeModel)
    assert own.args.moe_layers == (1, 2, 3) and own.args.mup
    assert own.args.sliding_window == 8 and own.args.layer_types[:2] == ("sliding_attention", "full_attention")


@pytest.fixture(scope="module")
def narrow_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The maker's afmoe at a quarter of its width (CI time), its particulars unchanged."""
    spec = TinyAfmoeSpec(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128
    )
    return make_tiny_model(tmp_path_factory.mktemp("narrow-afmoe") / "afmoe", family="afmoe", spec=spec)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rl_step_changes_the_loss(narrow_tiny_path: pathlib.Path, lora: bool) -> None:
    """Every projection (the attention's output gates, target g, included) and expert stack takes
    LoRA."""
    hf_parity.assert_rl_step_changes_loss(narrow_tiny_path, lora=lora)


# ep=2 and cp=2 over 2 CPU ranks on the narrow checkpoint, in one launch (hf_parity.run_expert_and_context_parallel).
parallel_runs = hf_parity.parallel_runs_fixture("afmoe", "narrow_tiny_path")


def test_context_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Sliding windows and NoPE full layers, sandwich norms, gates and the shared expert on rows
    split zig-zag."""
    hf_parity.assert_context_parallel_matches(parallel_runs)


def test_expert_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Losses, replay, LoRA and resume under FSDP2 as one process; the routers' biases unchanged."""
    hf_parity.assert_expert_parallel_matches(parallel_runs, num_routers=3)
