import pytest

from primerl_common.config import ConfigError, load_config
from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return path


def write(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return ["-c", str(path)]


def test_example_config_shape(tmp_path, model_dir):
    config = load_config(
        OrchestratorConfig,
        write(
            tmp_path,
            f"""
[model]
path = "{model_dir}"
[[environments]]
name = "rev"
kind = "reverse_text"
group_size = 4
[environments.options]
max_length = 6
[[environments]]
name = "guess"
""",
        ),
    )
    assert [env.builtin for env in config.environments] == [True, False]
    assert config.environments[0].options == {"max_length": 6}
    assert config.run.max_async_level == 1 and config.run.max_off_policy_steps == 8
    assert config.peers.weight_broadcaster is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[[environments]]\nname = "a"\nkind = "nope"', "unknown environment kind 'nope'"),
        ('[[environments]]\nname = "a"\nkind = "reverse_text"\n[environments.options]\nlength = 3', "length"),
        ('[[environments]]\nname = "a"\n[[environments]]\nname = "a"', "duplicate name a"),
        ('[[environments]]\nname = "a"\ngroup_size = 99', "below the largest group_size 99"),
        (
            '[run]\nmax_async_level = 3\nmax_off_policy_steps = 2\n[[environments]]\nname = "a"',
            "max_off_policy_steps 2",
        ),
        ('[[environments]]\nname = "a"\n[environments.sampling]\ntemperature = 0', "temperature"),
        ('[[environments]]\nname = "a"\n[environments.sampling]\ntemperature = 2.4', "temperature"),
        ('[[environments]]\nname = "a"\noptions = {x = 1}', "options are for built-in environments"),
        ('[peers]\nrun_id = "no/slash"\n[[environments]]\nname = "a"', r"peers\.run_id.*not an adapter name"),
        ('[peers]\nrun_id = "-dash-first"\n[[environments]]\nname = "a"', r"peers\.run_id.*not an adapter name"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, model_dir, body, message):
    with pytest.raises(ConfigError, match=message):
        load_config(OrchestratorConfig, write(tmp_path, f'[model]\npath = "{model_dir}"\n{body}\n'))


def test_model_folder_needs_a_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        load_config(
            OrchestratorConfig, write(tmp_path, f'[model]\npath = "{tmp_path}"\n[[environments]]\nname = "a"\n')
        )


def run_config(tmp_path, model_dir, *, run_id: str, lora_adapter: str | None = None) -> OrchestratorConfig:
    adapter = "" if lora_adapter is None else f'lora_adapter = "{lora_adapter}"\n'
    text = f'[model]\npath = "{model_dir}"\n{adapter}[peers]\nrun_id = "{run_id}"\n[[environments]]\nname = "a"\n'
    return load_config(OrchestratorConfig, write(tmp_path, text))


def test_a_run_generates_with_and_follows_the_adapter_named_by_its_run_id(tmp_path, model_dir):
    assert run_config(tmp_path, model_dir, run_id="run-a").lora_adapter == "run-a"
    assert run_config(tmp_path, model_dir, run_id="run-a", lora_adapter="run-a").lora_adapter == "run-a"
    # A trainer of one run: model.lora_adapter, or the base model.
    assert run_config(tmp_path, model_dir, run_id="", lora_adapter="mine").lora_adapter == "mine"
    assert run_config(tmp_path, model_dir, run_id="").lora_adapter == ""


def test_a_run_id_and_another_lora_adapter_name_both_fields(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"model\.lora_adapter 'other' is not peers\.run_id 'run-a'"):
        run_config(tmp_path, model_dir, run_id="run-a", lora_adapter="other")
