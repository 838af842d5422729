"""Own Laguna (`laguna`) against transformers' LagunaForCausalLM on tiny random checkpoints
(float32): logits and router choices, packed rows, router replay, the gradient of one loss, the HF
state-dict round trip and the Hugging Face export, configs it cannot run; the tiny-model maker's
`laguna` family; the RL step with and without LoRA; expert parallel over 2 CPU ranks."""

import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import TinyLagunaSpec, make_tiny_model
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.laguna.model import LagunaModel
from primerl_trainer.models.laguna.state_dict_adapter import LagunaStateDictAdapter

from . import hf_parity
from .hf_parity import reference

VOCAB_SIZE, NUM_LAYERS, NUM_EXPERTS = 96, 4, 8

# Every particular on: sliding (window 5, whole-head default RoPE) and full layers (YaRN on half
# of each head), per-layer head counts, dense layers first and last, q/k/v/o bias, per-head
# gates, soft-capped router logits, a routed scaling factor, a shared expert.
FULL = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
    "num_attention_heads_per_layer": [4, 2, 6, 4],
    "sliding_window": 5,
    "rope_parameters": {
        "full_attention": {
            "rope_type": "yarn",
            "rope_theta": 500000.0,
            "partial_rotary_factor": 0.5,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
    "gating": "per-head",
    "attention_bias": True,
    "moe_router_logit_softcapping": 2.0,
    "moe_routed_scaling_factor": 2.5,
    "num_experts_per_tok": 3,
    "shared_expert_intermediate_size": 24,
}
# The other branches: full attention only with transformers' default RoPE (half of each head),
# one head count, the default dense first layer, no bias, per-element gates, raw logits, no
# scaling, no shared expert.
PLAIN = {
    "gating": "per-element",
    "attention_bias": False,
    "moe_router_logit_softcapping": 0.0,
    "moe_routed_scaling_factor": 1.0,
    "num_experts_per_tok": 3,
    "shared_expert_intermediate_size": 0,
}


def make_checkpoint(path: pathlib.Path, variant: dict, *, seed: int = 0) -> pathlib.Path:
    """A tiny LagunaForCausalLM with random weights (large enough that routing is decided by the
    router, not by ties), random correction biases, biases and norm weights away from one, saved
    as a Hugging Face folder."""
    from transformers import LagunaConfig, LagunaForCausalLM

    fields = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": NUM_EXPERTS,
        "max_position_embeddings": 64,
        "initializer_range": 0.2,
        "dtype": "float32",
    }
    config = LagunaConfig(**(fields | variant))

    def perturb(model: torch.nn.Module) -> None:
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "e_score_correction_bias")):
                parameter.normal_(std=0.1)

    return hf_parity.save_random_checkpoint(path, LagunaForCausalLM, config, perturb=perturb, seed=seed)


checkpoint, full_checkpoint, plain_checkpoint = hf_parity.checkpoint_fixtures(
    make_checkpoint, "laguna", full=FULL, plain=PLAIN
)


def test_auto_picks_the_own_implementation(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="auto")
    assert isinstance(model, LagunaModel)
    args = model.args
    assert args.moe_layers == (1, 2) and args.heads_per_layer == (4, 2, 6, 4) and args.gate_per_head
    assert (args.routing.scaling_factor, args.routing.logit_softcap) == (2.5, 2.0)
    assert args.rope_of("full_attention").rotary_dim == 8 and args.rope_of("full_attention").parameters.factor == 4.0
    assert args.rope_of("sliding_attention").rotary_dim == 16
    assert [block.attention.sliding_window for block in model.layers.values()] == [5, None, 5, None]
    assert [block.attention.wq.out_features for block in model.layers.values()] == [64, 32, 96, 64]
    assert model.layers["1"].moe.router.e_score_correction_bias.abs().sum() > 0


def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_batch_matches(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_packed_matches_separate_runs(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_flex_attention_equals_sdpa_with_sliding_windows(full_checkpoint: pathlib.Path) -> None:
    hf_parity.assert_flex_equals_sdpa(full_checkpoint)


def test_replaying_transformers_routing_gives_its_logits(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)


def test_replay_takes_other_experts_with_the_same_weight_rule(plain_checkpoint: pathlib.Path) -> None:
    """Experts the router would not choose, weighed by the unbiased sigmoid scores, renormalised."""
    own = load_model(plain_checkpoint, impl="custom")
    hf_parity.assert_forced_experts_weighted_and_trained(own, scaling_factor=1.0)


def test_soft_capped_scores_with_replayed_experts(full_checkpoint: pathlib.Path) -> None:
    """Replayed experts get the scores of the capped logits, renormalised, times 2.5."""
    router = load_model(full_checkpoint, impl="custom").layers["1"].moe.router
    x = 3 * torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    forced = torch.tensor([[0, 1, 2], [3, 5, 7], [6, 4, 1], [0, 7, 3]])
    scores, _ = router(x, forced)
    probs = torch.sigmoid(2.0 * torch.tanh(x @ router.gate.weight.T / 2.0)).gather(-1, forced)
    torch.testing.assert_close(scores, 2.5 * probs / probs.sum(-1, keepdim=True))


def test_one_step_gradients_equal_transformers(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_one_step_gradients_match(own, hf, LagunaStateDictAdapter)


def test_hf_to_own_to_hf_is_bit_exact(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(checkpoint)


def _with_rope(kind: str, **change: object) -> dict:
    ropes = FULL["rope_parameters"]
    return {"rope_parameters": ropes | {kind: ropes[kind] | change}}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["full_attention"] * 3}, r"layer_types must name 4 layers"),
        ({"mlp_layer_types": ["dense", "sparse", "moe", "dense"]}, r"mlp_layer_types must name 4 layers"),
        ({"mlp_layer_types": ["dense"] * 4}, r"mlp_layer_types leaves no mixture-of-experts"),
        ({"num_attention_heads_per_layer": [4, 3, 4, 4]}, r"num_attention_heads_per_layer must give 4"),
        ({"num_attention_heads_per_layer": [4, 4]}, r"num_attention_heads_per_layer must give 4"),
        ({"sliding_window": None}, r"sliding_window \(None\)"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, r"rope_parameters must hold one dict"),
        (_with_rope("full_attention", rope_type="llama3"), r"rope type 'llama3'"),
        (_with_rope("full_attention", truncate=False), r"truncate False is read by vLLM"),
        (_with_rope("sliding_attention", partial_rotary_factor=0.2), r"partial_rotary_factor 0.2"),
        ({"gating": "per-token"}, r"gating 'per-token'"),
        ({"moe_apply_router_weight_on_input": True}, r"moe_apply_router_weight_on_input"),
        ({"moe_router_logit_softcapping": -1.0}, r"moe_router_logit_softcapping \(-1.0\)"),
        ({"num_experts_per_tok": NUM_EXPERTS + 1}, r"top_k \(9\) exceeds"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
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
    return make_tiny_model(tmp_path_factory.mktemp("tiny-laguna") / "laguna", family="laguna")


def test_tiny_model_maker_writes_a_laguna_checkpoint(tiny_path: pathlib.Path) -> None:
    weights = read_hf_state_dict(tiny_path)
    assert weights["model.layers.1.mlp.experts.e_score_correction_bias"].abs().sum() > 0
    own = hf_parity.assert_maker_checkpoint_equals_transformers(tiny_path, LagunaModel)
    assert own.args.moe_layers == (1, 2, 3)
    assert own.args.heads_per_layer == (4, 8, 4, 8) and own.args.rope_of("full_attention").parameters.factor == 8.0


@pytest.fixture(scope="module")
def narrow_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The maker's laguna at a quarter of its width (CI time), its particulars unchanged."""
    spec = TinyLagunaSpec(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128
    )
    return make_tiny_model(tmp_path_factory.mktemp("narrow-laguna") / "laguna", family="laguna", spec=spec)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rl_step_changes_the_loss(narrow_tiny_path: pathlib.Path, lora: bool) -> None:
    """Every projection (the attention's output gates, target g, included) and expert stack takes
    LoRA."""
    hf_parity.assert_rl_step_changes_loss(narrow_tiny_path, lora=lora)


# ep=2 and cp=2 over 2 CPU ranks on the narrow checkpoint, in one launch (hf_parity.run_expert_and_context_parallel).
parallel_runs = hf_parity.parallel_runs_fixture("laguna", "narrow_tiny_path")


def test_context_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Per-kind RoPE (YaRN on half of each head), sliding windows, per-layer head counts and gates
    on rows split zig-zag."""
    hf_parity.assert_context_parallel_matches(parallel_runs)


def test_expert_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Losses, replay, LoRA and resume under FSDP2 as one process; the routers' biases unchanged."""
    hf_parity.assert_expert_parallel_matches(parallel_runs, num_routers=3)
