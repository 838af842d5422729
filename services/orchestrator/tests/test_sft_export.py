import json
import subprocess
import sys

import pytest

from primerl_orchestrator.environments.reverse_text import ReverseText
from primerl_orchestrator.sft_export import main

CONFIG = """
[model]
path = "/not/made/yet"
[run]
seed = 3
[[environments]]
name = "rev"
kind = "reverse_text"
[environments.options]
min_length = 5
max_length = 7
[[environments]]
name = "guess"
kind = "external"
"""

SYSTEM = "Reverse the text the user sends, character by character. Answer with the reversed text only."


def run(tmp_path, *args, config=CONFIG):
    path = tmp_path / "orchestrator.toml"
    path.write_text(config)
    return main(["-c", str(path), *args])


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writes_the_prompt_and_the_reference_answer(tmp_path):
    out = tmp_path / "data" / "sft.jsonl"
    assert run(tmp_path, "--environment", "rev", "--num-samples", "20", "--output", str(out)) == 0
    examples = lines(out)
    assert len(examples) == 20
    # The default seed is the run's + 1: the stream RL would see under seed 4, not 3.
    environment = ReverseText(ReverseText.Options(min_length=5, max_length=7), seed=4)
    for index, example in enumerate(examples):
        task = environment.task(index)
        system, user, assistant = example["messages"]
        assert system == {"role": "system", "content": SYSTEM}
        assert user == {"role": "user", "content": task.data["text"]}
        assert assistant == {"role": "assistant", "content": task.data["text"][::-1]}
        assert 5 <= len(task.data["text"]) <= 7
        assert environment.score(task, assistant["content"]) == 1.0


def test_tasks_differ_from_the_rl_run_and_follow_the_seed(tmp_path):
    rl = ReverseText(ReverseText.Options(min_length=5, max_length=7), seed=3)
    rl_texts = [rl.task(index).data["text"] for index in range(50)]
    out = tmp_path / "sft.jsonl"
    assert run(tmp_path, "--environment", "rev", "--num-samples", "50", "--output", str(out)) == 0
    sft_texts = [example["messages"][1]["content"] for example in lines(out)]
    assert sft_texts != rl_texts
    assert run(tmp_path, "--environment", "rev", "--num-samples", "50", "--output", str(out), "--seed", "9") == 0
    seeded = ReverseText(ReverseText.Options(min_length=5, max_length=7), seed=9)
    assert [example["messages"][1]["content"] for example in lines(out)] == [
        seeded.task(index).data["text"] for index in range(50)
    ]


def test_the_rl_seed_is_refused(tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    assert run(tmp_path, "--environment", "rev", "--num-samples", "5", "--output", str(out), "--seed", "3") == 2
    assert "is the RL run's seed" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("guess", "environment 'guess' is external"),
        ("nope", "no environment 'nope' in the config; configured: rev, guess"),
    ],
)
def test_environments_without_answers_are_named(tmp_path, capsys, name, message):
    out = tmp_path / "sft.jsonl"
    assert run(tmp_path, "--environment", name, "--num-samples", "5", "--output", str(out)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
    assert not list(tmp_path.glob(".sft.jsonl.*"))


def test_an_environment_without_a_reference_answer_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ReverseText, "reference_answer", lambda self, task: None)
    out = tmp_path / "sft.jsonl"
    assert run(tmp_path, "--environment", "rev", "--num-samples", "5", "--output", str(out)) == 2
    assert "environment 'rev' (reverse_text) gives no reference answer" in capsys.readouterr().err
    assert not out.exists()
    assert not list(tmp_path.glob(".sft.jsonl.*"))


def test_a_whole_demo_config_is_read_through_its_orchestrator_table(tmp_path):
    demo = "[launcher]\n[orchestrator]\n" + CONFIG.replace("[model]", "[orchestrator.model]").replace(
        "[run]", "[orchestrator.run]"
    ).replace("[[environments]]", "[[orchestrator.environments]]").replace(
        "[environments.options]", "[orchestrator.environments.options]"
    )
    out = tmp_path / "sft.jsonl"
    assert run(tmp_path, "--environment", "rev", "--num-samples", "3", "--output", str(out), config=demo) == 0
    assert len(lines(out)) == 3


def test_bad_options_are_reported(tmp_path, capsys):
    config = CONFIG.replace("max_length = 7", "max_length = 2")
    out = tmp_path / "sft.jsonl"
    assert run(tmp_path, "--environment", "rev", "--num-samples", "5", "--output", str(out), config=config) == 2
    assert "min_length 5 > max_length 2" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    config = tmp_path / "orchestrator.toml"
    config.write_text(CONFIG)
    out = tmp_path / "sft.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "primerl_orchestrator.sft_export",
            "-c",
            str(config),
            "--environment=rev",
            "--num-samples=4",
            f"--output={out}",
        ],
        check=True,
        capture_output=True,
    )
    assert len(lines(out)) == 4
