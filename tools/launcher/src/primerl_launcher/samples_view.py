"""`primerl samples RUN_DIR --step N [--html FILE]`: one step's rollouts as the orchestrator
wrote them (output.samples_dir/step_<n>.jsonl: prompt, completion, reward, advantage,
policy version, images), as text or as an HTML page (the page code is primerl_common's, shared
with the orchestrator's per-step pages)."""

from __future__ import annotations

import json
import os
import pathlib
import tomllib
from collections.abc import Sequence
from typing import Any

from primerl_common.sample_pages import samples_page

__all__ = ["find_samples_dir", "format_samples", "read_samples", "write_samples_page"]


class SamplesNotFound(ValueError):
    """No samples for the run or the step asked for; the message says what exists."""


def find_samples_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """output.samples_dir of the run's orchestrator config, else <run>/orchestrator/samples."""
    config = run_dir / "config" / "orchestrator.toml"
    if config.is_file():
        configured = tomllib.loads(config.read_text()).get("output", {}).get("samples_dir")
        if configured:
            return pathlib.Path(configured)
    return run_dir / "orchestrator" / "samples"


def read_samples(run_dir: pathlib.Path, step: int) -> list[dict[str, Any]]:
    directory = find_samples_dir(run_dir)
    path = directory / f"step_{step:06d}.jsonl"
    if not path.is_file():
        steps = sorted(int(p.stem.removeprefix("step_")) for p in directory.glob("step_*.jsonl"))
        if not steps:
            raise SamplesNotFound(f"no samples in {directory} (the orchestrator's output.samples_dir)")
        raise SamplesNotFound(f"no samples of step {step} in {directory}; steps {steps[0]}..{steps[-1]} are there")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_samples(rows: Sequence[dict[str, Any]], *, max_chars: int = 400) -> str:
    def clip(text: str) -> str:
        return text if len(text) <= max_chars else text[:max_chars] + f"... ({len(text) - max_chars} more)"

    if not rows:
        return "no samples"
    step = rows[0]["step"]
    rewards = [row["reward"] for row in rows]
    lines = [f"step {step}: {len(rows)} samples, reward mean {sum(rewards) / len(rewards):.3f}"]
    for index, row in enumerate(rows):
        lines += [
            "",
            f"#{index} {row['environment']}  reward {row['reward']:.3f}  advantage {row['advantage']:+.3f}  "
            f"policy version {row['policy_version']}  group {row['group_id'][:8]}",
            "  prompt:     " + clip(row["prompt"]).replace("\n", "\n              "),
            "  completion: " + clip(row["completion"]).replace("\n", "\n              "),
        ]
        if row.get("images"):
            lines.append("  images:     " + ", ".join(image["path"] for image in row["images"]))
    return "\n".join(lines)


def write_samples_page(
    rows: Sequence[dict[str, Any]], path: pathlib.Path, *, samples_dir: pathlib.Path, title: str
) -> None:
    """Writes the page of `rows` to `path`, its images linked relatively from there to `samples_dir`."""
    samples_href = os.path.relpath(samples_dir.resolve(), path.parent.resolve())
    path.write_text(samples_page(rows, title=title, samples_href=pathlib.Path(samples_href).as_posix()))
