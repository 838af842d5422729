"""`primerl samples RUN_DIR --step N [--html FILE]`: one step's rollouts as the orchestrator
wrote them (output.samples_dir/step_<n>.jsonl: prompt, completion, reward, advantage,
policy version), as text or as an HTML page."""

from __future__ import annotations

import html
import json
import pathlib
import tomllib
from collections.abc import Sequence
from typing import Any

__all__ = ["find_samples_dir", "format_samples", "read_samples", "samples_html"]


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
    return "\n".join(lines)


_STYLE = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: monospace; }
td.num { text-align: right; }
.pos { background: #e6f4e6; } .neg { background: #f8e6e6; }
"""


def samples_html(rows: Sequence[dict[str, Any]], *, title: str) -> str:
    columns = ("environment", "group", "reward", "advantage", "policy version", "prompt", "completion")
    body = []
    for row in rows:
        sign = "pos" if row["advantage"] > 0 else "neg" if row["advantage"] < 0 else ""
        body.append(
            f'<tr class="{sign}"><td>{html.escape(row["environment"])}</td>'
            f"<td>{html.escape(row['group_id'][:8])}</td>"
            f'<td class="num">{row["reward"]:.3f}</td><td class="num">{row["advantage"]:+.3f}</td>'
            f'<td class="num">{row["policy_version"]}</td>'
            f'<td class="text">{html.escape(row["prompt"])}</td>'
            f'<td class="text">{html.escape(row["completion"])}</td></tr>'
        )
    head = "".join(f"<th>{name}</th>" for name in columns)
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{len(rows)} samples</p><table><thead><tr>{head}</tr></thead><tbody>\n"
        + "\n".join(body)
        + "\n</tbody></table></body></html>\n"
    )
