"""InferenceConfig: required model folder, validated ranges, precedence as every service."""

import json
import pathlib
import shutil

import pytest

from primerl_common.config import ConfigError, load_config
from primerl_inference.config import InferenceConfig
from primerl_launcher.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("config") / "dense", kind="dense")


def test_defaults_and_flags(model_dir: pathlib.Path) -> None:
    config = load_config(InferenceConfig, ["--engine.model", str(model_dir), "--replica.role", "decode"])

    assert config.engine.model == model_dir
    assert config.server.port == 50053
    assert config.replica.role == "decode"
    assert config.replica.initial_policy_version == 0
    assert not config.engine.enable_lora


def test_toml_and_environment(model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "inference.toml"
    toml.write_text(f'[engine]\nmodel = "{model_dir}"\nmax_model_len = 1024\nkv_cache_gib = 2\n')
    monkeypatch.setenv("PRIMERL_INFERENCE_ENGINE__MAX_NUM_SEQS", "3")

    config = load_config(InferenceConfig, ["-c", str(toml)])

    assert (config.engine.max_model_len, config.engine.kv_cache_gib, config.engine.max_num_seqs) == (1024, 2, 3)


def test_example_config_is_valid(model_dir: pathlib.Path) -> None:
    example = pathlib.Path(__file__).parents[1] / "config.example.toml"

    config = load_config(InferenceConfig, ["-c", str(example), "--engine.model", str(model_dir)])

    assert config.server.port == 50053


def test_a_lora_rank_between_two_vllm_takes_is_rounded_up(model_dir: pathlib.Path) -> None:
    args = ["--engine.model", str(model_dir), "--engine.max_lora_rank"]
    assert load_config(InferenceConfig, [*args, "12"]).engine.max_lora_rank == 16
    assert load_config(InferenceConfig, [*args, "64"]).engine.max_lora_rank == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "engine: Field required"),
        (["--engine.model", "/nonexistent"], "engine.model: Value error, /nonexistent is not a model folder"),
        (["--replica.role", "leader"], "replica.role: Input should be 'both', 'prefill' or 'decode'"),
        (["--engine.kv_cache_gib", "0"], "engine.kv_cache_gib: Input should be greater than 0"),
        (["--engine.cpu_kv_cache_max_gib", "0"], "engine.cpu_kv_cache_max_gib: Input should be greater than 0"),
        (["--engine.dtype", "int8"], "engine.dtype: Input should be"),
        (["--weights.staging_dir", "/nonexistent"], "weights.staging_dir: Value error, /nonexistent is not a folder"),
        (["--engine.max_lora_rank", "1024"], "engine.max_lora_rank: Input should be less than or equal to 512"),
    ],
)
def test_bad_values_name_the_field(model_dir: pathlib.Path, args: list[str], message: str) -> None:
    if args and args[0] != "--engine.model":
        args = ["--engine.model", str(model_dir), *args]

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(InferenceConfig, args)


@pytest.mark.parametrize(
    ("saved", "written", "served"),
    [
        ({"torch_dtype": "float32"}, None, "float32"),  # vLLM's own auto would serve it in bfloat16
        ({"dtype": "bfloat16"}, None, "bfloat16"),
        ({}, None, "float32"),  # config.json names none: as the trainer loads it
        ({"torch_dtype": "float32"}, "bfloat16", "bfloat16"),  # set: as set
    ],
)
def test_the_engine_dtype_follows_the_checkpoint_unless_set(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, saved: dict[str, str], written: str | None, served: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    hf_config = json.loads((model / "config.json").read_text())
    hf_config = {k: v for k, v in hf_config.items() if k not in ("dtype", "torch_dtype")} | saved
    (model / "config.json").write_text(json.dumps(hf_config))
    args = ["--engine.model", str(model), *(["--engine.dtype", written] if written else [])]

    assert load_config(InferenceConfig, args).engine.dtype == served


def test_a_checkpoint_dtype_the_engine_cannot_serve_is_refused_unless_set(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    hf_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf_config, "dtype": "float64", "torch_dtype": "float64"}))

    with pytest.raises(ConfigError, match=r"engine.dtype: Value error, .*names dtype 'float64'"):
        load_config(InferenceConfig, ["--engine.model", str(model)])
    assert (
        load_config(InferenceConfig, ["--engine.model", str(model), "--engine.dtype=float16"]).engine.dtype == "float16"
    )
