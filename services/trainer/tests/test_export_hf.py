"""export.hf_dir (the trainer's final weights as a Hugging Face folder) and sft.exit_when_done."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl_common.config import ConfigError, load_config
from primerl_launcher.tiny_model import STAMP_FILE
from primerl_trainer.config import TrainerConfig
from primerl_trainer.export import hf_converter
from primerl_trainer.hf_export import EXPORT_INFO_FILE, export_hf_model
from primerl_trainer.models import read_hf_state_dict
from primerl_trainer.runtime import build_runtime, shutdown_runtime

from .serving import config_toml, trainer_config
from .tiny_training import load_tiny_model

MODEL_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids[None], torch.arange(len(input_ids))[None]).logits[0]


def perturbed_model(model_dir: pathlib.Path) -> torch.nn.Module:
    """The tiny model with every weight moved: an export of the original would not pass."""
    model = load_tiny_model(model_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def export(model: torch.nn.Module, source: pathlib.Path, out: pathlib.Path, **kwargs) -> pathlib.Path:
    path = export_hf_model(
        model,
        source_dir=source,
        out_dir=out,
        dtype=torch.float32,
        lora_scale=None,
        is_destination=True,
        step=kwargs.pop("step", 3),
        **kwargs,
    )
    assert path == out
    return out


def test_export_holds_the_models_weights_and_loads_back(dense_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = perturbed_model(dense_dir)
    out = export(model, dense_dir, tmp_path / "export")

    names = {path.name for path in out.iterdir()}
    assert names == MODEL_FILES | {"model.safetensors", EXPORT_INFO_FILE}
    assert STAMP_FILE not in names  # the trained weights are not the seed's
    assert json.loads((out / EXPORT_INFO_FILE).read_text())["step"] == 3
    assert json.loads((out / "config.json").read_text()) == json.loads((dense_dir / "config.json").read_text())
    assert not list(tmp_path.glob(".export*")), "the staging folder is left over"

    # The same tensors under the same names as the model's own checkpoint.
    exported = load_file(out / "model.safetensors")
    expected = hf_converter(model)(model.state_dict())
    assert set(exported) == set(load_file(dense_dir / "model.safetensors")) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name

    # The trainer's model, and transformers', on the export compute the model's logits.
    input_ids = torch.tensor([1, 60, 70, 80, 90, 257, 100, 101])
    reference = logits_of(model, input_ids)
    assert torch.equal(logits_of(load_tiny_model(out), input_ids), reference)
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf_model(input_ids[None]).logits[0]
    torch.testing.assert_close(hf_logits, reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits_of(load_tiny_model(dense_dir), input_ids), reference, atol=1e-2)
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(dense_dir).chat_template


def test_large_exports_are_sharded_with_an_index(dense_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = perturbed_model(dense_dir)
    out = export(model, dense_dir, tmp_path / "export", max_shard_bytes=1_000_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert {path.name for path in out.glob("*.safetensors")} == set(shards)
    for shard in shards:
        tensors = load_file(out / shard)
        # Only a tensor that alone exceeds the limit makes a shard larger than it.
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 1_000_000
    state = read_hf_state_dict(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    input_ids = torch.tensor([5, 6, 7, 8])
    assert torch.equal(logits_of(load_tiny_model(out), input_ids), logits_of(model, input_ids))


def test_an_export_replaces_the_previous_one_whole(dense_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "export"
    export(load_tiny_model(dense_dir), dense_dir, out, step=1, max_shard_bytes=1_000_000)
    assert (out / "model.safetensors.index.json").is_file()
    model = perturbed_model(dense_dir)
    export(model, dense_dir, out, step=2)
    # Nothing of the first export (its shards, its index) is left.
    assert {path.name for path in out.iterdir()} == MODEL_FILES | {"model.safetensors", EXPORT_INFO_FILE}
    assert json.loads((out / EXPORT_INFO_FILE).read_text())["step"] == 2
    assert [path.name for path in tmp_path.iterdir()] == ["export"]
    input_ids = torch.tensor([5, 6, 7, 8])
    assert torch.equal(logits_of(load_tiny_model(out), input_ids), logits_of(model, input_ids))


def test_bfloat16_export_rewrites_the_config_dtype(dense_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = perturbed_model(dense_dir)
    out = export_hf_model(
        model,
        source_dir=dense_dir,
        out_dir=tmp_path / "export",
        dtype=torch.bfloat16,
        lora_scale=None,
        is_destination=True,
        step=0,
    )
    assert out is not None
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    name = "model.embed_tokens.weight"
    assert torch.equal(tensors[name], model.state_dict()["tok_embeddings.weight"].to(torch.bfloat16))


def test_exit_when_done_needs_a_dataset(dense_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"sft\.exit_when_done needs sft\.dataset"):
        load_config(TrainerConfig, [f"--model.path={dense_dir}", "--mode=sft", "--sft.exit_when_done=true"])


def test_sft_trainer_exits_after_its_last_step_with_a_checkpoint_and_an_export(
    dense_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dataset = tmp_path / "sft.jsonl"
    words = ["primerl", "trainer", "gradient", "policy", "rollout", "expert"]
    dataset.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}) + "\n"
            for w in words
        )
    )
    export_dir = tmp_path / "sft-model"
    config = trainer_config(
        dense_dir,
        mode="sft",
        sft={"dataset": str(dataset), "batch_size": 3, "epochs": 2, "exit_when_done": True},
        checkpoint={"dir": str(tmp_path / "checkpoints")},
        export={"hf_dir": str(export_dir)},
    )
    config_path = tmp_path / "trainer.toml"
    config_path.write_text(config_toml(config))
    # Port 0: nothing talks to it; the process trains, saves, exports and exits by itself.
    process = subprocess.run(
        [str(pathlib.Path(sys.executable).parent / "primerl-trainer"), "-c", str(config_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    assert json.loads((export_dir / EXPORT_INFO_FILE).read_text())["step"] == 4
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"

    # The trainer's weights as its final checkpoint restores them...
    runtime = build_runtime(config.model_copy(update={"export": config.export.model_copy(update={"hf_dir": None})}))
    try:
        assert runtime.trainer.step == 4
        trained = {name: tensor.full_tensor() for name, tensor in runtime.trainer.model.state_dict().items()}
        input_ids = torch.tensor([1, 60, 70, 80, 90, 257, 100, 101])
        reference = logits_of(runtime.trainer.model, input_ids)
    finally:
        shutdown_runtime(runtime)
    # ...are the exported ones,
    exported = load_file(export_dir / "model.safetensors")
    for name, tensor in hf_converter(load_tiny_model(dense_dir))(trained).items():
        assert torch.equal(exported[name], tensor), name
    assert not torch.equal(
        exported["model.embed_tokens.weight"], load_file(dense_dir / "model.safetensors")["model.embed_tokens.weight"]
    )
    # and a trainer started on the export computes the same logits.
    runtime = build_runtime(trainer_config(export_dir))
    try:
        assert runtime.trainer.step == 0
        torch.testing.assert_close(logits_of(runtime.trainer.model, input_ids), reference, rtol=0, atol=0)
    finally:
        shutdown_runtime(runtime)
