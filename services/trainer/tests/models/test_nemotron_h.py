"""Own Nemotron-H (`nemotron_h`) against transformers' NemotronHForCausalLM on a tiny random
checkpoint with every kind of layer (float32): logits and router choices on rows longer than a
Mamba chunk, packed rows against the samples run alone, router replay, the gradients of one loss,
the HF state-dict round trip; Mamba-2's forms (chunked against recurrent, states carried over a
split); refused configs; the tiny-model maker's `nemotron-h` family, one RL step with and without
LoRA, LoRA on the Mamba projections; context parallel over 2 CPU ranks.

transformers runs its PyTorch path on the CPU (no mamba-ssm or causal-conv1d here); that path
ignores sample boundaries in packed rows (its convolution and scan run across them), so packed
rows are compared with transformers' runs of each sample alone. Its mixer names the router
`mixer.gate` (the hf_parity helpers look for `mlp.gate`), hence this module's reference_forward."""

import pathlib

import pytest
import torch
import torch.nn.functional as F

from primerl_launcher.tiny_model import VOCAB_SIZE as TINY_VOCAB_SIZE
from primerl_launcher.tiny_model import TinyNemotronHSpec, make_tiny_model
from primerl_trainer.distributed.context_parallel import RowLayout
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.common.gated_delta_rule import causal_conv1d
from primerl_trainer.models.common.mamba2 import Mamba2, chunked_ssd, conv_within_samples, recurrent_ssd
from primerl_trainer.models.nemotron_h.model import NemotronHModel
from primerl_trainer.models.nemotron_h.state_dict_adapter import NemotronHStateDictAdapter

from . import hf_parity
from .conftest import packed_inputs
from .hf_parity import reference

VOCAB_SIZE, NUM_EXPERTS = 96, 8
# The bounds (float32): logits against transformers, the chunked scan against the recurrent one.
LOGIT_TOLERANCE, SCAN_TOLERANCE = 1e-4, 1e-5
LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]

CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "layers_block_type": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "mamba_num_heads": 8,
    "mamba_head_dim": 4,
    "n_groups": 2,
    "ssm_state_size": 8,
    "chunk_size": 8,
    "n_routed_experts": NUM_EXPERTS,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 24,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "initializer_range": 0.1,
    "dtype": "float32",
}


def perturb(model: torch.nn.Module) -> None:
    """Every parameter moved off its init (D at 1, norm weights at 1, ...); the routers' correction
    biases drawn so that they change choices."""
    for parameter in model.parameters():
        parameter.add_(0.1 * torch.randn_like(parameter))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    path = tmp_path_factory.mktemp("nemotron-h")
    return hf_parity.save_random_checkpoint(path, NemotronHForCausalLM, NemotronHConfig(**CONFIG), perturb=perturb)


@pytest.fixture(scope="module")
def models(checkpoint: pathlib.Path) -> tuple[NemotronHModel, torch.nn.Module]:
    return load_model(checkpoint, impl="custom"), reference(checkpoint)


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return hf_parity.random_ids(*shape, vocab_size=VOCAB_SIZE, seed=seed)


def reference_forward(hf: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and the experts its routers (`mixer.gate` of the MoE layers) chose
    [B*T, MoE layers, K], sorted."""
    chosen = []
    hooks = [
        layer.mixer.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
        for layer in hf.model.layers
        if layer.block_type == "moe"
    ]
    try:
        logits = hf(input_ids=input_ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(chosen, dim=1).sort(dim=-1).values


def test_auto_picks_the_own_implementation(checkpoint: pathlib.Path) -> None:
    own = load_model(checkpoint, impl="auto")
    assert isinstance(own, NemotronHModel) and own.args.layer_types == tuple(LAYERS)
    assert own.args.moe_layers == (1, 5) and own.lm_head is not None
    assert own.args.dt_limit == (0.001, float("inf"))


@torch.no_grad()
def test_logits_and_routing_equal_transformers(models: tuple) -> None:
    """Two rows of 30 tokens: the Mamba scan crosses chunks of 8."""
    own, hf = models
    input_ids = random_ids(2, 30)
    logits, expert_ids = reference_forward(hf, input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= LOGIT_TOLERANCE
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)
    assert out.tokens_per_expert.shape == (2, NUM_EXPERTS)


@torch.no_grad()
def test_packed_samples_equal_separate_runs(models: tuple) -> None:
    """Samples shorter than the convolution (1, 2 tokens) and longer than a chunk (20)."""
    own, hf = models
    samples, input_ids, position_ids = packed_inputs([6, 1, 13, 2, 20, 3], seed=5)
    samples = [sample % VOCAB_SIZE for sample in samples]
    packed = own(input_ids % VOCAB_SIZE, position_ids)
    separate = [reference_forward(hf, sample) for sample in samples]
    assert (packed.logits - torch.cat([logits for logits, _ in separate], dim=1)).abs().max() <= LOGIT_TOLERANCE
    assert torch.equal(packed.routed_experts.sort(dim=-1).values, torch.cat([ids for _, ids in separate]))
    # The trainer's row layout (no context parallel) gives the same.
    layout = RowLayout.of(position_ids[0], cp_rank=0, cp_size=1)
    laid_out = own(input_ids % VOCAB_SIZE, position_ids, row_layout=layout)
    assert (laid_out.logits - packed.logits).abs().max() <= LOGIT_TOLERANCE


@torch.no_grad()
def test_replaying_transformers_routing_gives_its_logits(models: tuple) -> None:
    own, hf = models
    input_ids = random_ids(2, 16, seed=1)
    logits, expert_ids = reference_forward(hf, input_ids)
    replayed = own(input_ids, routed_experts=expert_ids.to(torch.uint8))
    assert torch.equal(replayed.routed_experts, expert_ids)
    assert (replayed.logits - logits).abs().max() <= LOGIT_TOLERANCE


def test_one_step_gradients_equal_transformers(checkpoint: pathlib.Path) -> None:
    """Packed rows against transformers running each sample alone (its packed rows would leak the
    Mamba state)."""
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    hf_parity.assert_packed_gradients_match_samples_alone(own, hf, NemotronHStateDictAdapter, [9, 20, 7])


def test_hf_to_own_to_hf_is_bit_exact(checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(checkpoint)


def test_stacked_experts_and_mtp_tensors(checkpoint: pathlib.Path) -> None:
    """Stacked experts (transformers' in-memory layout) load like per-expert ones; multi-token
    prediction tensors are dropped; an unknown tensor of a layer is refused."""
    adapter = NemotronHStateDictAdapter(load_model(checkpoint, impl="custom").args)
    hf_state_dict = read_hf_state_dict(checkpoint)
    stacked = {key: value for key, value in hf_state_dict.items() if ".mixer.experts." not in key}
    for layer in (1, 5):
        prefix = f"backbone.layers.{layer}.mixer.experts"
        for proj in ("up_proj", "down_proj"):
            stacked[f"{prefix}.{proj}"] = torch.stack(
                [hf_state_dict[f"{prefix}.{e}.{proj}.weight"] for e in range(NUM_EXPERTS)]
            )
    wanted = adapter.from_hf(hf_state_dict)
    loaded = adapter.from_hf(stacked | {"mtp.layers.0.mixer.gate.weight": torch.zeros(8, 32)})
    assert loaded.keys() == wanted.keys() and all(torch.equal(loaded[key], wanted[key]) for key in wanted)
    with pytest.raises(ValueError, match="unexpected tensor"):
        adapter.from_hf(hf_state_dict | {"backbone.layers.0.mixer.unknown.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"mlp_hidden_act": "gelu"}, r"mlp_hidden_act 'gelu'"),
        ({"mamba_hidden_act": "relu"}, r"mamba_hidden_act 'relu'"),
        ({"moe_latent_size": 16}, r"moe_latent_size"),
        ({"use_bias": True}, r"use_bias"),
        ({"mamba_num_heads": 6, "n_groups": 4}, r"mamba_num_heads \(6\) must be a multiple of n_groups \(4\)"),
        ({"layers_block_type": ["linear_attention", "mlp"]}, r"no 'moe' layer"),
        ({"layers_block_type": ["moe", "sliding_attention"]}, r"layers_block_type must name"),
        ({"layers_block_type": None, "hybrid_override_pattern": "ME*X"}, r"hybrid_override_pattern 'ME\*X'"),
        ({"n_group": 3}, r"n_group \(3\)"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
    ],
)
def test_bad_configs_are_refused(checkpoint: pathlib.Path, change: dict, match: str) -> None:
    hf_parity.assert_config_refused(checkpoint, change, match)


def test_hub_pattern_and_aliases_are_read(checkpoint: pathlib.Path) -> None:
    """The hub's config.json names the layers by `hybrid_override_pattern` and some Mamba fields
    by their older `mamba_*` names."""
    from primerl_trainer.models.nemotron_h.model import NemotronHModelArgs
    from primerl_trainer.models.registry import read_hf_config

    config = read_hf_config(checkpoint)
    args = NemotronHModelArgs.from_hf_config(config)
    del config["layers_block_type"], config["n_groups"], config["chunk_size"]
    hub = config | {"hybrid_override_pattern": "ME*-ME", "mamba_n_groups": 2, "mamba_chunk_size": 8}
    assert NemotronHModelArgs.from_hf_config(hub) == args


# Mamba-2's own forms.


def scan_inputs(num_seqs: int, seq_len: int, *, num_heads: int = 4, groups: int = 2, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "x": randn(num_seqs, seq_len, num_heads, 5),
        # Step sizes ~0.1..2, decays exp(-dt * exp(A_log)) from ~0.1 to ~1 per token.
        "dt": F.softplus(randn(num_seqs, seq_len, num_heads)),
        "A": -torch.rand(num_heads, generator=generator) - 0.1,
        "B": randn(num_seqs, seq_len, groups, 6),
        "C": randn(num_seqs, seq_len, groups, 6),
        "D": randn(num_heads),
    }


@pytest.mark.parametrize("chunk_size", [64, 16, 7])
def test_chunked_and_recurrent_forms_agree(chunk_size: int) -> None:
    inputs = scan_inputs(2, 100)
    initial_state = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(1))
    for state in (None, initial_state):
        chunked, chunked_final = chunked_ssd(**inputs, chunk_size=chunk_size, initial_state=state)
        recurrent, recurrent_final = recurrent_ssd(**inputs, initial_state=state)
        assert (chunked - recurrent).abs().max() <= SCAN_TOLERANCE
        assert (chunked_final - recurrent_final).abs().max() <= SCAN_TOLERANCE


def test_samples_of_a_row_equal_their_runs_alone() -> None:
    """One row of 3 samples (tokens starting a sample reset the state, convolution taps stay in
    their sample) equals each sample run alone, in the chunked and the recurrent form."""
    lengths = [13, 1, 26]
    inputs = scan_inputs(1, sum(lengths), seed=3)
    column = torch.cat([torch.arange(n) for n in lengths])[None]
    alone = []
    for sample in torch.arange(sum(lengths)).split(lengths):
        one = {k: v[:, sample] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
        alone.append(recurrent_ssd(**one)[0])
    alone = torch.cat(alone, dim=1)
    chunked, _ = chunked_ssd(**inputs, chunk_size=8, reset=column == 0)
    recurrent, _ = recurrent_ssd(**inputs, reset=column == 0)
    assert (chunked - alone).abs().max() <= SCAN_TOLERANCE and (recurrent - alone).abs().max() <= SCAN_TOLERANCE

    x = torch.randn(1, sum(lengths), 6, generator=torch.Generator().manual_seed(4))
    weight, bias = torch.randn(6, 4), torch.randn(6)
    convolved = conv_within_samples(x, weight, bias, column)
    alone = torch.cat([causal_conv1d(part, weight, bias=bias)[0] for part in x.split(lengths, dim=1)], dim=1)
    assert (convolved - alone).abs().max() <= SCAN_TOLERANCE


def test_layer_state_carries_over_a_split(models: tuple) -> None:
    """A Mamba-2 layer of the checkpoint run on a row in two parts, the second from the first's
    convolution and scan states, equals one run; the recurrent form gives the same."""
    own, _ = models
    mamba = own.layers["0"].attention
    assert isinstance(mamba, Mamba2)
    generator = torch.Generator().manual_seed(2)
    xBC = torch.randn(2, 37, mamba.conv_channels, generator=generator)
    dt = torch.randn(2, 37, mamba.num_heads, generator=generator)
    with torch.no_grad():
        whole, (conv_final, scan_final) = mamba.torch_core(xBC, dt)
        first, (conv_state, scan_state) = mamba.torch_core(xBC[:, :20], dt[:, :20])
        second, states = mamba.torch_core(xBC[:, 20:], dt[:, 20:], conv_state=conv_state, initial_state=scan_state)
        recurrent, _ = mamba.torch_core(xBC, dt, recurrent=True)
    assert (torch.cat([first, second], dim=1) - whole).abs().max() <= SCAN_TOLERANCE
    assert torch.equal(states[0], conv_final) and (states[1] - scan_final).abs().max() <= SCAN_TOLERANCE
    assert (recurrent - whole).abs().max() <= SCAN_TOLERANCE


# The tiny-model maker's family and training.


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The maker's Nemotron-H at half its width (CI time): every kind of layer."""
    spec = TinyNemotronHSpec(hidden_size=128, intermediate_size=128, moe_intermediate_size=64)
    return make_tiny_model(tmp_path_factory.mktemp("tiny-nemotron-h") / "nemotron-h", family="nemotron-h", spec=spec)


@torch.no_grad()
def test_tiny_model_maker_writes_a_nemotron_h_checkpoint(tiny_checkpoint: pathlib.Path) -> None:
    own = load_model(tiny_checkpoint, impl="auto", dtype=torch.float32)
    assert isinstance(own, NemotronHModel) and set(own.args.layer_types) == set(LAYERS)
    input_ids = hf_parity.random_ids(2, 40, vocab_size=TINY_VOCAB_SIZE)
    logits, expert_ids = reference_forward(reference(tiny_checkpoint), input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= LOGIT_TOLERANCE
    assert torch.equal(out.routed_experts.sort(dim=-1).values, expert_ids)


MAMBA_PROJECTIONS = ("in_proj", "out_proj")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(tiny_checkpoint: pathlib.Path, lora: bool) -> None:
    """hf_parity.assert_rl_step_changes_loss; with LoRA its targets (attention, dense MLP and
    shared expert up/down, routed experts) are adapted, the routers are not, nor the Mamba
    projections, which that check does not name (the next test does)."""
    unadapted = ("router.gate", *(f"attention.{name}" for name in MAMBA_PROJECTIONS))
    hf_parity.assert_rl_step_changes_loss(tiny_checkpoint, lora=lora, unadapted=unadapted)


def test_lora_adapts_the_mamba_projections(tiny_checkpoint: pathlib.Path) -> None:
    """in_proj and out_proj as LoRA targets: adapted, trained by a backward, exported under PEFT's
    names of the hub's modules."""
    from primerl_trainer.config import LoRAConfig
    from primerl_trainer.export import exported_tensors
    from primerl_trainer.lora import apply_lora

    model = load_model(tiny_checkpoint, impl="custom", dtype=torch.float32)
    mamba_layers = [i for i, kind in enumerate(model.args.layer_types) if kind == "linear_attention"]
    adapted = apply_lora(model, LoRAConfig(enabled=True, rank=4, target_modules=list(MAMBA_PROJECTIONS)))
    assert set(adapted) == {f"layers.{i}.attention.{name}.weight" for i in mamba_layers for name in MAMBA_PROJECTIONS}
    model(hf_parity.random_ids(1, 12, vocab_size=TINY_VOCAB_SIZE)).logits.pow(2).mean().backward()
    lora_grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    # B starts at zero, so only B gets a gradient on the first step.
    assert all(grad.abs().sum() > 0 for name, grad in lora_grads.items() if name.endswith("lora_B"))
    state = model.state_dict().items()
    adapter = dict(exported_tensors(model, state, kind="adapter", dtype=torch.float32, lora_scale=2.0))
    assert adapter.keys() == {
        f"base_model.model.backbone.layers.{i}.mixer.{name}.lora_{ab}.weight"
        for i in mamba_layers
        for name in MAMBA_PROJECTIONS
        for ab in "AB"
    }
    mamba = model.layers[str(mamba_layers[0])].attention
    layer = f"base_model.model.backbone.layers.{mamba_layers[0]}.mixer"
    assert adapter[f"{layer}.in_proj.lora_B.weight"].shape == (mamba.in_proj.out_features, 4)
    assert adapter[f"{layer}.out_proj.lora_A.weight"].shape == (4, mamba.num_heads * mamba.head_dim)


@pytest.fixture(scope="module")
def narrow_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The maker's Nemotron-H narrowed for the runs over 2 ranks: Mamba-2, attention and 2 MoE
    layers; chunks of 4 tokens, so that the scan's own chunks cross the ranks' too."""
    spec = TinyNemotronHSpec(
        num_hidden_layers=4, hybrid_override_pattern="ME*E", hidden_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=64, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, mamba_num_heads=4, mamba_head_dim=16, chunk_size=4,
    )  # fmt: skip
    return make_tiny_model(tmp_path_factory.mktemp("narrow-nemotron-h") / "nemotron-h", family="nemotron-h", spec=spec)


# ep=2 and cp=2 over 2 CPU ranks on the narrow checkpoint, in one launch (hf_parity.run_expert_and_context_parallel).
parallel_runs = hf_parity.parallel_runs_fixture("nemotron-h", "narrow_checkpoint")


def test_expert_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """The non-gated experts split over the ranks beside the Mamba-2 and attention layers: losses,
    replay, LoRA and resume under FSDP2 as one process; the 2 routers' correction biases unchanged."""
    hf_parity.assert_expert_parallel_matches(parallel_runs, num_routers=2)


def test_context_parallel_trains_as_one_process(parallel_runs: hf_parity.ParallelRuns) -> None:
    """Packed rows, a one-sample row, a row shorter than 2 * cp, replayed routing: the Mamba-2
    layers pass their scan and convolution states between the ranks, the attention gathers keys
    and values. The one launch of both runs takes ~20 s here (torchrun)."""
    hf_parity.assert_context_parallel_matches(parallel_runs)


@pytest.mark.gpu
@torch.no_grad()
def test_model_on_cuda_equals_transformers(tiny_checkpoint: pathlib.Path) -> None:
    """float32 on CUDA, packed rows, against transformers' runs of each sample on the CPU: the
    PyTorch path within the CPU's bound, mamba-ssm's and causal-conv1d's kernels (when both import)
    within TF32's."""
    own = load_model(tiny_checkpoint, impl="custom", dtype=torch.float32, device="cuda")
    samples, input_ids, position_ids = packed_inputs([6, 1, 90, 13], seed=8)
    hf = reference(tiny_checkpoint)
    expected = torch.cat([reference_forward(hf, sample)[0] for sample in samples], dim=1)
    impls = {"torch": LOGIT_TOLERANCE}
    try:
        import causal_conv1d  # noqa: F401
        import mamba_ssm  # noqa: F401

        impls["kernels"] = 5e-3
    except ImportError:
        pass
    for impl, tolerance in impls.items():
        for module in own.modules():
            if isinstance(module, Mamba2):
                module.impl = impl
        logits = own(input_ids.cuda(), position_ids.cuda()).logits.cpu()
        assert (logits - expected).abs().max() <= tolerance, impl
