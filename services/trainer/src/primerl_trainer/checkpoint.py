"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, learning-rate schedule,
step and RNG states.

Layout under the root folder (which every rank must see, e.g. a shared filesystem):

    step_00000042/   DCP files: .metadata and one .distcp file per rank
    latest           text: the folder name of the newest complete checkpoint

A step's folder is written first and `latest` is replaced atomically once every rank has
finished, so a crash during a save leaves the previous checkpoint as the latest. A checkpoint
damaged later (a file truncated or lost, the metadata gone, `latest` itself unreadable) is
passed over with a warning saying why, for the newest complete one; DCP's own failure to load
one does the same. Sharded
(FSDP2) state is written by each rank and can be loaded onto another number of ranks (DCP
reshards it), except the RNG states, which are per rank: a rank the checkpoint has none for
keeps its own.

`CheckpointFolder` keeps these rules for one such folder, whatever its checkpoints hold:
`Checkpointer` (the single-run trainer) and `run_checkpoint.RunCheckpoints` (one folder per
LoRA run of a `RunSet`) both write and read their checkpoints through it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from primerl_common.durable import replace_atomically
from primerl_trainer.train import Trainer

__all__ = ["LATEST_FILE", "CheckpointFolder", "Checkpointer", "TrainedParametersChanged", "on_rank_zero"]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"step_(\d{8})")

_T = TypeVar("_T")


class CheckpointFolder:
    """A folder of step checkpoints (`step_XXXXXXXX` folders and the `latest` marker) and the rules
    of the module docstring: a save becomes the latest only once complete, a damaged one is passed
    over for the newest complete one, `keep_last` prunes. What a checkpoint holds is its caller's:
    `save` and `load_newest` take the function that writes or reads one folder. Every rank calls
    every method (they are collective); only rank 0 writes the marker and deletes old checkpoints.
    Other files in the folder are left alone."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last <= 0:
            raise ValueError(f"keep_last must be positive, got {keep_last}")
        self.root = pathlib.Path(root)
        self.keep_last = keep_last

    @property
    def marker(self) -> pathlib.Path:
        return self.root / LATEST_FILE

    def save(self, step: int, write: Callable[[pathlib.Path], None]) -> pathlib.Path:
        """Write `step`'s checkpoint with `write(folder)` (collective, e.g. `dcp.save`) and make it
        the latest; return its folder. The latest step saved again is a no-op."""
        path = self.root / _step_dir_name(step)
        if _read_marker(self.marker) == path.name and _damage(path) is None:
            return path
        # Left over from a save that crashed before it became the latest.
        on_rank_zero(lambda: shutil.rmtree(path, ignore_errors=True))
        write(path)
        on_rank_zero(lambda: self._make_latest(path))
        logger.info("saved checkpoint", extra={"step": step, "path": str(path)})
        return path

    def latest_path(self) -> pathlib.Path | None:
        """The newest complete checkpoint: the folder `latest` names, else (damaged) the newest
        complete other one. None when there is no checkpoint yet; ValueError when `latest` names
        one and none is complete (a run that had some must not start over unnoticed)."""
        return next(self.complete(), None)

    def load_newest(self, read: Callable[[pathlib.Path], _T], *, fatal: tuple[type[Exception], ...] = ()) -> _T | None:
        """`read` (collective, e.g. around `dcp.load`) of the newest complete checkpoint it reads;
        None if there is none yet. One it fails on is passed over for the next, with a warning,
        but for the errors in `fatal`, which every checkpoint would raise alike."""
        for path in self.complete():
            try:
                return read(path)
            except fatal:
                raise
            except Exception as exc:  # DCP raises CheckpointException on every rank alike
                logger.warning("checkpoint %s did not load: %s", path, exc, extra={"path": str(path)})
        return None

    def complete(self) -> Iterator[pathlib.Path]:
        """The complete checkpoints, `latest`'s first, then the others newest first; each one
        passed over is logged with why. Raises ValueError once none is left, if any was there."""
        marker = self.marker
        name = _read_marker(marker)
        folders = sorted(self._step_folders(), reverse=True)
        why_not: list[str] = []
        candidates = []
        if name is not None and _STEP_DIR.fullmatch(name):
            candidates.append(self.root / name)
        elif name is not None:
            why_not.append(f"{marker} names {name!r}, not a step folder")
        elif folders:
            why_not.append(f"{marker} is missing")
        candidates += [folder for folder in folders if folder not in candidates]
        for path in candidates:
            damage = _damage(path)
            if damage is not None:
                why_not.append(f"{path.name} {damage}")
                continue
            if why_not:
                logger.warning(
                    "resuming from %s, the newest complete checkpoint: %s",
                    path.name,
                    "; ".join(why_not),
                    extra={"path": str(path)},
                )
            yield path
            why_not.append(f"{path.name} did not load")
        if name is not None:
            raise ValueError(
                f"{marker} names {name!r}, which is not a complete checkpoint, and no other complete one is in "
                f"{self.root}: " + "; ".join(why_not)
            )
        if folders:
            # No marker: no save ever finished (the first one crashed), so nothing is lost.
            logger.warning("no complete checkpoint in %s: %s", self.root, "; ".join(why_not))

    def _step_folders(self) -> list[pathlib.Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]

    def _make_latest(self, path: pathlib.Path) -> None:
        replace_atomically(self.marker, path.name + "\n")
        if self.keep_last is not None:
            for old in sorted(self._step_folders())[: -self.keep_last]:
                shutil.rmtree(old)


class Checkpointer:
    """Saves a `Trainer`'s state into `root` and restores the latest one. Every rank calls every
    method (they are collective); only rank 0 writes the marker and deletes old checkpoints."""

    def __init__(self, root: str | os.PathLike[str], *, interval: int = 0, keep_last: int | None = None) -> None:
        if interval < 0:
            raise ValueError(f"interval must be >= 0, got {interval}")
        self._folder = CheckpointFolder(root, keep_last=keep_last)
        self.root = self._folder.root
        self.interval = interval
        self.keep_last = keep_last

    def maybe_save(self, trainer: Trainer) -> pathlib.Path | None:
        """Save when the trainer's step is a multiple of the interval; return the folder if saved."""
        if self.interval and trainer.step % self.interval == 0:
            return self.save(trainer)
        return None

    def save(self, trainer: Trainer) -> pathlib.Path:
        """Write the trainer's state for its current step and make it the latest; return its folder."""
        if not trainer.optimizer.state:
            # DCP would initialise the optimizer's state with a fake step to save it, which
            # would shift Adam's bias correction for the rest of the run.
            raise ValueError(f"step {trainer.step}: nothing to checkpoint before the optimizer's first update")
        return self._folder.save(trainer.step, lambda path: dcp.save(_state_dict(trainer), checkpoint_id=path))

    def latest_path(self) -> pathlib.Path | None:
        """`CheckpointFolder.latest_path` of `root`."""
        return self._folder.latest_path()

    def load_latest(self, trainer: Trainer) -> int | None:
        """Restore the newest complete checkpoint into `trainer` (in place); return its step, or
        None if there is none yet. One that DCP fails to read is passed over for the next."""
        # A change of the trained parameters would pass over every checkpoint of the run: the
        # config is at fault.
        return self._folder.load_newest(lambda path: self._load(trainer, path), fatal=(TrainedParametersChanged,))

    def _load(self, trainer: Trainer, path: pathlib.Path) -> int:
        saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
        state = _state_dict(trainer)
        # Ask only for the RNG states this rank's checkpoint holds (none when it was saved on
        # fewer ranks, no CUDA state when it was saved on the CPU).
        rng_key = _rng_key()
        rng_state = {name: t for name, t in state.pop(rng_key).items() if f"{rng_key}.{name}" in saved_keys}
        if rng_state:
            state[rng_key] = rng_state
        else:
            logger.warning(
                "checkpoint has no RNG state for this rank; keeping the current one", extra={"path": str(path)}
            )
        _check_same_trained_parameters(state["optimizer"], saved_keys, path)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            trainer.model,
            trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
        trainer.step = state["step"]
        if rng_state:
            _set_rng_state(state[rng_key], trainer.device)
        logger.info("restored checkpoint", extra={"step": trainer.step, "path": str(path)})
        return trainer.step


class TrainedParametersChanged(ValueError):
    """The checkpoint's optimizer state is for other parameters than those trained now."""


def _check_same_trained_parameters(optimizer_state: dict[str, Any], saved_keys: Any, path: pathlib.Path) -> None:
    """Refuses a checkpoint whose optimizer state covers other parameters than the trainer
    trains now (e.g. model.train_vision_encoder changed since it was saved): its AdamW state
    would not fit, and DCP's own error names neither cause nor setting."""
    wanted = {name for name in _flat_keys("optimizer.state", optimizer_state.get("state", {}))}
    saved = {key for key in saved_keys if key.startswith("optimizer.state.")}
    trained_now, frozen_now = _parameters(wanted - saved), _parameters(saved - wanted)
    if trained_now or frozen_now:
        raise TrainedParametersChanged(
            f"checkpoint {path} was saved training other parameters than are trained now "
            f"({len(trained_now)} trained now and not then, e.g. {sorted(trained_now)[:2]}; {len(frozen_now)} "
            f"then and not now, e.g. {sorted(frozen_now)[:2]}): did model.train_vision_encoder (or the LoRA "
            "settings) change? Resume with the settings it was saved with, or start a new run from its weights"
        )


def _flat_keys(prefix: str, tree: Any) -> list[str]:
    if isinstance(tree, dict):
        return [key for name, value in tree.items() for key in _flat_keys(f"{prefix}.{name}", value)]
    return [prefix]


def _parameters(keys: set[str]) -> set[str]:
    """The parameter names of optimizer.state.<parameter>.<state> keys."""
    return {key.removeprefix("optimizer.state.").rsplit(".", 1)[0] for key in keys}


def _read_marker(marker: pathlib.Path) -> str | None:
    try:
        return marker.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return f"<unreadable: {exc}>"


def _damage(path: pathlib.Path) -> str | None:
    """Why the checkpoint folder is not complete, or None: DCP's .metadata must load, and every
    file it names must hold the bytes it says (a save that crashed, or a file lost or cut later)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return "has no .metadata (its save did not finish)"
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
        return f"has a .metadata that does not load ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative_path, size in sorted(needed.items()):
        try:
            found = (path / relative_path).stat().st_size
        except FileNotFoundError:
            return f"lacks {relative_path}"
        if found < size:
            return f"has {relative_path} cut short ({found} of {size} bytes)"
    return None


def _state_dict(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint holds; DCP loads into these same objects in place."""
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "lr_scheduler": trainer.lr_scheduler.state_dict(),
        "step": trainer.step,
        _rng_key(): _rng_state(trainer.device),
    }


def _rng_key() -> str:
    # One entry per rank: DCP would keep one copy of an entry every rank saves under the same name.
    return f"rng.rank{_rank()}"


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def on_rank_zero(action: Callable[[], object]) -> None:
    """Run `action` on rank 0 alone, then wait until it is done on every rank (collective): what
    rank 0 changes in a shared folder, every rank sees once this returns."""
    if _rank() == 0:
        action()
    _barrier()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
