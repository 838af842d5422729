"""A reasoning-gym task set as a verifiers single-turn environment: reasoning-gym makes the
questions procedurally (no download), the model answers once, and the task's own scorer
(`score_answer`) is the rubric.

    module = "primerl_orchestrator.environments.verifiers_examples.reasoning_gym_task"
    args = {task = "spell_backward", num_examples = 1000}
"""

from __future__ import annotations

import re
from typing import Any

import reasoning_gym
import verifiers as vf
from datasets import Dataset

__all__ = ["extract_answer", "load_environment"]

SYSTEM_PROMPT = "Answer with the answer only, or put it between <answer> and </answer>."
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str:
    """The text between the last <answer> tags, else the whole text; stripped."""
    tagged = _TAGGED.findall(text)
    return (tagged[-1] if tagged else text).strip()


def load_environment(
    task: str = "spell_backward",
    num_examples: int = 1000,
    num_eval_examples: int = 100,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
    task_config: dict[str, Any] | None = None,
) -> vf.SingleTurnEnv:
    """`num_examples` training and `num_eval_examples` evaluation questions of reasoning-gym's
    `task` (its own settings in `task_config`), made from `seed`."""
    procedural = reasoning_gym.create_dataset(
        task, size=num_examples + num_eval_examples, seed=seed, **(task_config or {})
    )
    rows = [
        {"question": entry["question"], "answer": str(entry["answer"]), "info": {"index": index, "source": task}}
        for index, entry in enumerate(procedural)
    ]
    parser = vf.Parser(extract_fn=extract_answer)

    def reasoning_gym_score(completion: vf.Messages, info: dict[str, Any], **kwargs: Any) -> float:
        """The task's own score of the answer (1 for a right one; some tasks give partial credit)."""
        answer = parser.parse_answer(completion)
        return float(procedural.score_answer(answer=answer, entry=procedural[info["index"]]))

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows[:num_examples]),
        eval_dataset=Dataset.from_list(rows[num_examples:]) if num_eval_examples else None,
        system_prompt=system_prompt,
        parser=parser,
        rubric=vf.Rubric(funcs=[reasoning_gym_score], parser=parser),
    )
