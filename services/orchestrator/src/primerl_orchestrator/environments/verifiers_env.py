"""verifiers: an environment written for the `verifiers` library (single-turn, multi-turn or
tool-calling, scored by its rubric), played by a process of its own.

The orchestrator's side is the task stream: task `index` is row `index` of the environment's
dataset (`split`, in an order shuffled by the stream's seed, anew each pass); the task carries
the split and the seed, so that an evaluation's tasks (its own seed, maybe the eval split) are
read by the same process. The process
(primerl_orchestrator.environments.verifiers_process) loads the environment with
`verifiers.load_environment(module, **args)`, takes episodes with NextEpisode, plays them
with the environment's own rollout, its model turns going through Generate, and ends them
with FinishEpisode carrying the rubric's reward and metrics; evaluation episodes (marked with
their evaluation's name) the same way, never trained on. Needs
`primerl-orchestrator[verifiers]`.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Literal

from pydantic import Field, field_validator

from primerl_orchestrator.environments.base import ProcessEnvironment, Task

__all__ = ["VerifiersEnvironment"]

PROCESS_MODULE = "primerl_orchestrator.environments.verifiers_process"


class VerifiersEnvironment(ProcessEnvironment):
    kind = "verifiers"
    eval_options = frozenset({"split", "shuffle"})

    class Options(ProcessEnvironment.Options):
        module: str = Field(
            min_length=1,
            description="the environment's module (installed, importable): its load_environment(**args) "
            "returns the verifiers environment",
        )
        args: dict[str, Any] = Field(default={}, description="keyword arguments of load_environment")
        split: Literal["train", "eval"] = Field(default="train", description="which of its datasets is played")
        shuffle: bool = Field(default=True, description="play the rows in an order shuffled by the run's seed")
        max_concurrent_groups: int = Field(
            default=4, ge=1, description="groups the process plays at once (each runs its group_size rollouts)"
        )
        turn_timeout_s: float = Field(default=900.0, gt=0, description="deadline of one Generate call")
        hub_offline: bool = Field(
            default=True,
            description="run the process with HF_HUB_OFFLINE and HF_DATASETS_OFFLINE set: the environment builds "
            "its data locally (or finds it cached), nothing is downloaded at run time",
        )

        @field_validator("module")
        @classmethod
        def _importable(cls, module: str) -> str:
            if importlib.util.find_spec("verifiers") is None:
                raise ValueError(
                    "the verifiers library is not installed: pip install 'primerl-orchestrator[verifiers]'"
                )
            try:
                found = importlib.util.find_spec(module.replace("-", "_"))
            except (ImportError, ValueError) as exc:
                raise ValueError(f"cannot find module {module!r}: {exc}") from None
            if found is None:
                raise ValueError(f"no module {module!r} is installed (pip install the environment's package)")
            return module

    options: Options

    def task(self, index: int) -> Task:
        # The row itself is the process's to read: only it loads the dataset.
        options = self.options
        return Task(
            task_id=f"{self.kind}-{options.split}-{self.seed}-{index}",
            data={"index": index, "split": options.split, "seed": self.seed, "shuffle": options.shuffle},
        )

    def command(self, *, name: str, orchestrator: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            PROCESS_MODULE,
            f"--orchestrator={orchestrator}",
            f"--environment={name}",
            f"--seed={self.seed}",
            f"--options={self.options.model_dump_json()}",
        ]
