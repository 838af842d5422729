"""LoRA on the own models: only the adapters train, the adapted model starts as the base, merged
exports are base + scale * B @ A, adapter exports carry PEFT's names; experts included."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.nn.utils import parametrize

from primerl_trainer.config import LoRAConfig
from primerl_trainer.export import exported_tensors, gather_state_dict, plan_export
from primerl_trainer.lora import apply_lora, merge_lora
from primerl_trainer.models import export_hf_state_dict
from primerl_trainer.optim import LRScheduleConfig, OptimizerConfig, build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

from .tiny_training import batch_spec, load_tiny_model, make_samples, pack_into

CPU = torch.device("cpu")
ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down", "experts"]


def _lora_model(model_dir: pathlib.Path, targets: list[str] = ALL_TARGETS, rank: int = 4, alpha: float = 8.0):
    model = load_tiny_model(model_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=rank, alpha=alpha, target_modules=targets))
    return model


def _train_two_steps(model: torch.nn.Module) -> None:
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    trainer = Trainer(
        model, optimizer, build_lr_scheduler(optimizer, LRScheduleConfig()), spec=batch_spec(model), device=CPU
    )
    with torch.no_grad():
        batches = [pack_into(make_samples(model, seed=seed, num_samples=3), 2) for seed in range(2)]
    for batch in batches:
        trainer.train_step(batch)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_only_the_adapters_train_and_the_adapted_model_starts_as_the_base(
    kind: str, dense_dir: pathlib.Path, moe_dir: pathlib.Path
) -> None:
    model_dir = dense_dir if kind == "dense" else moe_dir
    base = load_tiny_model(model_dir)
    model = _lora_model(model_dir)
    input_ids = torch.arange(5, 40)[None]
    torch.testing.assert_close(model(input_ids).logits, base(input_ids).logits, rtol=0, atol=0)

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    if kind == "moe":
        assert any(name.endswith("experts.parametrizations.w13.0.gate_lora_A") for name in trainable)
        assert not any("router" in name for name in trainable)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    _train_two_steps(model)
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == trainable
    # The trained adapters change the model's output.
    assert not torch.allclose(model(input_ids).logits, base(input_ids).logits)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_merged_export_is_base_plus_scaled_b_a(kind: str, dense_dir: pathlib.Path, moe_dir: pathlib.Path) -> None:
    model_dir = dense_dir if kind == "dense" else moe_dir
    rank, alpha = 4, 8.0
    model = _lora_model(model_dir, rank=rank, alpha=alpha)
    _train_two_steps(model)
    scale = alpha / rank
    state = dict(model.state_dict())
    merged = dict(merge_lora(state.items(), scale=scale))
    prefix = "layers.1.attention.wq"
    a, b = state[f"{prefix}.parametrizations.weight.0.lora_A"], state[f"{prefix}.parametrizations.weight.0.lora_B"]
    assert b.abs().sum() > 0
    expected = state[f"{prefix}.parametrizations.weight.original"] + scale * b @ a
    torch.testing.assert_close(merged[f"{prefix}.weight"], expected, rtol=1e-6, atol=1e-6)
    # The merged state dict is the model's own weights, which the model computes with.
    with parametrize.cached():
        torch.testing.assert_close(merged[f"{prefix}.weight"], model.get_submodule(prefix).weight)
    if kind == "moe":
        experts = "layers.2.moe.experts"
        with parametrize.cached():
            torch.testing.assert_close(merged[f"{experts}.w13"], model.get_submodule(experts).w13)
            torch.testing.assert_close(merged[f"{experts}.w2"], model.get_submodule(experts).w2)
        gate = (
            state[f"{experts}.parametrizations.w13.0.gate_lora_B"][3]
            @ state[f"{experts}.parametrizations.w13.0.gate_lora_A"][3]
        )
        hidden = gate.shape[0]
        torch.testing.assert_close(
            merged[f"{experts}.w13"][3, :hidden],
            state[f"{experts}.parametrizations.w13.original"][3, :hidden] + scale * gate,
        )

    # Exported under the hub's names with the base model's keys and shapes.
    exported = dict(exported_tensors(model, iter(state.items()), kind="full", dtype=torch.float32, lora_scale=scale))
    base_export = export_hf_state_dict(load_tiny_model(model_dir))
    assert exported.keys() == base_export.keys()
    assert all(exported[name].shape == tensor.shape for name, tensor in base_export.items())
    torch.testing.assert_close(exported["model.layers.1.self_attn.q_proj.weight"], expected)


def test_adapter_export_has_peft_names_and_shapes(moe_dir: pathlib.Path) -> None:
    model = _lora_model(moe_dir, targets=["q", "v", "experts"], rank=4)
    state = dict(model.state_dict())
    adapter = dict(exported_tensors(model, iter(state.items()), kind="adapter", dtype=torch.bfloat16, lora_scale=2.0))
    attention = "base_model.model.model.layers.0.self_attn"
    assert adapter[f"{attention}.q_proj.lora_A.weight"].shape == (4, 256)
    assert adapter[f"{attention}.q_proj.lora_B.weight"].shape == (4 * 64, 4)
    assert adapter[f"{attention}.v_proj.lora_B.weight"].shape == (2 * 64, 4)
    assert not any(".k_proj." in name or ".o_proj." in name for name in adapter)
    expert = "base_model.model.model.layers.3.mlp.experts.7"
    assert adapter[f"{expert}.gate_proj.lora_A.weight"].shape == (4, 256)
    assert adapter[f"{expert}.up_proj.lora_B.weight"].shape == (128, 4)
    assert adapter[f"{expert}.down_proj.lora_A.weight"].shape == (4, 128)
    assert adapter[f"{expert}.down_proj.lora_B.weight"].shape == (256, 4)
    torch.testing.assert_close(
        adapter[f"{expert}.down_proj.lora_A.weight"],
        state["layers.3.moe.experts.parametrizations.w2.0.down_lora_A"][7].bfloat16(),
    )
    assert all(t.dtype == torch.bfloat16 for t in adapter.values())
    # 4 layers x (q, v: A and B) + 4 layers x 8 experts x 3 projections x (A and B).
    assert len(adapter) == 4 * 2 * 2 + 4 * 8 * 3 * 2
    assert plan_export(model, kind="adapter", dtype=torch.bfloat16, lora_scale=2.0) == (
        len(adapter),
        sum(t.numel() * 2 for t in adapter.values()),
    )
    # The gathering path (no sharding here) yields the LoRA entries only.
    gathered = [key for key, _ in gather_state_dict(model, kind="adapter", is_destination=True)]
    assert gathered and all("lora_" in key for key in gathered)


def test_unknown_target_names_are_ignored_and_hf_names_accepted(
    dense_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _lora_model(dense_dir, targets=["q_proj", "down", "mystery", "experts"])
    assert "ignoring unknown name 'mystery'" in caplog.text
    adapted = {name.split(".parametrizations")[0] for name, _ in model.named_parameters() if "lora_A" in name}
    assert adapted == {f"layers.{i}.{m}" for i in range(4) for m in ("attention.wq", "feed_forward.w2")}
    with pytest.raises(ValueError, match="names no known target"):
        _lora_model(dense_dir, targets=["mystery"])
    # A dense model has no experts to adapt.
    with pytest.raises(ValueError, match="match no module"):
        _lora_model(dense_dir, targets=["experts"])
