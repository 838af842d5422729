"""What the tests of own mixture-of-experts models against transformers share: the checkpoint
fixtures, transformers' model, logits with the experts its routers chose and gradients under the
hub's names, and the checks every family runs against them (a batch, packed rows, flex = sdpa,
router replay, one step's gradients, the state-dict round trip, the export loading back in
transformers, refused configs, the tiny maker's checkpoint, one RL step of the trainer with and
without LoRA, expert and context parallel over 2 CPU ranks). Each family's test module keeps its
checkpoints and its particulars (variants, expected fields, error messages)."""

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from primerl_launcher.tiny_model import VOCAB_SIZE as TINY_VOCAB_SIZE
from primerl_trainer.config import LoRAConfig
from primerl_trainer.hf_export import export_hf_model
from primerl_trainer.lora import apply_lora
from primerl_trainer.models import HFCausalLM, export_hf_state_dict, load_model, read_hf_state_dict
from primerl_trainer.models.moe import GroupedExperts
from primerl_trainer.models.registry import MODEL_SPECS, read_hf_config
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

from .conftest import packed_inputs

TOLERANCE = 1e-5
# Every LoRA target: attention, dense and shared-expert projections, routed experts.
LORA_TARGETS = ["q", "k", "v", "o", "g", "gate", "up", "down", "experts"]
# A random checkpoint the training helpers can run: they sample byte tokens (the tiny tokenizer's
# vocabulary); weights at the usual scale, so that a few Adam steps stay in float32's comfortable range.
TRAINABLE = {"vocab_size": TINY_VOCAB_SIZE, "initializer_range": 0.02}


def save_random_checkpoint(
    path: pathlib.Path, model_cls: type, config: Any, *, perturb: Callable[[nn.Module], None], seed: int = 0
) -> pathlib.Path:
    """transformers' `model_cls` of `config` with seeded random weights, then `perturb`ed (no grad,
    same seed), saved as a Hugging Face folder."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():
            perturb(model)
    model.save_pretrained(path)
    return path


def checkpoint_fixtures(make_checkpoint: Callable[..., pathlib.Path], family: str, **variants: dict) -> tuple:
    """A family module's checkpoint fixtures (module scope): `checkpoint`, each variant in turn, then
    `<variant>_checkpoint` per variant (in the order given), each made once:

        checkpoint, full_checkpoint, plain_checkpoint = checkpoint_fixtures(make, "glm4-moe", full=..., plain=...)
    """

    def one(name: str, variant: dict):
        def fixture(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
            return make_checkpoint(tmp_path_factory.mktemp(f"{family}-{name}"), variant)

        return pytest.fixture(fixture, scope="module", name=f"{name}_checkpoint")

    def checkpoint(request: pytest.FixtureRequest) -> pathlib.Path:
        return request.getfixturevalue(f"{request.param}_checkpoint")

    each = pytest.fixture(checkpoint, scope="module", params=list(variants), name="checkpoint")
    return each, *(one(name, variant) for name, variant in variants.items())


def reference(path: pathlib.Path, *, attn_implementation: str = "sdpa", **kwargs: Any) -> nn.Module:
    """transformers' model of a checkpoint folder: float32, SDPA (unless told), eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation, **kwargs
    ).eval()


def random_ids(*shape: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def reference_forward(
    hf: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and the experts its routers chose [B*T, MoE layers, K], sorted.
    The routers are the `mlp.gate` (or `mlp.router`, AFMoE's) modules of MoE layers, whose
    output's third item is the chosen expert ids (as in transformers' GLM-4.5, MiniMax-M2, AFMoE
    and Laguna routers)."""
    chosen = []
    hooks = [
        router.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
        for layer in hf.model.layers
        if hasattr(layer.mlp, "experts")
        for router in [getattr(layer.mlp, "gate", None) or layer.mlp.router]
    ]
    try:
        logits = hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(chosen, dim=1).sort(dim=-1).values


def hub_gradients(hf: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of transformers' model after a backward, under the checkpoint's names; the
    parameters that got none are left out (AFMoE's and Laguna's router biases are parameters
    there, buffers in the own models)."""
    return HFCausalLM(hf).hf_state_dict(
        {f"hf_model.{n}": p.grad for n, p in hf.named_parameters() if p.grad is not None}
    )


@torch.no_grad()
def assert_batch_matches(own: nn.Module, hf: nn.Module, *, tolerance: float = TOLERANCE) -> None:
    """Logits (within `tolerance`) and the routers' choices on a batch of 2 rows."""
    input_ids = random_ids(2, 20, vocab_size=own.args.vocab_size)
    out = own(input_ids)
    logits, expert_ids = reference_forward(hf, input_ids)
    assert (out.logits - logits).abs().max() <= tolerance, float((out.logits - logits).abs().max())
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)
    assert out.tokens_per_expert.shape == (len(own.args.moe_layers), own.args.num_experts)


@torch.no_grad()
def assert_packed_matches_separate_runs(own: nn.Module, hf: nn.Module, *, hf_packs: bool = True) -> None:
    """Samples of 6, 13 and 3 tokens packed in one row equal transformers run on each alone, and,
    with `hf_packs`, transformers' own packed forward (position ids restarting; families whose
    transformers model builds its masks without the position ids let packed samples see each other)."""
    vocab_size = own.args.vocab_size
    samples, input_ids, position_ids = packed_inputs([6, 13, 3], seed=5)
    samples = [sample % vocab_size for sample in samples]
    packed = own(input_ids % vocab_size, position_ids)
    separate = [reference_forward(hf, sample) for sample in samples]
    assert (packed.logits - torch.cat([logits for logits, _ in separate], dim=1)).abs().max() <= TOLERANCE
    assert torch.equal(packed.routed_experts.sort(dim=-1).values, torch.cat([ids for _, ids in separate]))
    if hf_packs:
        logits, _ = reference_forward(hf, input_ids % vocab_size, position_ids)
        assert (packed.logits - logits).abs().max() <= TOLERANCE


@torch.no_grad()
def assert_flex_equals_sdpa(path: pathlib.Path) -> None:
    """The flex backend (windows as BlockMasks, sinks through the log-sum-exp) gives sdpa's logits
    on a packed row of samples longer and shorter than the windows."""
    sdpa = load_model(path, impl="custom")
    flex = load_model(path, impl="custom", attn_backend="flex")
    _, input_ids, position_ids = packed_inputs([6, 13, 3], seed=6)
    input_ids = input_ids % sdpa.args.vocab_size
    assert (sdpa(input_ids, position_ids).logits - flex(input_ids, position_ids).logits).abs().max() <= TOLERANCE


@torch.no_grad()
def assert_replay_gives_reference_logits(own: nn.Module, hf: nn.Module) -> None:
    """Replaying transformers' routing (as uint8, inference's dtype) gives its logits."""
    input_ids = random_ids(2, 16, vocab_size=own.args.vocab_size, seed=1)
    logits, expert_ids = reference_forward(hf, input_ids)
    replayed = own(input_ids, routed_experts=expert_ids.to(torch.uint8))
    assert torch.equal(replayed.routed_experts, expert_ids)
    assert (replayed.logits - logits).abs().max() <= TOLERANCE


def assert_forced_experts_weighted_and_trained(own: nn.Module, *, scaling_factor: float) -> None:
    """Forced experts (top_k 3 of 8) outside the router's choice: layer 1's router weighs them by
    the unbiased sigmoid scores there, renormalised and scaled; the gates get gradients, the
    correction biases none."""
    router = own.layers["1"].moe.router
    x = torch.randn(5, own.args.dim)
    forced = torch.tensor([[0, 1, 2], [3, 5, 7], [6, 4, 1], [0, 7, 3], [2, 3, 4]])
    scores, ids = router(x, forced)
    probs = torch.sigmoid(x @ router.gate.weight.T).gather(-1, forced)
    assert torch.equal(ids, forced)
    torch.testing.assert_close(scores, scaling_factor * probs / probs.sum(-1, keepdim=True))

    num_experts, num_tokens = own.args.num_experts, 12
    input_ids = random_ids(1, num_tokens, vocab_size=own.args.vocab_size, seed=2)
    first = torch.arange(num_tokens) % num_experts
    routed = torch.stack([first, (first + 3) % num_experts, (first + 5) % num_experts], dim=-1)
    routed = routed[:, None].expand(num_tokens, len(own.args.moe_layers), 3)
    out = own(input_ids, routed_experts=routed)
    assert torch.equal(out.routed_experts, routed)
    out.logits.pow(2).mean().backward()
    for layer_id in own.args.moe_layers:
        gate = own.layers[str(layer_id)].moe.router
        assert gate.gate.weight.grad is not None and gate.gate.weight.grad.abs().sum() > 0
        assert not gate.e_score_correction_bias.requires_grad


def assert_one_step_gradients_match(own: nn.Module, hf: nn.Module, adapter_cls: type, *, packed: bool = True) -> None:
    """The loss and every parameter's gradient of one cross-entropy on packed rows (`packed=False`:
    one sample, for a reference that lets packed samples see each other); `adapter_cls` maps
    transformers' gradients to the own names."""
    vocab_size = own.args.vocab_size
    _, input_ids, position_ids = packed_inputs([9, 7] if packed else [16], seed=3)
    input_ids = input_ids % vocab_size
    labels = input_ids[:, 1:].reshape(-1)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size), labels)

    own_loss = loss(own(input_ids, position_ids).logits)
    ref_loss = loss(hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits)
    own_loss.backward()
    ref_loss.backward()
    assert abs(own_loss.item() - ref_loss.item()) <= TOLERANCE

    ref_grads = adapter_cls(own.args).from_hf(hub_gradients(hf))
    own_grads = {name: p.grad for name, p in own.named_parameters()}
    assert own_grads.keys() == ref_grads.keys()
    for name, grad in own_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def assert_packed_gradients_match_samples_alone(
    own: nn.Module, hf: nn.Module, adapter_cls: type, lengths: list[int], *, atol: float = 1e-5
) -> None:
    """One cross-entropy over a packed row of samples of `lengths`; transformers runs each sample
    alone (its packed rows would leak a recurrent layer's state between samples), and the summed
    losses give the same loss and every parameter's gradient."""
    vocab_size = own.args.vocab_size
    samples, input_ids, position_ids = packed_inputs(lengths, seed=3)
    samples = [sample % vocab_size for sample in samples]
    num_predicted = sum(sample.shape[1] - 1 for sample in samples)

    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum") / num_predicted

    packed_logits = own(input_ids % vocab_size, position_ids).logits
    own_loss = sum(
        loss(logits, sample)
        for logits, sample in zip(packed_logits.split([s.shape[1] for s in samples], dim=1), samples, strict=True)
    )
    ref_loss = sum(loss(hf(input_ids=sample, use_cache=False).logits, sample) for sample in samples)
    own_loss.backward()
    ref_loss.backward()
    assert abs(own_loss.item() - ref_loss.item()) <= 1e-5

    ref_grads = adapter_cls(own.args).from_hf(hub_gradients(hf))
    own_grads = {name: p.grad for name, p in own.named_parameters()}
    assert own_grads.keys() == ref_grads.keys()
    for name, grad in own_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_hf_round_trip_is_bit_exact(path: pathlib.Path) -> None:
    original = read_hf_state_dict(path)
    exported = export_hf_state_dict(load_model(path, impl="custom"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def assert_sharded_model_matches(
    reference: nn.Module, model: nn.Module, inputs: dict[str, Any], checkpoint: pathlib.Path
) -> None:
    """`model`, parallelized by its spec's parallelize_fn on a one-rank CPU mesh with activation
    checkpointing, against the same weights unsharded (`reference`): equal logits, gradients of
    one loss within rounding, and the checkpoint's HF names exported from its full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    expected, actual = reference(**inputs).logits, model(**inputs).logits
    assert torch.equal(actual, expected)
    expected.pow(2).mean().backward()
    actual.pow(2).mean().backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        torch.testing.assert_close(param.grad.full_tensor(), grads[name], rtol=1e-5, atol=1e-6, msg=name)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert export_hf_state_dict(model, full).keys() == read_hf_state_dict(checkpoint).keys()


def assert_config_refused(path: pathlib.Path, change: dict, match: str) -> None:
    """The checkpoint's config with `change` is refused (ValueError matching `match`) when the own
    model's args are read from it or the model is built."""
    config = read_hf_config(path) | change
    spec = MODEL_SPECS[config["model_type"]]
    with pytest.raises(ValueError, match=match):
        spec.model_cls(spec.args_cls.from_hf_config(config))


@torch.no_grad()
def assert_export_loads_back(
    path: pathlib.Path,
    out_dir: pathlib.Path,
    *,
    names_of: pathlib.Path | None = None,
    load_reference: Callable[..., nn.Module] = reference,
) -> pathlib.Path:
    """The own model of `path`, its weights moved, exported as a Hugging Face folder (float32) at
    `out_dir`: the tensor names of `names_of` (default: `path`), an unquantized config, and
    transformers' model of it (`load_reference`) gives the own logits and routing. Returns the export."""
    model = load_model(path, impl="custom")
    generator = torch.Generator().manual_seed(7)
    for parameter in model.parameters():
        parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    out = export_hf_model(
        model, source_dir=path, out_dir=out_dir, dtype=torch.float32, lora_scale=None, is_destination=True, step=1
    )
    assert read_hf_state_dict(out).keys() == read_hf_state_dict(names_of or path).keys()
    config = read_hf_config(out)
    assert "quantization_config" not in config and config["dtype"] == "float32"
    input_ids = random_ids(1, 10, vocab_size=model.args.vocab_size, seed=4)
    logits, expert_ids = reference_forward(load_reference(out), input_ids)
    own = model(input_ids)
    assert (own.logits - logits).abs().max() <= TOLERANCE
    assert torch.equal(own.routed_experts.sort(dim=-1).values, expert_ids)
    return out


@torch.no_grad()
def assert_maker_checkpoint_equals_transformers(
    path: pathlib.Path, model_cls: type, *, load_reference: Callable[..., nn.Module] = reference
) -> nn.Module:
    """The tiny-model maker's checkpoint at `path` loads with impl="auto" as `model_cls` (float32)
    and gives transformers' logits (within 1e-4) and routing on 2 rows of 20 tokens (longer than
    the maker's windows). Returns the own model, for the family's fields."""
    own = load_model(path, impl="auto", dtype=torch.float32)
    assert isinstance(own, model_cls)
    input_ids = random_ids(2, 20, vocab_size=TINY_VOCAB_SIZE)
    logits, expert_ids = reference_forward(load_reference(path), input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= 1e-4
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)
    return own


def assert_extra_layers_dropped(path: pathlib.Path, adapter_cls: type, *, mtp: dict, unknown: str) -> None:
    """Multi-token prediction tensors (`mtp`, past the last layer) are dropped on loading; an
    `unknown` tensor name of a layer is refused."""
    model = load_model(path, impl="custom")
    hf_state_dict = read_hf_state_dict(path)
    adapter = adapter_cls(model.args)
    assert adapter.from_hf(hf_state_dict | mtp).keys() == model.state_dict().keys()
    with pytest.raises(ValueError, match="unexpected tensor"):
        adapter.from_hf(hf_state_dict | {unknown: torch.zeros(1)})


def assert_rl_step_changes_loss(
    model_dir: pathlib.Path, *, lora: bool, unadapted: tuple[str, ...] = ("router.gate",)
) -> None:
    """The trainer's RL step (Trainer.train_step: the RL loss, clipping, AdamW) on the own model of
    `model_dir` (a checkpoint with the tiny tokenizer's vocabulary: the samples are byte tokens),
    twice on the same batch: the second step's loss, at the weights the first left, is lower, and
    exactly the trainable tensors changed (the router correction biases and other buffers did not).
    With `lora`, every target: each nn.Linear of the layers (attention, dense and shared-expert
    projections) but those whose name ends with one of `unadapted` (the routers) and each routed
    experts' stack is adapted, only the adapters train and the base weights stay as they were."""
    from ..tiny_training import batch_spec, load_tiny_model, make_samples, pack_into

    model = load_tiny_model(model_dir)
    if lora:
        adapted = apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=LORA_TARGETS))
        projections = {
            f"{name}.weight"
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("layers.") and not name.endswith(unadapted)
        }
        experts = {
            f"{name}.{w}" for name, m in model.named_modules() if isinstance(m, GroupedExperts) for w in ("w13", "w2")
        }
        assert experts and set(adapted) == projections | experts
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and (not lora or all("lora_" in name for name in trainable))
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
    trainer = Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, LRScheduleConfig()),
        spec=batch_spec(model),
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        batch = pack_into(make_samples(model, seed=0, num_samples=4), 2)
    first, second = trainer.train_step(batch), trainer.train_step(batch)

    assert first["update_skipped"] == second["update_skipped"] == 0.0
    assert second["loss"] < first["loss"], (first["loss"], second["loss"])
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == trainable


def assert_context_parallel_trains_as_one_process(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, *, tolerances: tuple[float, float] = (1e-5, 1e-5)
) -> None:
    """cp=2 on the CPU (gloo, torchrun), as test_context_parallel runs Qwen3-MoE: two steps on
    packed rows split zig-zag over 2 ranks, with replayed routing, in float64, give the
    one-process losses and logprobs within `tolerances[0]` and weights within `tolerances[1]`.
    Not float64's 1e-10: sigmoid routers compute their logits in float32 (as transformers' do),
    whose rounding depends on how many tokens a rank holds (measured on GLM-4.5 and MiniMax-M2:
    logprobs ~1e-6 apart after two steps, weights ~2e-7); a wrong split moves them by ~0.1."""
    from .. import test_context_parallel as cp_test

    data, reference = _context_parallel_inputs(model_dir, tmp_path)
    result = cp_test._run_workers(model_dir, data, tmp_path / "cp", nproc=2, cp=2, dtype=torch.float64)
    _assert_context_parallel_matches(result, reference, model_dir, tolerances)


def assert_expert_parallel_trains_as_one_process(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, *, num_routers: int
) -> None:
    """ep=2 on the CPU (gloo, torchrun), as test_expert_parallel runs Qwen3-MoE: same losses,
    replayed logprobs, updated and published weights, LoRA step and resume under FSDP2 as one
    process. The `num_routers` routers' correction biases (buffers) come back unchanged."""
    from ..test_expert_parallel import _run_workers

    batches, data = _expert_parallel_inputs(model_dir, tmp_path)
    result = _run_workers(model_dir, batches, tmp_path / "out", nproc=2, ep=2)
    _assert_expert_parallel_matches(result, data, model_dir, num_routers)


@dataclass(frozen=True)
class ParallelRuns:
    """A family's ep=2 and cp=2 runs (run_expert_and_context_parallel) and their one-process
    references, for assert_expert_parallel_matches and assert_context_parallel_matches."""

    model_dir: pathlib.Path
    ep_result: dict
    ep_data: dict
    cp_result: dict
    cp_reference: dict


def run_expert_and_context_parallel(model_dir: pathlib.Path, root: pathlib.Path) -> ParallelRuns:
    """What assert_expert_parallel_trains_as_one_process and
    assert_context_parallel_trains_as_one_process run on `model_dir`, with both runs in one
    torchrun launch of 2 CPU ranks (parallel_worker.py: the ep run, then the cp run)."""
    ep_root, cp_root = root / "ep", root / "cp"
    ep_root.mkdir()
    cp_root.mkdir()
    batches, ep_data = _expert_parallel_inputs(model_dir, ep_root)
    cp_data, cp_reference = _context_parallel_inputs(model_dir, cp_root)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    worker = pathlib.Path(__file__).with_name("parallel_worker.py")
    paths = [model_dir, batches, ep_root / "out", cp_data, cp_root / "cp"]
    # Hiding the GPUs makes the workers take gloo on the CPU.
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, str(worker), *map(str, paths)], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return ParallelRuns(
        model_dir=model_dir,
        ep_result=torch.load(ep_root / "out" / "result.pt"),
        ep_data=ep_data,
        cp_result=torch.load(cp_root / "cp" / "result.pt"),
        cp_reference=cp_reference,
    )


def parallel_runs_fixture(family: str, checkpoint_fixture: str):
    """A family module's `parallel_runs` fixture (module scope): run_expert_and_context_parallel
    on the checkpoint of the fixture named `checkpoint_fixture`, once for the module's ep and cp
    tests (each checks its half)."""

    def parallel_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParallelRuns:
        model_dir = request.getfixturevalue(checkpoint_fixture)
        return run_expert_and_context_parallel(model_dir, tmp_path_factory.mktemp(f"parallel-{family}"))

    return pytest.fixture(parallel_runs, scope="module", name="parallel_runs")


def assert_expert_parallel_matches(runs: ParallelRuns, *, num_routers: int) -> None:
    """The ep half of `runs`, held as assert_expert_parallel_trains_as_one_process holds its run."""
    _assert_expert_parallel_matches(runs.ep_result, runs.ep_data, runs.model_dir, num_routers)


def assert_context_parallel_matches(runs: ParallelRuns, *, tolerances: tuple[float, float] = (1e-5, 1e-5)) -> None:
    """The cp half of `runs`, held as assert_context_parallel_trains_as_one_process holds its run."""
    _assert_context_parallel_matches(runs.cp_result, runs.cp_reference, runs.model_dir, tolerances)


def _expert_parallel_inputs(model_dir: pathlib.Path, root: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """test_expert_parallel's batches (resumed under plain FSDP after the ep run) and reference."""
    from ..test_expert_parallel import make_ep_data

    batches, data = make_ep_data(model_dir, root)
    torch.save(torch.load(batches) | {"resume": True}, batches)
    (root / "out").mkdir()
    return batches, data


def _assert_expert_parallel_matches(result: dict, data: dict, model_dir: pathlib.Path, num_routers: int) -> None:
    from ..test_expert_parallel import _assert_matches_one_process

    result = result | {"weights": dict(result["weights"]), "published": dict(result["published"])}
    biases = {k: v for k, v in load_model(model_dir).state_dict().items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == num_routers
    for name, bias in biases.items():
        assert torch.equal(result["weights"].pop(name), bias) and torch.equal(result["published"].pop(name), bias)
    _assert_matches_one_process(result, data["reference"], data["probe_routed_experts"])
    for key in ("loss", "grad_norm", "entropy"):
        wanted = data["reference"]["metrics"][2][key]
        assert result["resumed_metrics"][key] == pytest.approx(wanted, rel=1e-5, abs=1e-5), key


def _context_parallel_inputs(model_dir: pathlib.Path, root: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """test_context_parallel's batches with replayed routing and the float64 reference."""
    from .. import test_context_parallel as cp_test

    (root / "data").mkdir()
    (root / "cp").mkdir()
    return cp_test._cp_data(model_dir, root / "data", replay=True, dtype=torch.float64)


def _assert_context_parallel_matches(
    result: dict, reference: dict, model_dir: pathlib.Path, tolerances: tuple[float, float]
) -> None:
    from .. import test_context_parallel as cp_test

    result = result | {"weights": dict(result["weights"]), "published": dict(result["published"])}
    # The routers' correction biases (buffers, not in the reference's parameters) come back unchanged.
    for name, buffer in load_model(model_dir).named_buffers():
        if name.endswith("e_score_correction_bias"):
            for tensors in (result["weights"], result["published"]):
                assert torch.equal(tensors.pop(name), buffer.to(torch.float64)), name
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(cp_test.TOLERANCES, torch.float64, tolerances)
        cp_test._assert_matches_one_process(result, reference, torch.float64)
