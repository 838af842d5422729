"""Own MiniMax-M2 (`minimax_m2`) against transformers' MiniMaxM2ForCausalLM on tiny random
checkpoints (float32): logits and router choices, packed rows, router replay, the gradient of
one loss, the HF state-dict round trip, configs it cannot run; the RL step on the tiny-model maker's
`minimax-m2`; expert and context parallel over 2 CPU ranks."""

import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import TinyMiniMaxM2Spec, make_tiny_model
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.minimax_m2.model import MiniMaxM2Model, MiniMaxM2ModelArgs
from primerl_trainer.models.minimax_m2.state_dict_adapter import MiniMaxM2StateDictAdapter
from primerl_trainer.models.registry import read_hf_config

from . import hf_parity
from .hf_parity import reference

VOCAB_SIZE, NUM_LAYERS, NUM_EXPERTS, TOP_K = 96, 2, 8, 3

# Partial rotary through the hub's legacy `rotary_dim` (8 of 16 dims), and the whole head.
PARTIAL = {"rotary_dim": 8}
FULL_ROTARY: dict = {}


def make_checkpoint(path: pathlib.Path, variant: dict, *, seed: int = 0) -> pathlib.Path:
    """A tiny MiniMaxM2ForCausalLM with random weights (large enough that routing is decided by
    the router, not by ties) and random correction biases, saved as a Hugging Face folder.
    `variant` adds to or overrides the config."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    fields = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "initializer_range": 0.2,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }
    config = MiniMaxM2Config(**(fields | variant))

    def random_biases_and_norms(model: torch.nn.Module) -> None:
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(std=0.1)
            # Non-trivial q/k norm weights, so that one weight per head dim would show.
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)

    return hf_parity.save_random_checkpoint(
        path, MiniMaxM2ForCausalLM, config, perturb=random_biases_and_norms, seed=seed
    )


checkpoint, partial_checkpoint, full_rotary_checkpoint = hf_parity.checkpoint_fixtures(
    make_checkpoint, "minimax-m2", partial=PARTIAL, full_rotary=FULL_ROTARY
)


def test_auto_picks_the_own_implementation(partial_checkpoint: pathlib.Path) -> None:
    model = load_model(partial_checkpoint, impl="auto")
    assert isinstance(model, MiniMaxM2Model)
    args = model.args
    assert args.moe_layers == (0, 1) and args.rotary_dim == 8 and args.moe_hidden_dim == 16
    assert (args.routing.num_groups, args.routing.scaling_factor, args.norm_topk_prob) == (1, 1.0, True)
    assert model.layers["0"].attention.q_norm.weight.shape == (4 * 16,)
    assert model.layers["0"].attention.k_norm.weight.shape == (2 * 16,)
    assert model.layers["1"].moe.router.e_score_correction_bias.abs().sum() > 0


def test_hub_config_fields(partial_checkpoint: pathlib.Path) -> None:
    """The hub's config.json names rotary_dim and rope_theta at the top, and fields transformers
    ignores; those that describe the model transformers runs are accepted."""
    config = read_hf_config(partial_checkpoint)
    del config["rope_parameters"], config["partial_rotary_factor"]
    hub = config | {
        "rotary_dim": 4,
        "rope_theta": 1e4,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "shared_intermediate_size": 0,
        "attn_type_list": [1] * NUM_LAYERS,
    }
    args = MiniMaxM2ModelArgs.from_hf_config(hub)
    assert (args.rotary_dim, args.rope_theta) == (4, 1e4)


def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_batch_matches(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_packed_matches_separate_runs(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_replaying_transformers_routing_gives_its_logits(partial_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(partial_checkpoint, impl="custom"), reference(partial_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)


def test_replay_takes_other_experts_with_the_same_weight_rule(partial_checkpoint: pathlib.Path) -> None:
    """The weights are renormalised and not scaled."""
    own = load_model(partial_checkpoint, impl="custom")
    hf_parity.assert_forced_experts_weighted_and_trained(own, scaling_factor=1.0)


def test_one_step_gradients_equal_transformers(partial_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(partial_checkpoint, impl="custom"), reference(partial_checkpoint)
    hf_parity.assert_one_step_gradients_match(own, hf, MiniMaxM2StateDictAdapter)


def test_hf_to_own_to_hf_is_bit_exact(partial_checkpoint: pathlib.Path) -> None:
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in read_hf_state_dict(partial_checkpoint)
    hf_parity.assert_hf_round_trip_is_bit_exact(partial_checkpoint)


def test_multi_token_prediction_layers_are_dropped(partial_checkpoint: pathlib.Path) -> None:
    mtp = {f"model.layers.{NUM_LAYERS}.block_sparse_moe.experts.0.w1.weight": torch.zeros(16, 32)}
    hf_parity.assert_extra_layers_dropped(
        partial_checkpoint,
        MiniMaxM2StateDictAdapter,
        mtp=mtp,
        unknown="model.layers.1.block_sparse_moe.unknown.weight",
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125}},
            r"rotary_dim \(5\)",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"num_local_experts": 0}, r"num_local_experts 0"),
        ({"num_experts_per_tok": NUM_EXPERTS + 1}, r"top_k \(9\) exceeds"),
        ({"router_jitter_noise": 0.1}, r"router_jitter_noise 0.1"),
        ({"scoring_func": "softmax"}, r"scoring_func 'softmax'"),
        ({"use_qk_norm": False}, r"use_qk_norm False"),
        ({"qk_norm_type": "per_head"}, r"qk_norm_type 'per_head'"),
        ({"shared_intermediate_size": 64}, r"shared_intermediate_size 64"),
        ({"attn_type_list": [0, 1]}, r"attn_type_list"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config \(quant_method 'fp8'\)"),
    ],
)
def test_bad_configs_are_refused(partial_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    hf_parity.assert_config_refused(partial_checkpoint, change, match)


@pytest.fixture(scope="module")
def narrow_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny-model maker's MiniMax-M2 (partial rotary, q/k norm over all heads) at a smaller
    width and 2 layers (CI time)."""
    spec = TinyMiniMaxM2Spec(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rotary_dim=16,
        moe_intermediate_size=32,
    )
    return make_tiny_model(tmp_path_factory.mktemp("narrow-minimax-m2") / "minimax-m2", family="minimax-m2", spec=spec)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(narrow_tiny_path: pathlib.Path, lora: bool) -> None:
    """hf_parity.assert_rl_step_changes_loss on the tiny-model maker's MiniMax-M2."""
    assert isinstance(load_model(narrow_tiny_path, impl="auto"), MiniMaxM2Model)
    hf_parity.assert_rl_step_changes_loss(narrow_tiny_path, lora=lora)


# ep=2 and cp=2 over 2 CPU ranks on the narrow checkpoint, in one launch (hf_parity.run_expert_and_context_parallel).
parallel_runs = hf_parity.parallel_runs_fixture("minimax-m2", "narrow_tiny_path")


def test_expert_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Losses, replay, LoRA and resume under FSDP2 as one process; the routers' correction biases
    unchanged."""
    hf_parity.assert_expert_parallel_matches(parallel_runs, num_routers=2)


def test_context_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Partial rotary and q/k norm over all heads on a split row."""
    hf_parity.assert_context_parallel_matches(parallel_runs)
