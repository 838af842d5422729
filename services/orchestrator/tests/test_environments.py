import asyncio

import pytest

from primerl_orchestrator.environments import EXTERNAL, TurnOutcome, environment_class, environment_kinds
from primerl_orchestrator.environments.reverse_text import ReverseText, lcs_ratio
from primerl_orchestrator.environments.sort_letters import SortLetters
from primerl_orchestrator.environments.task_file import TaskFile


def make(cls, seed=0, **options):
    return cls(cls.Options(**options), seed=seed)


def test_registry():
    assert environment_kinds() == ["reverse_text", "sort_letters", "verifiers"]
    assert environment_class("reverse_text") is ReverseText
    with pytest.raises(ValueError, match="unknown environment kind 'nope'; known: external, reverse_text"):
        environment_class("nope")
    with pytest.raises(ValueError):
        environment_class(EXTERNAL)


def test_tasks_are_a_pure_function_of_seed_and_index():
    env = make(ReverseText)
    assert env.task(3) == make(ReverseText).task(3)
    assert env.task(3) != env.task(4)
    assert make(ReverseText, seed=1).task(3) != env.task(3)
    text = env.task(0).data["text"]
    assert 4 <= len(text) <= 12 and text.isalpha()


def test_lcs_ratio():
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("abc", "xyz") == 0.0
    assert lcs_ratio("", "") == 1.0
    assert lcs_ratio("abcd", "abd") == pytest.approx(2 * 3 / 7)
    assert lcs_ratio("", "ab") == 0.0


def test_reverse_text_reward():
    env = make(ReverseText)
    task = env.task(0)
    reversed_text = task.data["text"][::-1]
    assert env.score(task, f" {reversed_text}\n") == 1.0
    assert env.score(task, task.data["text"]) < 1.0 or task.data["text"] == reversed_text
    assert env.score(task, "") == 0.0


def test_reverse_text_prompt_and_reference_answer():
    env = make(ReverseText, system_prompt="Reverse the text.")
    task = env.task(2)
    assert env.prompt(task) == [("system", "Reverse the text."), ("user", task.data["text"])]
    assert env.score(task, env.reference_answer(task)) == 1.0
    assert make(ReverseText).prompt(task)[0][1].startswith("Reverse the text the user sends")


def test_sort_letters_exact_answer():
    env = make(SortLetters, min_letters=5, max_letters=5)
    task = env.task(7)
    assert len(task.data["letters"]) == 5
    assert env.score(task, task.data["answer"]) == 1.0
    assert env.score(task, task.data["answer"][::-1] + "x") == 0.0
    assert env.reference_answer(task) == task.data["answer"]


def test_play_is_one_turn_scored():
    env = make(SortLetters)
    task = env.task(0)
    seen = []

    async def generate(messages):
        seen.append(list(messages))
        return TurnOutcome(text=task.data["answer"], truncated=False)

    outcome = asyncio.run(env.play(task, generate))
    assert outcome.reward == 1.0
    assert seen[0][-1] == ("user", task.data["letters"])


def test_options_are_checked():
    with pytest.raises(ValueError, match="min_length 5 > max_length 2"):
        ReverseText.Options(min_length=5, max_length=2)


def test_task_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"task_id": "a", "data": {"x": 1}}\n\n{"task_id": "b"}\n')
    tasks = TaskFile(path)
    assert [tasks.task(i).task_id for i in range(3)] == ["a", "b", "a"]
    assert tasks.task(0).data == {"x": 1}
    path.write_text('{"data": {}}\n')
    with pytest.raises(ValueError, match=r"tasks\.jsonl:1: not a task"):
        TaskFile(path)
