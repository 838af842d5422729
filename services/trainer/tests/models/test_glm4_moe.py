"""Own GLM-4.5 (`glm4_moe`) against transformers' Glm4MoeForCausalLM on tiny random checkpoints
(float32): logits and router choices, packed rows, router replay, the gradient of one loss,
the HF state-dict round trip and the Hugging Face export; and the tiny-model maker's
`glm4-moe` family; the RL step; expert and context parallel over 2 CPU ranks."""

import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import TinyGlm4MoeSpec, make_tiny_model
from primerl_trainer.hf_export import export_hf_model
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.glm4_moe.model import Glm4MoeModel
from primerl_trainer.models.glm4_moe.state_dict_adapter import Glm4MoeStateDictAdapter

from . import hf_parity
from .hf_parity import reference

VOCAB_SIZE, NUM_LAYERS, NUM_EXPERTS = 96, 3, 8

# Every particular on: grouped top-k (4 groups of 2, best 2 kept), correction bias, renormalised
# and scaled weights, 2 shared experts, a dense first layer, partial rotary, q/k norm, q/k/v bias.
FULL = {
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "use_qk_norm": True,
    "attention_bias": True,
}
# The other branches: one group, raw sigmoid weights, no dense layer, full rotary, no norm, no bias.
PLAIN = {
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "use_qk_norm": False,
    "attention_bias": False,
    "partial_rotary_factor": 1.0,
}


def make_checkpoint(path: pathlib.Path, variant: dict, *, seed: int = 0) -> pathlib.Path:
    """A tiny Glm4MoeForCausalLM with random weights (large enough that routing is decided by
    the router, not by ties) and random correction biases, saved as a Hugging Face folder."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=NUM_EXPERTS,
        initializer_range=0.2,
        dtype="float32",
        **variant,
    )

    def random_biases(model: torch.nn.Module) -> None:
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)

    return hf_parity.save_random_checkpoint(path, Glm4MoeForCausalLM, config, perturb=random_biases, seed=seed)


checkpoint, full_checkpoint, plain_checkpoint = hf_parity.checkpoint_fixtures(
    make_checkpoint, "glm4-moe", full=FULL, plain=PLAIN
)


def test_auto_picks_the_own_implementation(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="auto")
    assert isinstance(model, Glm4MoeModel)
    args = model.args
    assert args.moe_layers == (1, 2) and args.rotary_dim == 8 and args.num_shared_experts == 2
    assert (args.routing.num_groups, args.routing.top_k_groups, args.routing.scaling_factor) == (4, 2, 2.5)
    assert model.layers["1"].moe.router.e_score_correction_bias.abs().sum() > 0


def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_batch_matches(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_packed_matches_separate_runs(load_model(checkpoint, impl="custom"), reference(checkpoint))


def test_replaying_transformers_routing_gives_its_logits(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)


def test_replay_takes_other_experts_with_the_same_weight_rule(full_checkpoint: pathlib.Path) -> None:
    """Even experts outside the router's kept groups; the weights are scaled by 2.5."""
    own = load_model(full_checkpoint, impl="custom")
    hf_parity.assert_forced_experts_weighted_and_trained(own, scaling_factor=2.5)


def test_one_step_gradients_equal_transformers(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_one_step_gradients_match(own, hf, Glm4MoeStateDictAdapter)


def test_hf_to_own_to_hf_is_bit_exact(full_checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(full_checkpoint)


def test_multi_token_prediction_layers_are_dropped(full_checkpoint: pathlib.Path) -> None:
    mtp = {
        f"model.layers.{NUM_LAYERS}.eh_proj.weight": torch.zeros(32, 64),
        f"model.layers.{NUM_LAYERS}.mlp.experts.0.up_proj.weight": torch.zeros(16, 32),
    }
    hf_parity.assert_extra_layers_dropped(
        full_checkpoint, Glm4MoeStateDictAdapter, mtp=mtp, unknown="model.layers.1.mlp.unknown.weight"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": 3}, r"n_group \(3\) must be positive and divide the experts"),
        ({"n_group": 8}, r"at least 2 experts per group"),
        ({"topk_group": 5}, r"topk_group \(5\) must lie in"),
        ({"topk_group": 1, "num_experts_per_tok": 3}, r"top_k \(3\) exceeds"),
        ({"first_k_dense_replace": NUM_LAYERS}, r"first_k_dense_replace \(3\) leaves no"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.05}},
            r"partial_rotary_factor 0.05 of head_dim 16",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ],
)
def test_bad_configs_are_refused(full_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    hf_parity.assert_config_refused(full_checkpoint, change, match)


def test_export_loads_back_in_transformers(full_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    hf_parity.assert_export_loads_back(full_checkpoint, tmp_path / "export")


def test_tiny_model_maker_writes_a_glm4_moe_checkpoint(tmp_path: pathlib.Path) -> None:
    path = make_tiny_model(tmp_path / "glm", family="glm4-moe", dtype="bfloat16")
    weights = read_hf_state_dict(path)
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # the dense first layer
    own = hf_parity.assert_maker_checkpoint_equals_transformers(path, Glm4MoeModel)
    assert own.args.moe_layers == (1, 2, 3)
    assert (own.args.routing.num_groups, own.args.rotary_dim, own.args.qk_norm) == (2, 32, True)


@pytest.fixture(scope="module")
def narrow_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The maker's GLM-4.5 (a dense first layer, 2 MoE layers, a shared expert, partial rotary) at
    a smaller width, for the runs over 2 ranks."""
    spec = TinyGlm4MoeSpec(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=32,
    )
    return make_tiny_model(tmp_path_factory.mktemp("narrow-glm4-moe") / "glm", family="glm4-moe", spec=spec)


# ep=2 and cp=2 over 2 CPU ranks on the narrow checkpoint, in one launch (hf_parity.run_expert_and_context_parallel).
parallel_runs = hf_parity.parallel_runs_fixture("glm4-moe", "narrow_tiny_path")


def test_expert_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Losses, replay, LoRA and resume under FSDP2 as one process; the 2 routers' correction
    biases unchanged."""
    hf_parity.assert_expert_parallel_matches(parallel_runs, num_routers=2)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny-model maker's GLM-4.5 (tiny vocabulary, a dense first layer, a shared expert)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-glm4-moe") / "glm", family="glm4-moe")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(narrow_tiny_path: pathlib.Path, lora: bool) -> None:
    """hf_parity.assert_rl_step_changes_loss; with LoRA the shared experts' and the dense layer's
    projections are adapted too."""
    hf_parity.assert_rl_step_changes_loss(narrow_tiny_path, lora=lora)


@torch.no_grad()
def test_export_and_publish_keep_the_correction_biases_in_float32(
    tiny_checkpoint: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A bfloat16 export or publish of a float32-trained model keeps the routers' correction
    biases in float32, as the hub's checkpoints (and the tiny maker's) store them; the rest is cast."""
    from primerl_trainer.export import exported_tensors, plan_export

    model = load_model(tiny_checkpoint, impl="custom", dtype=torch.float32)
    source = read_hf_state_dict(tiny_checkpoint)
    biases = {name for name in source if name.endswith("e_score_correction_bias")}
    assert len(biases) == 3
    out = export_hf_model(
        model,
        source_dir=tiny_checkpoint,
        out_dir=tmp_path / "export",
        dtype=torch.bfloat16,
        lora_scale=None,
        is_destination=True,
        step=1,
    )
    exported = read_hf_state_dict(out)
    published = dict(
        exported_tensors(model, model.state_dict().items(), kind="full", dtype=torch.bfloat16, lora_scale=None)
    )
    for tensors in (exported, published):
        assert tensors.keys() == source.keys()
        for name, tensor in tensors.items():
            if name in biases:
                assert tensor.dtype == torch.float32 and torch.equal(tensor, source[name]), name
            else:
                assert tensor.dtype == torch.bfloat16, name
    num_tensors, num_bytes = plan_export(model, kind="full", dtype=torch.bfloat16, lora_scale=None)
    assert (num_tensors, num_bytes) == (len(published), sum(t.numel() * t.element_size() for t in published.values()))


def test_lora_adapter_export_names_the_shared_experts(tiny_checkpoint: pathlib.Path) -> None:
    """gate/up/down adapt the dense layer's MLP and the shared experts, under PEFT's names."""
    from primerl_trainer.config import LoRAConfig
    from primerl_trainer.export import exported_tensors
    from primerl_trainer.lora import apply_lora

    model = load_model(tiny_checkpoint, impl="custom", dtype=torch.float32)
    apply_lora(model, LoRAConfig(enabled=True, rank=4, target_modules=["gate_proj", "up", "down"]))
    state = model.state_dict().items()
    adapter = dict(exported_tensors(model, state, kind="adapter", dtype=torch.float32, lora_scale=2.0))
    mlps = ["model.layers.0.mlp", *(f"model.layers.{i}.mlp.shared_experts" for i in (1, 2, 3))]
    width = {"model.layers.0.mlp": 512} | dict.fromkeys(mlps[1:], 128)
    assert adapter.keys() == {
        f"base_model.model.{mlp}.{proj}.lora_{ab}.weight"
        for mlp in mlps
        for proj in ("gate_proj", "up_proj", "down_proj")
        for ab in "AB"
    }
    for mlp in mlps:
        assert adapter[f"base_model.model.{mlp}.gate_proj.lora_B.weight"].shape == (width[mlp], 4)
        assert adapter[f"base_model.model.{mlp}.down_proj.lora_A.weight"].shape == (4, width[mlp])


def test_context_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Partial rotary, the dense first layer and the shared expert on a split row."""
    hf_parity.assert_context_parallel_matches(parallel_runs)
