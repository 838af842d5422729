"""export.adapter_dir: the trainer's LoRA adapter as a PEFT folder that `peft` loads onto the base
model and that computes the trainer's logits; merged, it is the trainer's merged export."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from primerl_common.config import ConfigError, load_config
from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.batch import MicroBatch
from primerl_trainer.config import LoRAConfig, TrainerConfig
from primerl_trainer.hf_export import EXPORT_INFO_FILE
from primerl_trainer.loop import StepExecutor
from primerl_trainer.lora import apply_lora
from primerl_trainer.peft_export import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    check_peft_exportable,
    export_peft_adapter,
)
from primerl_trainer.runtime import build_runtime, shutdown_runtime

from .serving import trainer_config
from .test_export_hf import logits_of
from .tiny_training import load_tiny_model

INPUT_IDS = torch.tensor([1, 60, 70, 80, 90, 257, 100, 101])
# DCP says so when it saves or loads in a process that is not part of a process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@dataclass(frozen=True)
class LoRARun:
    config: TrainerConfig
    adapter_dir: pathlib.Path
    hf_dir: pathlib.Path
    # The trainer's model (LoRA in) on INPUT_IDS after its step.
    logits: torch.Tensor


def lora_trainer_config(model_dir: pathlib.Path, root: pathlib.Path, *, adapter_dir: pathlib.Path) -> TrainerConfig:
    return trainer_config(
        model_dir,
        lora={"enabled": True, "rank": 4, "alpha": 8.0},
        checkpoint={"dir": str(root / "checkpoints")},
        export={"adapter_dir": str(adapter_dir), "hf_dir": str(root / "merged")},
    )


@pytest.fixture(scope="module")
def lora_run(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], tmp_path_factory: pytest.TempPathFactory
) -> LoRARun:
    """A LoRA trainer on the tiny dense Qwen3 that trained one step (B no longer zero), saved a
    checkpoint, and exported as it does when it stops: the adapter and the merged model."""
    root = tmp_path_factory.mktemp("lora-run")
    config = lora_trainer_config(dense_dir, root, adapter_dir=root / "adapter")
    runtime = build_runtime(config)
    try:
        runtime.trainer.train_step(rl_batches[0])
        runtime.checkpointer.save(runtime.trainer)
        StepExecutor(runtime).export()
        logits = logits_of(runtime.trainer.model, INPUT_IDS)
    finally:
        shutdown_runtime(runtime)
    return LoRARun(config, root / "adapter", root / "merged", logits)


def peft_model(base_dir: pathlib.Path, adapter_dir: pathlib.Path) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def test_the_adapter_folder_is_what_peft_reads(lora_run: LoRARun, dense_dir: pathlib.Path) -> None:
    out = lora_run.adapter_dir
    assert {path.name for path in out.iterdir()} == {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, EXPORT_INFO_FILE}
    assert not list(out.parent.glob(".adapter*")), "the staging folder is left over"
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"], config["fan_in_fan_out"]) == (4, 8.0, "none", False)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(dense_dir.resolve())
    assert json.loads((out / EXPORT_INFO_FILE).read_text())["step"] == 1
    tensors = load_file(out / ADAPTER_WEIGHTS_FILE)
    # 4 layers x 7 projections x (A, B); the trained step moved every B off zero.
    assert len(tensors) == 4 * 7 * 2
    assert all(tensor.abs().sum() > 0 for name, tensor in tensors.items() if "lora_B" in name)


def test_peft_on_the_base_computes_the_trainers_logits(lora_run: LoRARun, dense_dir: pathlib.Path) -> None:
    model = peft_model(dense_dir, lora_run.adapter_dir)
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS[None]).logits[0]
        torch.testing.assert_close(logits, lora_run.logits, rtol=1e-5, atol=1e-5)
        # The adapter matters: the base alone computes other logits.
        with model.disable_adapter():
            assert not torch.allclose(model(input_ids=INPUT_IDS[None]).logits[0], lora_run.logits, atol=1e-4)


def test_peft_merged_is_the_trainers_merged_export(lora_run: LoRARun, dense_dir: pathlib.Path) -> None:
    merged = peft_model(dense_dir, lora_run.adapter_dir).merge_and_unload().state_dict()
    exported = load_file(lora_run.hf_dir / "model.safetensors")
    for name, tensor in exported.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_resumed_trainer_exports_the_same_adapter(
    lora_run: LoRARun, dense_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    config = lora_trainer_config(dense_dir, pathlib.Path(lora_run.config.checkpoint.dir).parent, adapter_dir=tmp_path)
    config = config.model_copy(update={"export": config.export.model_copy(update={"hf_dir": None})})
    runtime = build_runtime(config)
    try:
        assert runtime.trainer.step == 1
        StepExecutor(runtime).export()
    finally:
        shutdown_runtime(runtime)
    resumed, original = (
        load_file(tmp_path / ADAPTER_WEIGHTS_FILE),
        load_file(lora_run.adapter_dir / ADAPTER_WEIGHTS_FILE),
    )
    assert resumed.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(resumed[name], tensor), name


@pytest.fixture(scope="module")
def glm4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """GLM-4.5 at the tiny shape: a dense first layer and shared experts beside the routed ones."""
    return make_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-glm4-moe", family="glm4-moe")


def lora_model(model_dir: pathlib.Path, targets: list[str]) -> torch.nn.Module:
    """The tiny model with LoRA on `targets`, every B drawn at random (as if trained)."""
    model = load_tiny_model(model_dir)
    apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=targets))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


# PEFT's conversion of per-expert adapters onto the fused experts warns so, yet applies them (the logits agree).
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_routed_expert_adapters_load_into_peft(
    family: str, moe_dir: pathlib.Path, glm4_moe_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model_dir = moe_dir if family == "qwen3_moe" else glm4_moe_dir
    model = lora_model(model_dir, ["q", "experts"])
    check_peft_exportable(model, model_type=family)
    out = export_peft_adapter(
        model, source_dir=model_dir, out_dir=tmp_path / "adapter", rank=4, alpha=8.0, dtype=torch.float32,
        is_destination=True, step=0,
    )  # fmt: skip
    assert out is not None
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]
    with torch.no_grad():
        logits = peft_model(model_dir, out)(input_ids=INPUT_IDS[None]).logits[0]
    torch.testing.assert_close(logits, logits_of(model, INPUT_IDS), rtol=1e-5, atol=1e-5)


def test_adapters_peft_would_drop_are_refused(
    moe_dir: pathlib.Path, glm4_moe_dir: pathlib.Path, dense_dir: pathlib.Path
) -> None:
    # Routed experts of a family PEFT does not convert them for.
    with pytest.raises(ValueError, match=r"lora\.target_modules adapts the routed experts.*'laguna'"):
        check_peft_exportable(lora_model(moe_dir, ["q", "experts"]), model_type="laguna")
    # GLM-4.5's dense and shared-expert MLPs: PEFT retargets gate_proj, ... to its routed experts.
    with pytest.raises(ValueError, match=r"lora\.target_modules adapts dense or shared-expert MLPs.*'glm4_moe'"):
        check_peft_exportable(lora_model(glm4_moe_dir, ["q", "gate", "up", "down"]), model_type="glm4_moe")
    # Attention exports for every family; dense MLPs where PEFT keeps them (a dense model has no experts).
    check_peft_exportable(lora_model(glm4_moe_dir, ["q", "k", "v", "o"]), model_type="glm4_moe")
    check_peft_exportable(lora_model(dense_dir, ["q", "gate", "up", "down", "experts"]), model_type="qwen3")


def test_a_trainer_whose_adapter_peft_would_drop_refuses_to_start(
    glm4_moe_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # lora.target_modules' default adapts GLM-4.5's dense and shared-expert MLPs.
    runtime = build_runtime(
        trainer_config(glm4_moe_dir, lora={"enabled": True}, export={"adapter_dir": str(tmp_path / "adapter")})
    )
    try:
        with pytest.raises(ValueError, match=r"export\.adapter_dir: lora\.target_modules adapts dense"):
            StepExecutor(runtime)
    finally:
        shutdown_runtime(runtime)


def test_an_adapter_export_needs_lora(dense_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"export\.adapter_dir .*needs lora\.enabled"):
        load_config(TrainerConfig, [f"--model.path={dense_dir}", f"--export.adapter_dir={tmp_path}"])
