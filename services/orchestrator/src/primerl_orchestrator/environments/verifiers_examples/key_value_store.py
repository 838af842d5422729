"""A multi-turn tool environment: a small key-value store the model queries with a `lookup`
tool before it answers. Each task asks for the value under one key; the rubric gives 1 for
an answer that is that value, and reports how often the tool was called (verifiers' tool
metrics) and whether the looked-up value made it into the answer.

    module = "primerl_orchestrator.environments.verifiers_examples.key_value_store"
    args = {num_keys = 8, max_turns = 3}
"""

from __future__ import annotations

import random
from typing import Any

import verifiers as vf
from datasets import Dataset

__all__ = ["load_environment", "make_store"]

SYSTEM_PROMPT = "Find the value stored under the key the user names, then answer with that value only."
WORDS = (
    "amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor",
    "islet", "jade", "kelp", "lumen", "maple", "north", "orbit", "pearl",
)  # fmt: skip


def make_store(num_keys: int, seed: int) -> dict[str, str]:
    """`num_keys` keys (words of WORDS) with random three-digit values."""
    if not 1 <= num_keys <= len(WORDS):
        raise ValueError(f"num_keys must be in [1, {len(WORDS)}], not {num_keys}")
    rng = random.Random(seed)
    return {key: str(rng.randint(100, 999)) for key in rng.sample(WORDS, num_keys)}


def load_environment(
    num_keys: int = 8, num_examples: int = 200, seed: int = 0, max_turns: int = 3, system_prompt: str = SYSTEM_PROMPT
) -> vf.ToolEnv:
    store = make_store(num_keys, seed)
    rng = random.Random(seed + 1)
    keys = sorted(store)
    rows = []
    for _ in range(num_examples):
        key = rng.choice(keys)
        rows.append({"question": f"What is stored under {key}?", "answer": store[key], "info": {"key": key}})

    def lookup(key: str) -> str:
        """The value stored under a key.

        Args:
            key: the key to look up
        """
        return store.get(key.strip(), f"no key {key!r}; the keys are {', '.join(keys)}")

    parser = vf.Parser(extract_fn=str.strip)

    def correct_value(completion: vf.Messages, answer: str, **kwargs: Any) -> float:
        """1 when the final answer is the stored value."""
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    def looked_up_value_in_answer(completion: vf.Messages, answer: str, **kwargs: Any) -> float:
        """1 when the stored value appears anywhere in the final answer (a metric, not rewarded)."""
        return 1.0 if answer in (parser.parse_answer(completion) or "") else 0.0

    rubric = vf.Rubric(funcs=[correct_value, looked_up_value_in_answer], weights=[1.0, 0.0], parser=parser)
    return vf.ToolEnv(
        tools=[lookup],
        max_turns=max_turns,
        dataset=Dataset.from_list(rows),
        system_prompt=system_prompt,
        parser=parser,
        rubric=rubric,
    )
