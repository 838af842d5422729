"""The own models on CUDA: float32 parity with transformers, and the bf16 fast paths
(grouped GEMM experts, compiled flex attention, compiled blocks) against the plain ones."""

import pathlib

import pytest
import torch

from primerl_trainer.distributed import apply_activation_checkpointing, apply_compile
from primerl_trainer.models import load_model
from primerl_trainer.models.moe import MoE, grouped_mm_supported

from .conftest import packed_inputs, random_ids

pytestmark = pytest.mark.gpu


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_float32_logits_equal_transformers_on_cuda(request: pytest.FixtureRequest, kind: str) -> None:
    path: pathlib.Path = request.getfixturevalue(f"{kind}_path")
    own, hf = load_model(path, device="cuda"), load_model(path, impl="hf", device="cuda")
    samples, input_ids, position_ids = packed_inputs([30, 50])
    packed = own(input_ids.cuda(), position_ids.cuda()).logits
    separate = torch.cat([hf(sample.cuda()).logits for sample in samples], dim=1)
    assert (packed - separate).abs().max() <= 1e-4


def test_grouped_mm_equals_loop_in_bf16_on_cuda() -> None:
    assert grouped_mm_supported(torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    layers = {
        impl: MoE(dim=256, hidden_dim=128, num_experts=16, top_k=4, norm_topk_prob=True, experts_impl=impl)
        for impl in ("grouped_mm", "loop")
    }
    for name, param in layers["grouped_mm"].named_parameters():
        torch.nn.init.normal_(param, std=0.05)
        layers["loop"].get_parameter(name).data.copy_(param)
    x = torch.randn(4, 100, 256, device="cuda", dtype=torch.bfloat16)
    results = {}
    for impl, layer in layers.items():
        layer.to(device="cuda", dtype=torch.bfloat16)
        xi = x.clone().requires_grad_()
        out, expert_ids, _ = layer(xi)
        out.float().pow(2).sum().backward()
        results[impl] = (out, expert_ids, xi.grad, layer.experts.w13.grad, layer.router.gate.weight.grad)
    (out_a, ids_a, *grads_a), (out_b, ids_b, *grads_b) = results["grouped_mm"], results["loop"]
    assert torch.equal(ids_a, ids_b)
    assert relative_error(out_a, out_b) < 1e-2
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert relative_error(grad_a, grad_b) < 2e-2


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compiled_flex_blocks_are_as_close_to_float32_as_eager_bf16(request: pytest.FixtureRequest, kind: str) -> None:
    """Compiled blocks round differently from eager ones (fused norms keep float32), so both
    bf16 paths are measured against a float32 run: the fast one may not be further off."""
    path: pathlib.Path = request.getfixturevalue(f"{kind}_path")
    _, input_ids, position_ids = packed_inputs([100, 28, 500])
    input_ids, position_ids = input_ids.cuda(), position_ids.cuda()
    reference = load_model(path, device="cuda")
    eager = load_model(path, dtype=torch.bfloat16, device="cuda")
    fast = load_model(path, dtype=torch.bfloat16, device="cuda", attn_backend="flex")
    apply_activation_checkpointing(fast.layers)
    apply_compile(fast.layers)
    expected = reference(input_ids, position_ids)
    expected.logits.logsumexp(-1).mean().backward()
    errors = {}
    for name, model in (("eager", eager), ("fast", fast)):
        # bf16 rounding flips near-tied expert choices; replaying the float32 routing
        # leaves the numerics alone to compare.
        out = model(input_ids, position_ids, routed_experts=expected.routed_experts)
        out.logits.float().logsumexp(-1).mean().backward()
        errors[name] = [relative_error(out.logits, expected.logits)] + [
            relative_error(p.grad, p_ref.grad)
            for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
        ]
    assert max(errors["eager"]) < 0.1
    for fast_error, eager_error in zip(errors["fast"], errors["eager"], strict=True):
        assert fast_error <= 1.5 * eager_error + 1e-3


@torch.no_grad()
def test_replay_on_cuda_accepts_uint8(moe_path: pathlib.Path) -> None:
    model = load_model(moe_path, dtype=torch.bfloat16, device="cuda")
    input_ids = random_ids(2, 64).cuda()
    free = model(input_ids)
    replayed = model(input_ids, routed_experts=free.routed_experts.to(torch.uint8))
    assert torch.equal(replayed.logits, free.logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_linear_cross_entropy_equals_the_pytorch_path(dtype: torch.dtype) -> None:
    """The Triton softmax-gradient kernel (CUDA) against the same function on the CPU's
    PyTorch path, at a vocabulary that is not a multiple of the kernel's block."""
    from primerl_trainer.kernels import linear_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=generator).to(dtype)
    weight = (torch.randn(5003, 64, generator=generator) / 8).to(dtype)
    targets = torch.randint(0, 5003, (300,), generator=generator)
    targets[:7] = -100
    temperatures = torch.rand(300, generator=generator) + 0.5
    results = []
    for device in ("cuda", "cpu"):
        h, w = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
        out = linear_cross_entropy(h, w, targets.to(device), temperatures=temperatures.to(device), chunk_size=128)
        out.loss.backward()
        results.append([t.detach().float().cpu() for t in (out.loss, out.logprobs, out.entropy, h.grad, w.grad)])
    for on_cuda, on_cpu in zip(*results, strict=True):
        assert relative_error(on_cuda, on_cpu) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
