"""SFT data from a built-in environment's task stream: the prompt each task presents and the
environment's reference answer as the assistant turn, one {"messages": [...]} JSON line per task
(the format the trainer's SFT mode reads).

    python -m primerl_orchestrator.sft_export -c orchestrator.toml --environment reverse_text \\
        --num-samples 2000 --output sft.jsonl

The tasks come from the environment's stream under another seed than the RL run's (by default
the run's seed + 1), so that a warm start does not train on the tasks RL is scored on.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import ValidationError

from primerl_orchestrator.config import EnvironmentConfig, RunConfig
from primerl_orchestrator.environments import environment_class
from primerl_orchestrator.environments.base import SingleTurnEnvironment

__all__ = ["SFTExportError", "environment_config", "main", "sft_examples", "write_sft_jsonl"]


class SFTExportError(ValueError):
    """The environment cannot give SFT data (or the config does not name it)."""


def environment_config(config: dict[str, Any], name: str) -> tuple[EnvironmentConfig, int]:
    """The environment `name` of an orchestrator config (as parsed TOML) and the run's seed.

    A file whose `[orchestrator]` table is the orchestrator's config (a whole-demo TOML) works too.
    Only `environments` and `run.seed` are read: the model need not exist yet."""
    if "environments" not in config and isinstance(config.get("orchestrator"), dict):
        config = config["orchestrator"]
    environments = config.get("environments")
    if not isinstance(environments, list) or not environments:
        raise SFTExportError("the config has no [[environments]]")
    try:
        run = RunConfig.model_validate(config.get("run", {}))
        parsed = [EnvironmentConfig.model_validate(entry) for entry in environments]
    except ValidationError as exc:
        raise SFTExportError(f"the config is not valid: {exc}") from None
    for env in parsed:
        if env.name == name:
            return env, run.seed
    known = ", ".join(env.name for env in parsed)
    raise SFTExportError(f"no environment {name!r} in the config; configured: {known}")


def sft_examples(env_config: EnvironmentConfig, *, seed: int, num_samples: int) -> Iterator[dict[str, Any]]:
    """The first `num_samples` tasks of the environment's stream under `seed`, as chat examples."""
    if not env_config.builtin:
        raise SFTExportError(
            f"environment {env_config.name!r} is external: a program plays it, the orchestrator knows no answers"
        )
    cls = environment_class(env_config.kind)
    environment = cls(cls.Options.model_validate(env_config.options), seed=seed)
    if not isinstance(environment, SingleTurnEnvironment):
        raise SFTExportError(
            f"environment {env_config.name!r} ({env_config.kind}) is not single-turn: no fixed prompt to answer"
        )
    for index in range(num_samples):
        task = environment.task(index)
        answer = environment.reference_answer(task)
        if answer is None:
            raise SFTExportError(
                f"environment {env_config.name!r} ({env_config.kind}) gives no reference answer (reference_answer)"
            )
        messages = [{"role": role, "content": content} for role, content in environment.prompt(task)]
        messages.append({"role": "assistant", "content": answer})
        yield {"messages": messages}


def write_sft_jsonl(path: pathlib.Path, examples: Iterator[dict[str, Any]]) -> int:
    """Writes the examples as JSON lines (beside `path`, then renamed: never half a file); returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        try:
            for example in examples:
                file.write(json.dumps(example) + "\n")
                count += 1
        except BaseException:
            file.close()
            os.unlink(file.name)
            raise
    os.chmod(file.name, 0o644)
    os.replace(file.name, path)
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m primerl_orchestrator.sft_export",
        description="Write SFT data (chat messages with the reference answer) from a built-in environment.",
    )
    parser.add_argument("-c", "--config", type=pathlib.Path, required=True, help="orchestrator TOML config")
    parser.add_argument("--environment", required=True, help="name of the environment in the config")
    parser.add_argument("--num-samples", type=int, required=True, help="tasks to write")
    parser.add_argument("--output", type=pathlib.Path, required=True, help="JSONL file to write")
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the task stream (default: the run's seed + 1, unlike RL's)"
    )
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error("--num-samples must be at least 1")
    try:
        config = tomllib.loads(args.config.read_text())
        env_config, run_seed = environment_config(config, args.environment)
        seed = run_seed + 1 if args.seed is None else args.seed
        if seed == run_seed:
            raise SFTExportError(f"--seed {seed} is the RL run's seed: the SFT tasks would be the tasks RL trains on")
        count = write_sft_jsonl(args.output, sft_examples(env_config, seed=seed, num_samples=args.num_samples))
    except (OSError, tomllib.TOMLDecodeError, SFTExportError) as exc:
        print(f"sft_export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} examples of {args.environment} (seed {seed}) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
