"""Own Qwen3-MoE against transformers on the tiny model (float32), router replay, and the
grouped-GEMM experts against the per-expert loop."""

import json
import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.models import export_hf_state_dict, load_model, read_hf_state_dict
from primerl_trainer.models.moe import MoE

from .conftest import packed_inputs, random_ids

TOLERANCE = 1e-4
NUM_MOE_LAYERS, TOP_K, NUM_EXPERTS = 4, 2, 8


@pytest.fixture(scope="module")
def models(moe_path: pathlib.Path):
    return load_model(moe_path, impl="custom"), load_model(moe_path, impl="hf")


@torch.no_grad()
def test_logits_and_routing_equal_transformers_on_a_batch(models) -> None:
    own, hf = models
    input_ids = random_ids(2, 20)
    out, ref = own(input_ids), hf(input_ids)
    assert (out.logits - ref.logits).abs().max() <= TOLERANCE
    assert out.routed_experts.shape == (2 * 20, NUM_MOE_LAYERS, TOP_K)
    assert torch.equal(out.routed_experts, ref.routed_experts)
    assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert)
    assert out.tokens_per_expert.sum(dim=1).tolist() == [2 * 20 * TOP_K] * NUM_MOE_LAYERS


@torch.no_grad()
def test_packed_samples_equal_separate_runs(models) -> None:
    own, hf = models
    samples, input_ids, position_ids = packed_inputs([6, 13, 3], seed=5)
    packed = own(input_ids, position_ids)
    separate = [hf(sample) for sample in samples]
    assert (packed.logits - torch.cat([s.logits for s in separate], dim=1)).abs().max() <= TOLERANCE
    assert torch.equal(packed.routed_experts, torch.cat([s.routed_experts for s in separate]))


@torch.no_grad()
def test_replaying_own_routing_gives_identical_logits(models) -> None:
    own, _ = models
    input_ids = random_ids(2, 16, seed=1)
    free = own(input_ids)
    replayed = own(input_ids, routed_experts=free.routed_experts.to(torch.uint8))
    assert torch.equal(replayed.logits, free.logits)
    assert torch.equal(replayed.routed_experts, free.routed_experts)


def test_replay_uses_given_experts_and_gate_gets_gradients(models) -> None:
    own, _ = models
    input_ids = random_ids(1, 12, seed=2)
    # Other experts than the model's own choice: every token takes experts (t, t+1) mod 8.
    first = torch.arange(12) % NUM_EXPERTS
    forced = torch.stack([first, (first + 1) % NUM_EXPERTS], dim=-1)[:, None].expand(12, NUM_MOE_LAYERS, TOP_K)
    own.zero_grad()
    out = own(input_ids, routed_experts=forced)
    assert torch.equal(out.routed_experts, forced)
    assert not torch.allclose(out.logits, own(input_ids).logits)
    out.logits.float().pow(2).mean().backward()
    for layer in own.layers.values():
        grad = layer.moe.router.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    own.zero_grad()


@pytest.mark.parametrize(
    ("routed_experts", "match"),
    [
        (torch.zeros(10, NUM_MOE_LAYERS, TOP_K, dtype=torch.long), r"routed_experts must have shape"),
        (torch.zeros(8, NUM_MOE_LAYERS - 1, TOP_K, dtype=torch.long), r"routed_experts must have shape"),
        (torch.zeros(8, NUM_MOE_LAYERS, TOP_K + 1, dtype=torch.long), r"routed_experts must have shape"),
        (torch.full((8, NUM_MOE_LAYERS, TOP_K), NUM_EXPERTS), r"routed_experts holds expert indices outside"),
        (torch.full((8, NUM_MOE_LAYERS, TOP_K), -1), r"routed_experts holds expert indices outside"),
        (torch.zeros(8, NUM_MOE_LAYERS, TOP_K), r"routed_experts must hold integer"),
    ],
)
def test_bad_routed_experts_raise_value_error(models, routed_experts: torch.Tensor, match: str) -> None:
    own, _ = models
    with pytest.raises(ValueError, match=match):
        own(random_ids(2, 4), routed_experts=routed_experts)


def test_grouped_mm_path_equals_loop_path() -> None:
    torch.manual_seed(0)
    layers = {
        impl: MoE(dim=32, hidden_dim=16, num_experts=6, top_k=3, norm_topk_prob=True, experts_impl=impl)
        for impl in ("grouped_mm", "loop")
    }
    for name, param in layers["grouped_mm"].named_parameters():
        torch.nn.init.normal_(param, std=0.2)
        layers["loop"].get_parameter(name).data.copy_(param)
    x = torch.randn(2, 40, 32)
    # Replay with one expert left empty, to cover a zero-sized group.
    replayed = torch.randint(0, 5, (80, 3))
    for routing in (None, replayed):
        outputs, grads = {}, {}
        for impl, layer in layers.items():
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            out, expert_ids, counts = layer(xi, routing)
            out.pow(2).sum().backward()
            outputs[impl], grads[impl] = (out, expert_ids, counts), [xi.grad, *(p.grad for p in layer.parameters())]
        (out_a, ids_a, counts_a), (out_b, ids_b, counts_b) = outputs["grouped_mm"], outputs["loop"]
        assert torch.equal(ids_a, ids_b) and torch.equal(counts_a, counts_b)
        assert (out_a - out_b).abs().max() <= 1e-5
        for grad_a, grad_b in zip(grads["grouped_mm"], grads["loop"], strict=True):
            assert (grad_a - grad_b).abs().max() <= 1e-5


def test_token_permutation_gradients_equal_finite_differences() -> None:
    """The hand-written backwards of the dispatch to and combine from expert order (float64)."""
    from primerl_trainer.models.moe import _CombineFromExperts, _DispatchToExperts

    num_tokens, top_k, dim = 5, 3, 4
    order = torch.randperm(num_tokens * top_k)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    x = torch.randn(num_tokens, dim, dtype=torch.float64, requires_grad=True)
    routed = torch.randn(num_tokens * top_k, dim, dtype=torch.float64, requires_grad=True)
    scores = torch.rand(num_tokens, top_k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: _DispatchToExperts.apply(x, order, inverse, top_k), (x,))
    assert torch.autograd.gradcheck(lambda r, s: _CombineFromExperts.apply(r, s, order, inverse), (routed, scores))
    # And the forwards against plain indexing.
    assert torch.equal(_DispatchToExperts.apply(x, order, inverse, top_k), x[order // top_k])
    expected = (routed[inverse].view(num_tokens, top_k, dim) * scores[:, :, None]).sum(dim=1)
    assert torch.allclose(_CombineFromExperts.apply(routed, scores, order, inverse), expected)


def test_hf_to_own_to_hf_is_bit_exact(moe_path: pathlib.Path) -> None:
    original = read_hf_state_dict(moe_path)
    exported = export_hf_state_dict(load_model(moe_path, impl="custom"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@torch.no_grad()
def test_dense_layers_between_moe_layers_equal_transformers(tmp_path: pathlib.Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = make_tiny_model(tmp_path / "moe", kind="moe", seed=3)
    config = json.loads((path / "config.json").read_text()) | {
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
        "intermediate_size": 64,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config)).save_pretrained(tmp_path / "mixed")
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(config))
    own, hf = load_model(tmp_path / "mixed", impl="custom"), load_model(tmp_path / "mixed", impl="hf")
    assert own.args.moe_layers == (1, 3)
    input_ids = random_ids(2, 10)
    out = own(input_ids)
    assert (out.logits - hf(input_ids).logits).abs().max() <= TOLERANCE
    assert out.routed_experts.shape == (20, 2, TOP_K)
    assert export_hf_state_dict(own).keys() == read_hf_state_dict(tmp_path / "mixed").keys()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(moe_path: pathlib.Path, lora: bool) -> None:
    """hf_parity.assert_rl_step_changes_loss, as every MoE family runs it."""
    from . import hf_parity

    hf_parity.assert_rl_step_changes_loss(moe_path, lora=lora)
