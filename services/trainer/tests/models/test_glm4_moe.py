"""Own GLM-4.5 (`glm4_moe`) against transformers' Glm4MoeForCausalLM on tiny random checkpoints
(float32): logits and router choices, packed rows, router replay, the gradient of one loss,
the HF state-dict round trip and the Hugging Face export; and the tiny-model maker's
`glm4-moe` kind; expert parallel over 2 CPU ranks."""

import pathlib

import pytest
import torch
import torch.nn.functional as F

from primerl_launcher.tiny_model import VOCAB_SIZE as TINY_VOCAB_SIZE
from primerl_launcher.tiny_model import TinyGlm4MoeSpec, make_tiny_model
from primerl_trainer.hf_export import export_hf_model
from primerl_trainer.models import export_hf_state_dict, load_model, read_hf_state_dict
from primerl_trainer.models.glm4_moe.model import Glm4MoeModel
from primerl_trainer.models.glm4_moe.state_dict_adapter import Glm4MoeStateDictAdapter

from .conftest import packed_inputs
from .hf_parity import hub_gradients, reference_forward

TOLERANCE = 1e-5
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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Glm4MoeForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers[config.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    model.save_pretrained(path)
    return path


def reference(path: pathlib.Path):
    from transformers import Glm4MoeForCausalLM

    return Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["full", "plain"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    variant = FULL if request.param == "full" else PLAIN
    return make_checkpoint(tmp_path_factory.mktemp(f"glm4-moe-{request.param}"), variant)


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("glm4-moe-full"), FULL)


def test_auto_picks_the_own_implementation(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="auto")
    assert isinstance(model, Glm4MoeModel)
    args = model.args
    assert args.moe_layers == (1, 2) and args.rotary_dim == 8 and args.num_shared_experts == 2
    assert (args.routing.num_groups, args.routing.top_k_groups, args.routing.scaling_factor) == (4, 2, 2.5)
    assert model.layers["1"].moe.router.e_score_correction_bias.abs().sum() > 0


@torch.no_grad()
def test_logits_and_routing_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    input_ids = random_ids(2, 20)
    out = own(input_ids)
    logits, expert_ids = reference_forward(hf, input_ids)
    assert (out.logits - logits).abs().max() <= TOLERANCE
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)
    assert out.tokens_per_expert.shape == (len(own.args.moe_layers), NUM_EXPERTS)


@torch.no_grad()
def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    samples, input_ids, position_ids = packed_inputs([6, 13, 3], seed=5)
    samples = [sample % VOCAB_SIZE for sample in samples]
    packed = own(input_ids % VOCAB_SIZE, position_ids)
    separate = [reference_forward(hf, sample) for sample in samples]
    assert (packed.logits - torch.cat([logits for logits, _ in separate], dim=1)).abs().max() <= TOLERANCE
    assert torch.equal(packed.routed_experts.sort(dim=-1).values, torch.cat([ids for _, ids in separate]))
    # transformers' own packed forward (position ids restarting) agrees too.
    logits, _ = reference_forward(hf, input_ids % VOCAB_SIZE, position_ids)
    assert (packed.logits - logits).abs().max() <= TOLERANCE


@torch.no_grad()
def test_replaying_transformers_routing_gives_its_logits(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    input_ids = random_ids(2, 16, seed=1)
    logits, expert_ids = reference_forward(hf, input_ids)
    replayed = own(input_ids, routed_experts=expert_ids.to(torch.uint8))
    assert torch.equal(replayed.routed_experts, expert_ids)
    assert (replayed.logits - logits).abs().max() <= TOLERANCE


def test_replay_takes_other_experts_with_the_same_weight_rule(full_checkpoint: pathlib.Path) -> None:
    """Forced experts outside the router's choice (even outside its kept groups): the weights
    are the sigmoid scores gathered there, renormalised and scaled; the gate gets gradients."""
    own = load_model(full_checkpoint, impl="custom")
    router = own.layers["1"].moe.router
    x = torch.randn(5, 32)
    forced = torch.tensor([[0, 1, 2], [3, 5, 7], [6, 4, 1], [0, 7, 3], [2, 3, 4]])
    scores, ids = router(x, forced)
    probs = torch.sigmoid(x @ router.gate.weight.T).gather(-1, forced)
    assert torch.equal(ids, forced)
    torch.testing.assert_close(scores, 2.5 * probs / probs.sum(-1, keepdim=True))

    input_ids = random_ids(1, 12, seed=2)
    first = torch.arange(12) % NUM_EXPERTS
    routed = torch.stack([first, (first + 3) % NUM_EXPERTS, (first + 5) % NUM_EXPERTS], dim=-1)
    routed = routed[:, None].expand(12, 2, 3)
    out = own(input_ids, routed_experts=routed)
    assert torch.equal(out.routed_experts, routed)
    out.logits.pow(2).mean().backward()
    for layer_id in own.args.moe_layers:
        gate = own.layers[str(layer_id)].moe.router
        assert gate.gate.weight.grad is not None and gate.gate.weight.grad.abs().sum() > 0
        assert not gate.e_score_correction_bias.requires_grad


def test_one_step_gradients_equal_transformers(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    _, input_ids, position_ids = packed_inputs([9, 7], seed=3)
    input_ids = input_ids % VOCAB_SIZE
    labels = input_ids[:, 1:].reshape(-1)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), labels)

    own_loss = loss(own(input_ids, position_ids).logits)
    ref_loss = loss(hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits)
    own_loss.backward()
    ref_loss.backward()
    assert abs(own_loss.item() - ref_loss.item()) <= TOLERANCE

    # transformers' gradients under the hub's names, then under the own ones.
    ref_grads = Glm4MoeStateDictAdapter(own.args).from_hf(hub_gradients(hf))
    own_grads = {name: p.grad for name, p in own.named_parameters()}
    assert own_grads.keys() == ref_grads.keys()
    for name, grad in own_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_hf_to_own_to_hf_is_bit_exact(full_checkpoint: pathlib.Path) -> None:
    original = read_hf_state_dict(full_checkpoint)
    exported = export_hf_state_dict(load_model(full_checkpoint, impl="custom"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_multi_token_prediction_layers_are_dropped(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="custom")
    hf_state_dict = read_hf_state_dict(full_checkpoint)
    mtp = {
        f"model.layers.{NUM_LAYERS}.eh_proj.weight": torch.zeros(32, 64),
        f"model.layers.{NUM_LAYERS}.mlp.experts.0.up_proj.weight": torch.zeros(16, 32),
    }
    adapter = Glm4MoeStateDictAdapter(model.args)
    assert adapter.from_hf(hf_state_dict | mtp).keys() == model.state_dict().keys()
    with pytest.raises(ValueError, match="unexpected tensor"):
        adapter.from_hf(hf_state_dict | {"model.layers.1.mlp.unknown.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": 3}, r"n_group \(3\) must be positive and divide the experts"),
        ({"n_group": 8}, r"at least 2 experts per group"),
        ({"topk_group": 5}, r"topk_group \(5\) must lie in"),
        ({"topk_group": 1, "num_experts_per_tok": 3}, r"top_k \(3\) exceeds"),
        ({"first_k_dense_replace": NUM_LAYERS}, r"first_k_dense_replace \(3\) leaves no"),
        ({"partial_rotary_factor": 0.05}, r"partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ],
)
def test_bad_configs_are_refused(full_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    from primerl_trainer.models.glm4_moe.model import Glm4MoeModelArgs
    from primerl_trainer.models.registry import read_hf_config

    config = read_hf_config(full_checkpoint) | change
    if "partial_rotary_factor" in change:
        config["rope_parameters"] = config["rope_parameters"] | change
    with pytest.raises(ValueError, match=match):
        Glm4MoeModel(Glm4MoeModelArgs.from_hf_config(config))


@torch.no_grad()
def test_export_loads_back_in_transformers(full_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="custom")
    generator = torch.Generator().manual_seed(7)
    for parameter in model.parameters():
        parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    out = export_hf_model(
        model,
        source_dir=full_checkpoint,
        out_dir=tmp_path / "export",
        dtype=torch.float32,
        lora_scale=None,
        is_destination=True,
        step=1,
    )
    assert read_hf_state_dict(out).keys() == read_hf_state_dict(full_checkpoint).keys()
    input_ids = random_ids(1, 10, seed=4)
    logits, _ = reference_forward(reference(out), input_ids)
    assert (model(input_ids).logits - logits).abs().max() <= TOLERANCE


@torch.no_grad()
def test_tiny_model_maker_writes_a_glm4_moe_checkpoint(tmp_path: pathlib.Path) -> None:
    path = make_tiny_model(tmp_path / "glm", kind="glm4-moe", dtype="bfloat16")
    weights = read_hf_state_dict(path)
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # the dense first layer
    own = load_model(path, impl="auto", dtype=torch.float32)
    assert isinstance(own, Glm4MoeModel) and own.args.moe_layers == (1, 2, 3)
    assert (own.args.routing.num_groups, own.args.rotary_dim, own.args.qk_norm) == (2, 32, True)
    input_ids = torch.randint(0, TINY_VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, expert_ids = reference_forward(reference(path), input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= 1e-4
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)


def test_expert_parallel_trains_as_one_process(tmp_path: pathlib.Path) -> None:
    """ep=2 on the CPU (gloo, torchrun), as test_expert_parallel runs Qwen3-MoE: same losses,
    replayed logprobs, updated and published weights, LoRA step and resume under FSDP2 as one
    process. The routers' correction biases (buffers) come back unchanged."""
    from ..test_expert_parallel import _assert_matches_one_process, _run_workers, make_ep_data

    spec = TinyGlm4MoeSpec(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=32,
    )
    model_dir = make_tiny_model(tmp_path / "ep-glm4-moe", kind="glm4-moe", spec=spec)
    batches, data = make_ep_data(model_dir, tmp_path)
    torch.save(torch.load(batches) | {"resume": True}, batches)
    out = tmp_path / "out"
    out.mkdir()
    result = _run_workers(model_dir, batches, out, nproc=2, ep=2)
    biases = {k: v for k, v in load_model(model_dir).state_dict().items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 2
    for name, bias in biases.items():
        assert torch.equal(result["weights"].pop(name), bias) and torch.equal(result["published"].pop(name), bias)
    _assert_matches_one_process(result, data["reference"], data["probe_routed_experts"])
    for key in ("loss", "grad_norm", "entropy"):
        wanted = data["reference"]["metrics"][2][key]
        assert result["resumed_metrics"][key] == pytest.approx(wanted, rel=1e-5, abs=1e-5), key
