"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, learning-rate schedule,
step and RNG states.

Layout under the root folder (which every rank must see, e.g. a shared filesystem):

    step_00000042/   DCP files: .metadata and one .distcp file per rank
    latest           text: the folder name of the newest complete checkpoint

A step's folder is written first and `latest` is replaced atomically once every rank has
finished, so a crash during a save leaves the previous checkpoint as the latest. Sharded
(FSDP2) state is written by each rank and can be loaded onto another number of ranks (DCP
reshards it), except the RNG states, which are per rank: a rank the checkpoint has none for
keeps its own.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from primerl_common.durable import replace_atomically
from primerl_trainer.train import Trainer

__all__ = ["LATEST_FILE", "Checkpointer"]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"step_(\d{8})")


class Checkpointer:
    """Saves a `Trainer`'s state into `root` and restores the latest one. Every rank calls every
    method (they are collective); only rank 0 writes the marker and deletes old checkpoints."""

    def __init__(self, root: str | os.PathLike[str], *, interval: int = 0, keep_last: int | None = None) -> None:
        if interval < 0:
            raise ValueError(f"interval must be >= 0, got {interval}")
        if keep_last is not None and keep_last <= 0:
            raise ValueError(f"keep_last must be positive, got {keep_last}")
        self.root = pathlib.Path(root)
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
        path = self.root / _step_dir_name(trainer.step)
        if self.latest_path() == path:
            return path
        if _rank() == 0:
            # Left over from a save that crashed before it became the latest.
            shutil.rmtree(path, ignore_errors=True)
        _barrier()
        dcp.save(_state_dict(trainer), checkpoint_id=path)
        if _rank() == 0:
            replace_atomically(self.root / LATEST_FILE, path.name + "\n")
            self._delete_old()
        _barrier()
        logger.info("saved checkpoint", extra={"step": trainer.step, "path": str(path)})
        return path

    def latest_path(self) -> pathlib.Path | None:
        """The folder `latest` names, or None when there is no checkpoint yet."""
        try:
            name = (self.root / LATEST_FILE).read_text().strip()
        except FileNotFoundError:
            return None
        if not _STEP_DIR.fullmatch(name) or not (self.root / name / ".metadata").is_file():
            raise ValueError(f"{self.root / LATEST_FILE} names {name!r}, which is not a complete checkpoint")
        return self.root / name

    def load_latest(self, trainer: Trainer) -> int | None:
        """Restore the latest checkpoint into `trainer` (in place); return its step, or None if none."""
        path = self.latest_path()
        if path is None:
            return None
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

    def _delete_old(self) -> None:
        if self.keep_last is None:
            return
        steps = sorted(p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name))
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old)


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


def _barrier() -> None:
    if _distributed():
        dist.barrier()
