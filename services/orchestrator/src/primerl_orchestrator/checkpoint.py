"""The orchestrator's checkpoint: one JSON file, replaced atomically.

Written when a batch is cut, before it is pushed: the step, each environment's data position
(the next task index), the episodes each environment has started (the scheduler's shares)
and the counters. The built-in environments' tasks are a pure function of the seed and the
task index, so the data position is all the random state there is.

On resume the trainer's next expected step wins over the checkpoint's (it knows which
batches it got). Tasks handed out after the checkpoint are handed out again; those in flight
at the checkpoint, or in a batch that was cut but never reached the trainer, are not
(at most once: nothing is trained or counted twice).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field

from primerl_common.durable import replace_atomically

__all__ = ["CHECKPOINT_FILE", "OrchestratorState", "load_state", "save_state"]

CHECKPOINT_FILE = "orchestrator_state.json"
_FORMAT_VERSION = 1


@dataclass
class OrchestratorState:
    # The last step whose batch was cut (0: none yet).
    step: int = 0
    task_positions: dict[str, int] = field(default_factory=dict)
    episodes_started: dict[str, int] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)


def save_state(directory: pathlib.Path, state: OrchestratorState) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_FILE
    payload = json.dumps({"format_version": _FORMAT_VERSION, **asdict(state)}, indent=2, sort_keys=True)
    replace_atomically(path, payload)
    return path


def load_state(directory: pathlib.Path) -> OrchestratorState | None:
    """The saved state, or None when there is none."""
    path = directory / CHECKPOINT_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    version = data.pop("format_version", None)
    if version != _FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {version}, this orchestrator reads {_FORMAT_VERSION}")
    return OrchestratorState(**data)
