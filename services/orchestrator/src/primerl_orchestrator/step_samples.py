"""A step's rollouts as logged: what `primerl samples` shows, the step's page and the trackers' tables.

One row per training sample of each rollout of the batch: its prompt (the tokens before the
first one trained on) and completion (the rest, environment turns included) decoded, the
episode's reward and advantage, the oldest policy version among its trained tokens, and the
prompt's images, in the order of their tokens: each as its file's path relative to the samples
folder, its MIME type and its sha256.

Written to output.samples_dir: step_<n>.jsonl, the page step_<n>.html beside it, and each image
once under images/<sha256>.<ext> (content-addressed: an image seen in many steps is one file).
Every file is written aside and renamed: a reader never sees half a file. The rows are JSON
data alone; the image bytes come from the rollouts (`sample_images`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from primerl_common.durable import replace_atomically
from primerl_common.images import MIME_TYPES
from primerl_common.sample_pages import samples_page
from primerl_orchestrator.episodes import Rollout
from primerl_orchestrator.rendering import PromptRenderer
from primerl_orchestrator.samples import PromptImage

__all__ = ["sample_images", "sample_rows", "samples_path", "write_samples"]


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
                    "images": [_image_entry(image) for image in sample.images],
                }
            )
    return rows


def _image_path(image: PromptImage) -> str:
    return f"images/{image.digest}.{MIME_TYPES.get(image.mime_type, 'bin').lower()}"


def _image_entry(image: PromptImage) -> dict[str, Any]:
    return {"path": _image_path(image), "mime_type": image.mime_type, "digest": image.digest}


def sample_images(rollouts: Sequence[Rollout]) -> dict[str, bytes]:
    """The bytes of each image of the rollouts' samples, by its path in the rows."""
    return {
        _image_path(image): image.data for rollout in rollouts for sample in rollout.samples for image in sample.images
    }


def samples_path(directory: pathlib.Path, step: int) -> pathlib.Path:
    return directory / f"step_{step:06d}.jsonl"


def write_samples(
    directory: pathlib.Path, step: int, rows: Sequence[dict[str, Any]], images: Mapping[str, bytes] | None = None
) -> pathlib.Path:
    """Writes the `images` (by path, from `sample_images`) not there yet, then the step's JSONL
    and page; returns the JSONL's path."""
    directory.mkdir(parents=True, exist_ok=True)
    for relative, data in (images or {}).items():
        target = directory / relative
        if not target.exists():
            target.parent.mkdir(exist_ok=True)
            replace_atomically(target, data)
    path = samples_path(directory, step)
    replace_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    replace_atomically(path.with_suffix(".html"), samples_page(rows, title=f"step {step}"))
    return path
