"""Checkpoints of the LoRA runs of a `RunSet`, one folder per run:

    <root>/<run_id>/run.json         what the run was created with (the caller's JSON), replaced atomically
    <root>/<run_id>/step_00000042/   DCP files of the run's `RunSet.state_dict`
    <root>/<run_id>/latest           the newest complete one's folder name

    <root>/.pending_removals.json    deleted runs whose adapters the weight broadcaster has not
                                     removed yet (rank 0's alone), replaced atomically

Each run's folder is a `checkpoint.CheckpointFolder`: the same crash safety, damage detection,
fallback to the newest complete checkpoint and `keep_last` pruning as the single-run trainer's.

In a checkpoint the optimizer's state stays keyed by torch's parameter index, as a string
(`optimizer.state.<index>.exp_avg`); DCP writes every rank's shard of the DTensors. To load in
place DCP needs a state dict of the same keys, shapes and layouts, which a run added anew lacks:
its optimizer has no state before its first step. That template is built from the checkpoint's
own metadata, every entry of a parameter's shape laid out as that parameter (a DTensor sharded
as the model's LoRA parameters when FSDP2 shards them), so that nothing of the live run is
touched before `RunSet.load_state_dict` takes the whole state. The optimizer's parameter indices
are those of the run's adapter tensors in their order: `RunSet` builds each run's AdamW over the
LoRA parameters in that order (the indices only pick a layout: the values are keyed by index on
both sides).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from primerl_common.durable import fsync_dir, replace_atomically
from primerl_common.errors import NotFound
from primerl_common.lora import adapter_name_problem
from primerl_trainer.checkpoint import CheckpointFolder, on_rank_zero

if TYPE_CHECKING:
    from primerl_trainer.runs import RunSet

__all__ = ["META_FILE", "PENDING_REMOVALS_FILE", "RunCheckpoints"]

logger = logging.getLogger(__name__)

META_FILE = "run.json"
PENDING_REMOVALS_FILE = ".pending_removals.json"
_OPTIMIZER_STATE = "optimizer.state."


class RunCheckpoints:
    """The checkpoints of LoRA runs under `root` (every rank must see it, e.g. a shared
    filesystem), at most `keep_last` per run. Every rank calls every method with the same
    arguments (they are collective); rank 0 writes the metadata and deletes."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last <= 0:
            raise ValueError(f"keep_last must be positive, got {keep_last}")
        self.root = pathlib.Path(root)
        self.keep_last = keep_last

    def save_meta(self, run_id: str, meta: dict[str, Any]) -> None:
        """Write (or replace) what `saved_runs` gives back for the run: `meta`, as JSON."""
        folder = self._run_dir(run_id)
        data = json.dumps(meta, indent=2, sort_keys=True) + "\n"

        def write() -> None:
            folder.mkdir(parents=True, exist_ok=True)
            replace_atomically(folder / META_FILE, data)

        on_rank_zero(write)

    def saved_runs(self) -> dict[str, dict[str, Any]]:
        """Run id -> its `save_meta` for every run folder whose run.json loads; any other run folder
        is passed over with a warning naming it."""
        runs = {}
        folders = sorted(self.root.iterdir()) if self.root.is_dir() else []
        for folder in folders:
            if not folder.is_dir() or adapter_name_problem(folder.name) is not None:
                continue  # not a run's folder (a deletion's leftover is hidden)
            path = folder / META_FILE
            try:
                meta = json.loads(path.read_bytes())
            except FileNotFoundError:
                logger.warning("run folder %s has no %s: passed over", folder, META_FILE, extra={"path": str(folder)})
                continue
            except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                logger.warning("%s does not load (%s): run passed over", path, exc, extra={"path": str(path)})
                continue
            if not isinstance(meta, dict):
                logger.warning("%s holds no JSON object: run passed over", path, extra={"path": str(path)})
                continue
            runs[folder.name] = meta
        return runs

    def save_pending_removals(self, removals: dict[str, dict[str, Any]]) -> None:
        """Write (or replace) what `pending_removals` gives back: run id -> a JSON object, the
        deleted runs whose adapters are still to be removed. Rank 0's alone (not collective)."""
        data = json.dumps({"pending": removals}, indent=2, sort_keys=True) + "\n"
        self.root.mkdir(parents=True, exist_ok=True)
        replace_atomically(self.root / PENDING_REMOVALS_FILE, data)

    def pending_removals(self) -> dict[str, dict[str, Any]]:
        """What `save_pending_removals` wrote last ({} when nothing; a file that does not load is
        logged and taken as nothing). Rank 0's alone."""
        path = self.root / PENDING_REMOVALS_FILE
        try:
            pending = json.loads(path.read_bytes())["pending"]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error(
                "%s does not load (%s): the adapters of runs deleted before are not removed",
                path,
                exc,
                extra={"path": str(path)},
            )
            return {}
        if not isinstance(pending, dict):
            logger.error("%s holds no JSON object of removals: none taken", path, extra={"path": str(path)})
            return {}
        return {
            run_id: record
            for run_id, record in pending.items()
            if isinstance(record, dict) and adapter_name_problem(run_id) is None
        }

    def save(self, run_id: str, state: dict[str, Any]) -> pathlib.Path:
        """Write the run's `RunSet.state_dict` for its step and make it the run's latest
        checkpoint; return its folder."""
        if not state["optimizer"]["state"]:
            # As the single-run checkpoints: a run before its first update is its config alone.
            raise ValueError(
                f"run {run_id!r} step {state['step']}: nothing to checkpoint before the optimizer's first update"
            )
        optimizer = state["optimizer"]
        in_dcp_form = state | {
            "optimizer": optimizer | {"state": {str(index): entries for index, entries in optimizer["state"].items()}}
        }
        return self._folder(run_id).save(state["step"], lambda path: dcp.save(in_dcp_form, checkpoint_id=path))

    def load_latest(self, run_id: str, run_set: RunSet) -> int | None:
        """Restore the run's newest complete checkpoint into it (added to `run_set` with the config it
        was saved with, or failed); return its step, or None if it has none. One that does not read
        is passed over for the next; a state the run refuses (`InvalidArgument`) is raised."""
        if run_id not in run_set.run_ids:
            raise NotFound(f"no run {run_id!r}")  # not a reason to pass over its checkpoints
        state = self._folder(run_id).load_newest(lambda path: _read(path, run_set.state_dict(run_id)))
        if state is None:
            return None
        run_set.load_state_dict(run_id, state)
        logger.info("restored run checkpoint", extra={"run_id": run_id, "step": state["step"]})
        return state["step"]

    def delete(self, run_id: str) -> None:
        """Remove the run's folder: its metadata and checkpoints."""
        folder = self._run_dir(run_id)

        def remove() -> None:
            if not folder.exists():
                return
            # Out of saved_runs' sight at once, however far the deletion gets before a crash.
            doomed = folder.with_name(f".{run_id}.deleted")
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(folder, doomed)
            fsync_dir(self.root)
            shutil.rmtree(doomed)

        on_rank_zero(remove)

    def _run_dir(self, run_id: str) -> pathlib.Path:
        if (problem := adapter_name_problem(run_id)) is not None:
            raise ValueError(f"run id {problem}")
        return self.root / run_id

    def _folder(self, run_id: str) -> CheckpointFolder:
        return CheckpointFolder(self._run_dir(run_id), keep_last=self.keep_last)


def _read(path: pathlib.Path, live: dict[str, Any]) -> dict[str, Any]:
    """The run state `path` holds, in `RunSet.state_dict`'s form; `live` is the run's own."""
    state = _template(live, dcp.FileSystemReader(path).read_metadata())
    dcp.load(state, checkpoint_id=path)
    optimizer = state["optimizer"]
    optimizer["state"] = {int(index): entries for index, entries in optimizer["state"].items()}
    return state


def _template(live: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """A state dict for DCP to load the checkpoint into: the live run's layout, in new tensors,
    and the optimizer's state entries the checkpoint has (see the module docstring)."""
    param_ids = [index for group in live["optimizer"]["param_groups"] for index in group["params"]]
    params = list(live["adapter"].values())
    if len(param_ids) != len(params):
        raise ValueError(f"the run's optimizer has {len(param_ids)} parameters and its adapter {len(params)} tensors")
    param_of = dict(zip(param_ids, params, strict=True))
    optimizer_state: dict[str, dict[str, Any]] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(_OPTIMIZER_STATE):
            continue
        index, name = key.removeprefix(_OPTIMIZER_STATE).split(".", 1)
        param = param_of.get(int(index))
        if param is None:
            raise ValueError(f"the checkpoint has optimizer state for parameter {index}, of {len(params)}")
        value = None  # not a tensor: DCP puts the saved object in its place
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            if item.size == param.shape:
                value = torch.zeros_like(param, dtype=dtype)
            else:  # e.g. AdamW's step count, a CPU scalar
                value = torch.zeros(item.size, dtype=dtype)
        optimizer_state.setdefault(index, {})[name] = value
    return live | {
        "adapter": {name: torch.zeros_like(tensor) for name, tensor in live["adapter"].items()},
        "optimizer": {"state": optimizer_state, "param_groups": live["optimizer"]["param_groups"]},
    }
