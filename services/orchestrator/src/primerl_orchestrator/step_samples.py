"""A step's rollouts as text: what `primerl samples` shows and the trackers' sample tables.

One row per training sample of each rollout of the batch: its prompt (the tokens before the
first one trained on) and completion (the rest, environment turns included) decoded, the
episode's reward and advantage, and the oldest policy version among its trained tokens. Written
as output.samples_dir/step_<n>.jsonl (aside and renamed: a reader never sees half a file).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from primerl_orchestrator.episodes import Rollout
from primerl_orchestrator.rendering import PromptRenderer

__all__ = ["sample_rows", "samples_path", "write_samples"]


def sample_rows(step: int, rollouts: Sequence[Rollout], renderer: PromptRenderer) -> list[dict[str, Any]]:
    rows = []
    for rollout in rollouts:
        for index, sample in enumerate(rollout.samples):
            first_trained = sample.loss_mask.index(True)
            rows.append(
                {
                    "step": step,
                    "environment": rollout.environment,
                    "group_id": rollout.group_id,
                    "episode_id": rollout.episode_id,
                    "sample_index": index,
                    "prompt": renderer.decode(sample.token_ids[:first_trained]),
                    "completion": renderer.decode(sample.token_ids[first_trained:]),
                    "reward": rollout.reward,
                    "advantage": rollout.advantage,
                    "policy_version": sample.oldest_version,
                    "num_tokens": len(sample),
                    "num_loss_tokens": sample.num_loss_tokens,
                }
            )
    return rows


def samples_path(directory: pathlib.Path, step: int) -> pathlib.Path:
    return directory / f"step_{step:06d}.jsonl"


def write_samples(directory: pathlib.Path, step: int, rows: Sequence[dict[str, Any]]) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = samples_path(directory, step)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(partial, path)
    return path
