"""The own models on CUDA: float32 parity with transformers, and the bf16 fast paths
(grouped GEMM experts, compiled flex attention, compiled blocks) against the plain ones and
against transformers in bf16; Qwen3 / Qwen3-MoE and each family of FAMILY_CHECKPOINTS."""

import pathlib
from collections.abc import Callable

import pytest
import torch

from primerl_trainer.distributed import apply_activation_checkpointing, apply_compile
from primerl_trainer.models import load_model, model_spec_of
from primerl_trainer.models.moe import MoE, grouped_mm_supported

from . import test_glm4_moe, test_minimax_m2
from .conftest import packed_inputs, random_ids
from .hf_parity import reference_forward

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_compiler() -> None:
    """Each test compiles as a trainer process would, which holds one model. Across tests the
    blocks share their code, and torch 2.11's dynamo, recompiling it for a model of another
    top-k, makes the replayed experts' K dimension dynamic and then fails an assertion
    (overwrite_tensor_vt_proxy) tracing _CombineFromExperts (torch 2.13 does not)."""
    torch.compiler.reset()


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
    """Two micro-batches (the second replays routing that leaves an expert empty): the grouped
    path, eager and compiled, whose expert weight gradients are accumulated into `.grad` by the
    Triton kernel, against the per-expert loop, whose gradients autograd accumulates."""
    assert grouped_mm_supported(torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    layers = {
        impl: MoE(dim=256, hidden_dim=128, num_experts=16, top_k=4, norm_topk_prob=True, experts_impl=impl)
        for impl in ("grouped_mm", "loop")
    }
    layers["compiled"] = MoE(dim=256, hidden_dim=128, num_experts=16, top_k=4, norm_topk_prob=True)
    for name, param in layers["grouped_mm"].named_parameters():
        torch.nn.init.normal_(param, std=0.05)
        for impl in ("loop", "compiled"):
            layers[impl].get_parameter(name).data.copy_(param)
    layers["compiled"].compile(fullgraph=True)
    xs = [torch.randn(4, 100, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    routings = [None, torch.randint(0, 15, (400, 4), device="cuda")]
    results = {}
    for impl, layer in layers.items():
        layer.to(device="cuda", dtype=torch.bfloat16)
        outs, input_grads = [], []
        for x, routing in zip(xs, routings, strict=True):
            xi = x.clone().requires_grad_()
            out, expert_ids, _ = layer(xi, routing)
            out.float().pow(2).sum().backward()
            outs.append((out, expert_ids))
            input_grads.append(xi.grad)
        results[impl] = (outs, [*input_grads, *(p.grad for p in layer.parameters())])
    outs_b, grads_b = results["loop"]
    for impl in ("grouped_mm", "compiled"):
        outs_a, grads_a = results[impl]
        for (out_a, ids_a), (out_b, ids_b) in zip(outs_a, outs_b, strict=True):
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


def _gpt_oss_case(tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """test_gpt_oss's FULL checkpoint (sliding window 4, sinks, biases, clamped SwiGLU, YaRN) and
    packed rows on CUDA whose samples are longer than the window. transformers before 5.19 has
    the hub's SwiGLU limit (7.0) built in and ignores the config's: there the checkpoint keeps
    that limit, which these weights do not reach (the CPU tests cover the clamps)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from . import test_gpt_oss

    variant = test_gpt_oss.FULL
    if GptOssExperts(test_gpt_oss.make_config(variant)).limit != variant["swiglu_limit"]:
        variant = variant | {"swiglu_limit": 7.0}
    path = test_gpt_oss.make_checkpoint(tmp_path / "gpt-oss", variant)
    samples, input_ids, position_ids = packed_inputs([100, 28, 300])
    vocab_size = test_gpt_oss.VOCAB_SIZE
    return path, [s.cuda() % vocab_size for s in samples], input_ids.cuda() % vocab_size, position_ids.cuda()


@torch.no_grad()
def test_gpt_oss_float32_logits_and_routing_equal_transformers_on_cuda(tmp_path: pathlib.Path) -> None:
    """Both attention backends (sdpa: the explicit sink softmax; flex: compiled, windows as
    BlockMasks, sinks through the lse) on packed rows against transformers' eager attention on
    each sample alone (its GPT-OSS lets packed samples see each other)."""
    from . import test_gpt_oss

    path, samples, input_ids, position_ids = _gpt_oss_case(tmp_path)
    hf = test_gpt_oss.reference(path).cuda()
    separate = [reference_forward(hf, sample) for sample in samples]
    logits, expert_ids = torch.cat([out for out, _ in separate], dim=1), torch.cat([ids for _, ids in separate])
    for backend in ("sdpa", "flex"):
        own = load_model(path, device="cuda", attn_backend=backend)(input_ids, position_ids)
        assert (own.logits - logits).abs().max() <= 1e-4, backend
        assert torch.equal(own.routed_experts.sort(dim=-1).values, expert_ids), backend


def test_gpt_oss_bf16_trainer_path_is_as_close_to_float32_as_eager_and_transformers(tmp_path: pathlib.Path) -> None:
    """bf16 on packed rows, replaying a float32 run's routing: the trainer's fast path (flex with
    sinks and windows, grouped GEMM experts with biases, blocks checkpointed and compiled by
    parallelize_gpt_oss) no further from float32 than eager bf16 (sdpa's explicit sink softmax,
    per-expert loop), logits and every gradient (the sinks' included). Then with its own routing
    against transformers in bf16 (eager attention, each sample alone): the same experts for nearly
    every token, logits no further from float32 than transformers'."""
    from . import test_gpt_oss

    path, samples, input_ids, position_ids = _gpt_oss_case(tmp_path)
    reference = load_model(path, device="cuda")
    eager = load_model(path, dtype=torch.bfloat16, device="cuda", experts_impl="loop")
    fast = load_model(path, dtype=torch.bfloat16, device="cuda", attn_backend="flex")
    model_spec_of(fast).parallelize_fn(fast, activation_checkpointing=True, compile=True)
    expected = reference(input_ids, position_ids)
    expected.logits.logsumexp(-1).mean().backward()
    errors = {}
    for name, model in (("eager", eager), ("fast", fast)):
        out = model(input_ids, position_ids, routed_experts=expected.routed_experts)
        out.logits.float().logsumexp(-1).mean().backward()
        errors[name] = [relative_error(out.logits, expected.logits)] + [
            relative_error(p.grad, p_ref.grad)
            for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
        ]
    assert max(errors["eager"]) < 0.1
    for fast_error, eager_error in zip(errors["fast"], errors["eager"], strict=True):
        assert fast_error <= 1.5 * eager_error + 1e-3

    hf = test_gpt_oss.reference(path).to(torch.bfloat16).cuda()
    with torch.no_grad():
        separate = [reference_forward(hf, sample) for sample in samples]
        own = fast(input_ids, position_ids)
    hf_logits, hf_experts = torch.cat([out for out, _ in separate], dim=1), torch.cat([ids for _, ids in separate])
    same_experts = (own.routed_experts.sort(dim=-1).values == hf_experts).all(dim=-1).float().mean().item()
    assert same_experts >= 0.9
    own_error, hf_error = relative_error(own.logits, expected.logits), relative_error(hf_logits, expected.logits)
    assert own_error <= 1.5 * hf_error + 1e-3


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_adamw_equals_torch_fused_adamw(dtype: torch.dtype) -> None:
    """The trainer's optimizer on CUDA (TritonAdamW, picked by build_optimizer) against
    torch.optim.AdamW(fused=True) from the same start: parameters and both moments after
    steps with weight decay on the matrices only, a changing learning rate and a parameter
    without a gradient in one step; sizes not multiples of the kernel's block."""
    from primerl_trainer.optim import OptimizerConfig, TritonAdamW, build_optimizer

    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 1000, 7), (4097,), (64, 64)]
    start = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    models = [torch.nn.ParameterList([torch.nn.Parameter(t.clone().cuda()) for t in start]) for _ in range(2)]
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    ours = build_optimizer(models[0], config)
    assert isinstance(ours, TritonAdamW)
    theirs = torch.optim.AdamW(
        [
            {"params": [models[1][0], models[1][2]], "weight_decay": 0.1},
            {"params": [models[1][1]], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=config.betas,
        eps=config.eps,
        fused=True,
    )
    for step in range(4):
        grads = [torch.randn(shape, generator=generator).to(dtype).cuda() for shape in shapes]
        for model, optimizer in ((models[0], ours), (models[1], theirs)):
            for param, grad in zip(model, grads, strict=True):
                param.grad = None if step == 2 and param.ndim == 1 else grad.clone()
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            optimizer.step()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for ours_param, theirs_param in zip(*models, strict=True):
        assert relative_error(ours_param, theirs_param) < tolerance
        for key in ("exp_avg", "exp_avg_sq"):
            assert relative_error(ours.state[ours_param][key], theirs.state[theirs_param][key]) < tolerance
        assert ours.state[ours_param]["step"].item() == theirs.state[theirs_param]["step"].item()


# The other families' tiny random checkpoints, every particular on (their CPU test modules'):
# one entry per family. MiniMax-M2's partial rotary (rotary_dim 8 of 16 head dims) also as
# partial_rotary_factor 0.5: transformers before 5.19 ignores the hub's rotary_dim (and rotates
# the whole head), later ones derive the factor from it; the own model reads either.
FAMILY_CHECKPOINTS: dict[str, Callable[[pathlib.Path], pathlib.Path]] = {
    "glm4_moe": lambda path: test_glm4_moe.make_checkpoint(path, test_glm4_moe.FULL),
    "minimax_m2": lambda path: test_minimax_m2.make_checkpoint(
        path, test_minimax_m2.PARTIAL | {"partial_rotary_factor": 0.5}
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILY_CHECKPOINTS))
def family_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return FAMILY_CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))


def family_inputs(lengths: list[int], vocab_size: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """packed_inputs on CUDA, in the family checkpoint's vocabulary."""
    samples, input_ids, position_ids = packed_inputs(lengths)
    return [s.cuda() % vocab_size for s in samples], input_ids.cuda() % vocab_size, position_ids.cuda()


@torch.no_grad()
def test_family_float32_logits_and_routing_equal_transformers_on_cuda(family_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    own = load_model(family_path, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(family_path, dtype=torch.float32, attn_implementation="sdpa").cuda()
    samples, input_ids, position_ids = family_inputs([30, 50], own.args.vocab_size)
    packed = own(input_ids, position_ids)
    separate = [reference_forward(hf, sample) for sample in samples]
    assert (packed.logits - torch.cat([logits for logits, _ in separate], dim=1)).abs().max() <= 1e-4
    assert torch.equal(packed.routed_experts.sort(dim=-1).values, torch.cat([ids for _, ids in separate]))


def test_family_bf16_trainer_path_is_as_close_to_float32_as_eager_and_transformers(family_path: pathlib.Path) -> None:
    """The trainer's bf16 path (grouped GEMM experts, flex attention on packed rows, blocks
    checkpointed and compiled by the family's parallelize function) against a float32 run,
    replaying its routing: no further off than eager bf16 with the per-expert loop, logits and
    every gradient. Then with its own routing against transformers in bf16 on the same GPU (its
    default experts implementation): the same experts for nearly every token, and logits no
    further from float32 than transformers' own."""
    from transformers import AutoModelForCausalLM

    reference = load_model(family_path, device="cuda")
    eager = load_model(family_path, dtype=torch.bfloat16, device="cuda", experts_impl="loop")
    fast = load_model(family_path, dtype=torch.bfloat16, device="cuda", attn_backend="flex")
    model_spec_of(fast).parallelize_fn(fast, activation_checkpointing=True, compile=True)
    _, input_ids, position_ids = family_inputs([100, 28, 500], reference.args.vocab_size)
    expected = reference(input_ids, position_ids)
    expected.logits.logsumexp(-1).mean().backward()
    errors = {}
    for name, model in (("eager", eager), ("fast", fast)):
        out = model(input_ids, position_ids, routed_experts=expected.routed_experts)
        out.logits.float().logsumexp(-1).mean().backward()
        errors[name] = [relative_error(out.logits, expected.logits)] + [
            relative_error(p.grad, p_ref.grad)
            for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
        ]
    assert max(errors["eager"]) < 0.1
    for fast_error, eager_error in zip(errors["fast"], errors["eager"], strict=True):
        assert fast_error <= 1.5 * eager_error + 1e-3

    hf = AutoModelForCausalLM.from_pretrained(family_path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    with torch.no_grad():
        hf_logits, hf_experts = reference_forward(hf, input_ids, position_ids)
        own = fast(input_ids, position_ids)
    same_experts = (own.routed_experts.sort(dim=-1).values == hf_experts).all(dim=-1).float().mean().item()
    assert same_experts >= 0.9
    own_error, hf_error = relative_error(own.logits, expected.logits), relative_error(hf_logits, expected.logits)
    assert own_error <= 1.5 * hf_error + 1e-3
