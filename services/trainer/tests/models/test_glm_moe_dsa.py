"""Own GLM-5 (`glm_moe_dsa`) against transformers' GlmMoeDsaForCausalLM on tiny random checkpoints
(float32): logits, router choices and the indexer's token selection (index_topk 5, shorter than
the samples, so that it matters), packed rows, router and selection replay, one step's
gradients, the HF state-dict round trip, refused configs, cp refused, one RL step with and
without LoRA."""

import json
import pathlib
import shutil

import pytest
import torch
import torch.nn.functional as F

from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.models import load_model, read_hf_state_dict
from primerl_trainer.models.common.sparse_attention import VisibleKeys
from primerl_trainer.models.glm_moe_dsa.model import GlmMoeDsaModel
from primerl_trainer.models.glm_moe_dsa.state_dict_adapter import GlmMoeDsaStateDictAdapter

from . import hf_parity
from .conftest import packed_inputs
from .hf_parity import TOLERANCE, reference

VOCAB_SIZE, NUM_LAYERS, NUM_EXPERTS, INDEX_TOPK = 96, 3, 8, 5

# A dense first layer, grouped routing, a "shared" indexer layer reusing layer 0's selection.
FULL = {
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "indexer_types": ["full", "shared", "full"],
}
# Every layer sparse and with its own indexer, one group, raw sigmoid weights.
PLAIN = {
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "indexer_types": ["full"] * NUM_LAYERS,
}


def make_checkpoint(path: pathlib.Path, variant: dict, *, seed: int = 0, **overrides) -> pathlib.Path:
    """A tiny GlmMoeDsaForCausalLM with random weights, random correction biases and random
    latent and indexer norms, saved as a Hugging Face folder."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config = GlmMoeDsaConfig(
        **{
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 32,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": NUM_EXPERTS,
            "q_lora_rank": 16,
            "kv_lora_rank": 12,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
            "index_topk": INDEX_TOPK,
            "index_head_dim": 8,
            "index_n_heads": 8,
            "initializer_range": 0.2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
            "dtype": "float32",
            **variant,
            **overrides,
        }
    )

    def perturb(model: torch.nn.Module) -> None:
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)
            attn = layer.self_attn
            for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
                norm.weight.normal_(1.0, 0.2)
            if attn.indexer is not None:
                attn.indexer.k_norm.weight.normal_(1.0, 0.2)
                attn.indexer.k_norm.bias.normal_(std=0.2)

    return hf_parity.save_random_checkpoint(path, GlmMoeDsaForCausalLM, config, perturb=perturb, seed=seed)


checkpoint, full_checkpoint, plain_checkpoint = hf_parity.checkpoint_fixtures(
    make_checkpoint, "glm-moe-dsa", full=FULL, plain=PLAIN
)


def reference_selection(hf: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
    """transformers' logits and its indexers' selection as the own model reports it: [B*T, full
    layers, K] positions within the sample of the visible selected keys, ascending, -1 after."""
    chosen = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda module, args, out: chosen.append(out.long()))
        for layer in hf.model.layers
        if layer.self_attn.indexer is not None
    ]
    try:
        logits = hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    batch_size, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len).expand(batch_size, seq_len)
    visible = VisibleKeys.of(position_ids, backend="sdpa")
    width = min(INDEX_TOPK, seq_len)
    positions = []
    for rows in chosen:
        attended = torch.zeros_like(visible.allowed).scatter_(-1, rows, True) & visible.allowed
        keys = torch.where(attended, position_ids[:, None, :], 10**9).sort(dim=-1).values[..., :width]
        positions.append(keys.masked_fill(keys == 10**9, -1).flatten(0, 1))
    return logits, torch.stack(positions, dim=1)


def test_auto_picks_the_own_implementation(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="auto")
    assert isinstance(model, GlmMoeDsaModel)
    args = model.args
    assert args.moe_layers == (1, 2) and args.indexer_layers == (0, 2) and args.index_topk == INDEX_TOPK
    assert model.layers["1"].attention.indexer is None
    assert not any(p.requires_grad for p in model.layers["0"].attention.indexer.parameters())


@torch.no_grad()
def test_logits_routing_and_selection_equal_transformers_on_a_batch(checkpoint: pathlib.Path) -> None:
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    hf_parity.assert_batch_matches(own, hf)
    input_ids = hf_parity.random_ids(2, 20, vocab_size=VOCAB_SIZE)
    logits, selected = reference_selection(hf, input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= TOLERANCE
    assert torch.equal(out.selected_tokens, selected)
    # The selection matters: later queries see only INDEX_TOPK of their keys.
    assert (out.selected_tokens >= 0).sum(-1).max() == INDEX_TOPK


@torch.no_grad()
def test_indexer_query_chunks_select_as_one(full_checkpoint: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The indexer scoring 3 queries at a time (a long row's path) selects what it selects at once."""
    from primerl_trainer.models.common import sparse_attention

    own = load_model(full_checkpoint, impl="custom")
    _, input_ids, position_ids = packed_inputs([6, 13, 3], seed=4)
    input_ids = input_ids % VOCAB_SIZE
    whole = own(input_ids, position_ids)
    monkeypatch.setattr(sparse_attention, "_SCORES_PER_CHUNK", 3 * own.args.index_num_heads * input_ids.shape[1])
    chunked = own(input_ids, position_ids)
    assert torch.equal(chunked.selected_tokens, whole.selected_tokens) and torch.equal(chunked.logits, whole.logits)


@torch.no_grad()
def test_eager_reference_agrees(full_checkpoint: pathlib.Path) -> None:
    """transformers' eager path (additive float masks) selects and attends as its SDPA path."""
    own = load_model(full_checkpoint, impl="custom")
    input_ids = hf_parity.random_ids(1, 18, vocab_size=VOCAB_SIZE, seed=3)
    logits, selected = reference_selection(reference(full_checkpoint, attn_implementation="eager"), input_ids)
    out = own(input_ids)
    assert (out.logits - logits).abs().max() <= TOLERANCE and torch.equal(out.selected_tokens, selected)


@torch.no_grad()
def test_packed_samples_equal_separate_runs(checkpoint: pathlib.Path) -> None:
    """The indexer selects within each sample only: packed == each sample alone (and transformers'
    own packed forward), selections included."""
    own, hf = load_model(checkpoint, impl="custom"), reference(checkpoint)
    hf_parity.assert_packed_matches_separate_runs(own, hf)
    samples, input_ids, position_ids = packed_inputs([6, 13, 3], seed=5)
    packed = own(input_ids % VOCAB_SIZE, position_ids)
    for sample, start in zip(samples, (0, 6, 19), strict=True):
        alone = own(sample % VOCAB_SIZE)
        width = alone.selected_tokens.shape[-1]
        rows = packed.selected_tokens[start : start + sample.shape[1]]
        assert torch.equal(rows[..., :width], alone.selected_tokens) and (rows[..., width:] == -1).all()


@torch.no_grad()
def test_replaying_transformers_routing_and_selection_gives_its_logits(full_checkpoint: pathlib.Path) -> None:
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    hf_parity.assert_replay_gives_reference_logits(own, hf)
    input_ids = hf_parity.random_ids(2, 16, vocab_size=VOCAB_SIZE, seed=1)
    logits, selected = reference_selection(hf, input_ids)
    replayed = own(input_ids, selected_tokens=selected.to(torch.int32))
    assert torch.equal(replayed.selected_tokens, selected)
    assert (replayed.logits - logits).abs().max() <= TOLERANCE


@torch.no_grad()
def test_replayed_selection_is_the_one_attended(full_checkpoint: pathlib.Path) -> None:
    """Another selection than the indexer's (the first INDEX_TOPK positions of each sample),
    replayed on a packed row, changes the logits, is reported back, and equals each sample run
    alone with the same replay."""
    own = load_model(full_checkpoint, impl="custom")
    samples, input_ids, position_ids = packed_inputs([9, 11], seed=2)
    input_ids = input_ids % VOCAB_SIZE
    forced = torch.arange(INDEX_TOPK).expand(input_ids.numel(), 2, INDEX_TOPK).clone()
    forced = forced.masked_fill(forced > position_ids.reshape(-1, 1, 1), -1)
    out = own(input_ids, position_ids, selected_tokens=forced)
    assert torch.equal(out.selected_tokens, forced)
    assert (out.logits - own(input_ids, position_ids).logits).abs().max() > 1e-3
    start = 0
    for sample in samples:
        length = sample.shape[1]
        alone = own(sample % VOCAB_SIZE, selected_tokens=forced[start : start + length])
        assert (alone.logits - out.logits[:, start : start + length]).abs().max() <= TOLERANCE
        start += length
    with pytest.raises(ValueError, match="selected_tokens must have shape"):
        own(input_ids, position_ids, selected_tokens=forced[:, :1])
    with pytest.raises(ValueError, match="below -1"):
        own(input_ids, position_ids, selected_tokens=forced - 2)


def test_one_step_gradients_equal_transformers(full_checkpoint: pathlib.Path) -> None:
    """Every trainable parameter's gradient on packed rows; the frozen indexers get none, as in
    transformers (its indexer runs under no_grad)."""
    own, hf = load_model(full_checkpoint, impl="custom"), reference(full_checkpoint)
    _, input_ids, position_ids = packed_inputs([9, 7], seed=3)
    input_ids = input_ids % VOCAB_SIZE
    labels = input_ids[:, 1:].reshape(-1)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), labels)

    own_loss, ref_loss = (
        loss(own(input_ids, position_ids).logits),
        loss(hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits),
    )
    own_loss.backward()
    ref_loss.backward()
    assert abs(own_loss.item() - ref_loss.item()) <= TOLERANCE
    ref_grads = GlmMoeDsaStateDictAdapter(own.args).from_hf(hf_parity.hub_gradients(hf))
    own_grads = {name: p.grad for name, p in own.named_parameters() if p.requires_grad}
    assert own_grads.keys() == ref_grads.keys()
    assert all(".indexer." in name for name, p in own.named_parameters() if not p.requires_grad)
    for name, grad in own_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_flex_equals_sdpa(full_checkpoint: pathlib.Path) -> None:
    """The flex backend (a BlockMask reading the selection) gives sdpa's logits on a packed row."""
    hf_parity.assert_flex_equals_sdpa(full_checkpoint)


def test_hf_to_own_to_hf_is_bit_exact(full_checkpoint: pathlib.Path) -> None:
    hf_parity.assert_hf_round_trip_is_bit_exact(full_checkpoint)


def test_multi_token_prediction_layers_are_dropped(full_checkpoint: pathlib.Path) -> None:
    mtp = {f"model.layers.{NUM_LAYERS}.eh_proj.weight": torch.zeros(32, 64)}
    hf_parity.assert_extra_layers_dropped(
        full_checkpoint, GlmMoeDsaStateDictAdapter, mtp=mtp, unknown="model.layers.1.self_attn.q_proj.weight"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"q_lora_rank": None}, r"q_lora_rank None"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads 2 != num_attention_heads 4"),
        ({"attention_bias": True}, r"attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"index_topk": 0}, r"index_topk must be positive"),
        ({"index_head_dim": 2}, r"index_head_dim \(2\) must hold"),
        ({"indexer_types": ["shared", "full", "full"]}, r"indexer_types must name"),
        ({"mlp_layer_types": ["dense"] * NUM_LAYERS}, r"mlp_layer_types must name"),
        ({"n_group": 3}, r"n_group \(3\) must be positive and divide the experts"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
    ],
)
def test_bad_configs_are_refused(full_checkpoint: pathlib.Path, change: dict, match: str) -> None:
    hf_parity.assert_config_refused(full_checkpoint, change, match)


@torch.no_grad()
def test_both_names_of_the_indexed_attention_layer_are_read(
    full_checkpoint: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """transformers 5.17 writes the layers as "deepseek_sparse_attention", 5.19 as "indexed_attention"."""
    input_ids = hf_parity.random_ids(2, 20, vocab_size=VOCAB_SIZE)
    wanted = load_model(full_checkpoint, impl="custom")(input_ids)
    for name in ("deepseek_sparse_attention", "indexed_attention"):
        renamed = tmp_path / name
        shutil.copytree(full_checkpoint, renamed)
        config = json.loads((renamed / "config.json").read_text())
        (renamed / "config.json").write_text(json.dumps(config | {"layer_types": [name] * NUM_LAYERS}))
        got = load_model(renamed, impl="auto")(input_ids)
        assert torch.equal(got.logits, wanted.logits) and torch.equal(got.selected_tokens, wanted.selected_tokens)
    layer_types = ["deepseek_sparse_attention", "full_attention", "indexed_attention"]
    hf_parity.assert_config_refused(full_checkpoint, {"layer_types": layer_types}, r"layer_types other than")


def test_context_parallel_is_refused(full_checkpoint: pathlib.Path) -> None:
    model = load_model(full_checkpoint, impl="custom")
    model.cp_group = None
    with pytest.raises(ValueError, match=r"parallel.cp > 1 is not supported for glm_moe_dsa"):
        model.cp_group = object()


@pytest.fixture(scope="module")
def trainable_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """FULL with the tiny tokenizer's vocabulary at the usual weight scale (the RL step's samples
    are byte tokens, longer than index_topk)."""
    return make_checkpoint(tmp_path_factory.mktemp("glm-moe-dsa-trainable"), FULL, **hf_parity.TRAINABLE)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_changes_the_loss(
    trainable_checkpoint: pathlib.Path, lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With LoRA every MLA projection (hf_parity's targets plus q_a, q_b, kv_a, kv_b), dense and
    shared-expert projections and the experts are adapted; the routers and the frozen indexers
    are not."""
    monkeypatch.setattr(hf_parity, "LORA_TARGETS", [*hf_parity.LORA_TARGETS, "q_a", "q_b", "kv_a", "kv_b"])
    hf_parity.assert_rl_step_changes_loss(
        trainable_checkpoint,
        lora=lora,
        unadapted=("router.gate", "indexer.wq_b", "indexer.wk", "indexer.weights_proj"),
    )


def test_tiny_model_maker_writes_a_glm_moe_dsa_checkpoint(tmp_path: pathlib.Path) -> None:
    path = make_tiny_model(tmp_path / "glm5", family="glm-moe-dsa", dtype="bfloat16")
    weights = read_hf_state_dict(path)
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    assert "model.layers.1.self_attn.indexer.wk.weight" not in weights  # a shared indexer layer
    own = hf_parity.assert_maker_checkpoint_equals_transformers(path, GlmMoeDsaModel)
    assert own.args.moe_layers == (1, 2, 3) and own.args.indexer_layers == (0, 2)
    assert own.args.index_topk < 20


def test_export_loads_back_in_transformers(full_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    hf_parity.assert_export_loads_back(full_checkpoint, tmp_path / "export")


def test_lora_adapter_export_names_the_latent_projections(trainable_checkpoint: pathlib.Path) -> None:
    """q_a, q_b, kv_a (the HF alias kv_a_proj_with_mqa), kv_b and o adapt the MLA projections of
    every layer, under PEFT's names; the indexers' wq_b and wk are left alone."""
    from primerl_trainer.config import LoRAConfig
    from primerl_trainer.export import exported_tensors
    from primerl_trainer.lora import apply_lora

    model = load_model(trainable_checkpoint, impl="custom", dtype=torch.float32)
    targets = ["q_a", "q_b_proj", "kv_a_proj_with_mqa", "kv_b", "o"]
    apply_lora(model, LoRAConfig(enabled=True, rank=4, target_modules=targets))
    state = model.state_dict().items()
    adapter = dict(exported_tensors(model, state, kind="adapter", dtype=torch.float32, lora_scale=2.0))
    projections = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    assert adapter.keys() == {
        f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_{ab}.weight"
        for i in range(NUM_LAYERS)
        for proj in projections
        for ab in "AB"
    }
    assert adapter["base_model.model.model.layers.0.self_attn.kv_a_proj_with_mqa.lora_B.weight"].shape == (12 + 4, 4)


@pytest.mark.gpu
@torch.no_grad()
def test_model_on_cuda_equals_transformers(full_checkpoint: pathlib.Path) -> None:
    """float32 on CUDA, packed rows: sdpa against transformers' runs of each sample on the CPU,
    flex (compiled, a BlockMask of the selection) and compiled blocks against sdpa."""
    from primerl_trainer.models.glm_moe_dsa.parallelize import parallelize_glm_moe_dsa

    samples, input_ids, position_ids = packed_inputs([6, 1, 90, 13], seed=8)
    input_ids, samples = input_ids % VOCAB_SIZE, [sample % VOCAB_SIZE for sample in samples]
    hf = reference(full_checkpoint)
    expected = torch.cat([hf(input_ids=s, use_cache=False).logits for s in samples], dim=1)
    sdpa = load_model(full_checkpoint, impl="custom", dtype=torch.float32, device="cuda")
    logits = sdpa(input_ids.cuda(), position_ids.cuda()).logits.cpu()
    assert (logits - expected).abs().max() <= 1e-4
    flex = load_model(full_checkpoint, impl="custom", dtype=torch.float32, device="cuda", attn_backend="flex")
    compiled = parallelize_glm_moe_dsa(flex, param_dtype=None, reduce_dtype=None, compile=True)
    for model in (flex, compiled):
        assert (model(input_ids.cuda(), position_ids.cuda()).logits.cpu() - logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_expert_parallel_trains_as_one_process(tmp_path: pathlib.Path) -> None:
    """ep=2 over 2 CPU ranks (hf_parity.assert_expert_parallel_trains_as_one_process) on the
    maker's GLM-5 at a narrow width."""
    from primerl_launcher.tiny_model import TinyGlmMoeDsaSpec

    spec = TinyGlmMoeDsaSpec(hidden_size=64, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32)
    path = make_tiny_model(tmp_path / "glm5", family="glm-moe-dsa", spec=spec)
    hf_parity.assert_expert_parallel_trains_as_one_process(path, tmp_path, num_routers=2)


def test_activation_checkpointing_gives_the_same_gradients(full_checkpoint: pathlib.Path) -> None:
    """The blocks recomputed in the backward (their selections included) give the plain gradients."""
    from primerl_trainer.models.glm_moe_dsa.parallelize import parallelize_glm_moe_dsa

    _, input_ids, position_ids = packed_inputs([9, 7], seed=6)
    input_ids = input_ids % VOCAB_SIZE
    grads = []
    for checkpointing in (False, True):
        model = load_model(full_checkpoint, impl="custom")
        parallelize_glm_moe_dsa(model, activation_checkpointing=checkpointing)
        model(input_ids, position_ids).logits.pow(2).mean().backward()
        grads.append(
            {
                name.replace("._checkpoint_wrapped_module", ""): p.grad
                for name, p in model.named_parameters()
                if p.requires_grad
            }
        )
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
