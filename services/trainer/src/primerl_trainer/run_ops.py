"""The runs' operations that touch the model, on every rank of a trainer with runs.

Under FSDP2 every operation on a `RunSet` or its `RunCheckpoints` is collective: every rank makes
the same calls with the same arguments in the same order. `RunOps` is each rank's RunSet and
RunCheckpoints with those operations, one method each. On rank 0 (RunService's worker thread) a
method first tells the other ranks (commands.py, one RUN_* command) and then does its part; the
other ranks run `follow_runs`, which does the same method for each command received until STOP.
Whatever rank 0 decides (which run steps, when it checkpoints or publishes, which runs it
restores from the checkpoint folder) travels in the commands: the other ranks decide nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl_common.errors import InvalidArgument
from primerl_trainer.batch import MicroBatch
from primerl_trainer.commands import Command, CommandKind
from primerl_trainer.loop import QueuedBatch
from primerl_trainer.models import read_hf_config
from primerl_trainer.run_checkpoint import RunCheckpoints
from primerl_trainer.run_publish import run_publish_requests
from primerl_trainer.run_settings import RunSettings, run_config
from primerl_trainer.runs import RunConfig, RunSet
from primerl_trainer.runtime import TrainingRuntime

__all__ = ["RunOps", "follow_runs"]

logger = logging.getLogger(__name__)


class RunOps:
    """One rank's RunSet and RunCheckpoints (None without checkpoint.dir) and the collective
    operations on them; on rank 0 each tells the other ranks first."""

    def __init__(self, runtime: TrainingRuntime) -> None:
        config = runtime.config
        self.runtime = runtime
        self.run_set = RunSet(runtime.trainer.model, spec=runtime.spec, device=runtime.device, trainer=runtime.trainer)
        self.checkpoints = None
        if config.checkpoint.dir is not None:
            self.checkpoints = RunCheckpoints(f"{config.checkpoint.dir}/runs", keep_last=config.checkpoint.keep_last)
        # The broadcaster's kernel layout depends on the family.
        self._model_type = str(read_hf_config(config.model.path).get("model_type", ""))

    def create(self, run_id: str, meta: dict[str, Any]) -> None:
        """A new run (`meta`: its owner, creation time and RunSettings), its metadata saved."""
        self._tell(CommandKind.RUN_CREATE, run_id, payload=_encode(meta))
        self.run_set.add_run(run_id, self._config(run_id, meta))
        if self.checkpoints is not None:
            self.checkpoints.save_meta(run_id, meta)

    def restore(self, run_id: str, meta: dict[str, Any]) -> int | None:
        """A run of the checkpoint folder (`meta`: its saved metadata) at its latest checkpoint;
        that checkpoint's step, or None without one."""
        assert self.checkpoints is not None
        self._tell(CommandKind.RUN_RESTORE, run_id, payload=_encode(meta))
        self.run_set.add_run(run_id, self._config(run_id, meta))
        return self.checkpoints.load_latest(run_id, self.run_set)

    def load(self, run_id: str) -> int | None:
        """The run back at its latest checkpoint; its step, or None without one."""
        assert self.checkpoints is not None
        self._tell(CommandKind.RUN_LOAD, run_id)
        return self.checkpoints.load_latest(run_id, self.run_set)

    def delete(self, run_id: str) -> None:
        """The run gone, with its checkpoints."""
        self._tell(CommandKind.RUN_DELETE, run_id)
        self.run_set.remove_run(run_id)
        if self.checkpoints is not None:
            self.checkpoints.delete(run_id)

    def train(self, run_id: str, batch: QueuedBatch) -> dict[str, float]:
        """One step of the run on the batch (its step, `batch.step`); its metrics."""
        self._tell(CommandKind.RUN_TRAIN, run_id, batch.step, batch.micro_batches, batch.num_loss_tokens)
        return self.run_set.train_step(run_id, batch.micro_batches, num_loss_tokens=batch.num_loss_tokens)

    def save(self, run_id: str) -> str:
        """A checkpoint of the run at its step; its folder."""
        assert self.checkpoints is not None
        self._tell(CommandKind.RUN_SAVE, run_id)
        return str(self.checkpoints.save(run_id, self.run_set.state_dict(run_id)))

    def publish_requests(self, run_id: str, *, owner: str) -> Iterator[wb_pb2.PublishWeightsRequest] | None:
        """The run's adapter gathered whole on every rank (collective, in this call); on rank 0 the
        PublishWeights stream of it (`run_publish.run_publish_requests`), elsewhere None."""
        runtime = self.runtime
        self._tell(CommandKind.RUN_PUBLISH, run_id)
        if runtime.rank != 0:
            self.run_set.adapter_tensors(run_id)
            return None
        return run_publish_requests(
            self.run_set,
            run_id,
            dtype=runtime.publish_dtype,
            model_type=self._model_type,
            chunk_bytes=runtime.config.publish.chunk_bytes,
            owner=owner,
        )

    def stop(self) -> None:
        """Rank 0: the other ranks stop following."""
        self._tell(CommandKind.STOP, "")

    def _tell(
        self,
        kind: CommandKind,
        run_id: str,
        step: int = 0,
        micro_batches: Sequence[MicroBatch] = (),
        num_loss_tokens: int = 0,
        *,
        payload: bytes = b"",
    ) -> None:
        if self.runtime.rank == 0:
            command = Command(kind, step, list(micro_batches), num_loss_tokens, run_id=run_id, payload=payload)
            self.runtime.channel.send(command)

    def _config(self, run_id: str, meta: dict[str, Any]) -> RunConfig:
        """The run's RunConfig from its metadata (refused only for a restored run: a new one's
        settings were checked, quota included, when it was asked for)."""
        try:
            # Not the owner's quota: a new run's was checked when it was asked for, and a restored
            # run's may have been lowered since it was created.
            return run_config(RunSettings(**meta["settings"]), self.runtime.config, meta["owner"], quota=False)
        except InvalidArgument as exc:
            raise ValueError(
                f"run {run_id} (checkpoint.dir/runs) cannot be restored: {exc.message}; restore the trainer's "
                "settings it was created with (lora.rank), or remove its folder"
            ) from None


def follow_runs(runtime: TrainingRuntime) -> None:
    """Ranks other than 0 of a trainer with runs: do each operation rank 0 sends until it says stop.
    An operation that fails here fails on rank 0 too (same calls, same data), which reports it:
    it is logged, and the next one is awaited."""
    ops = RunOps(runtime)
    while True:
        command = runtime.channel.receive()
        if command.kind == CommandKind.STOP:
            return
        operation = _OPERATIONS.get(command.kind)
        if operation is None:
            raise ValueError(f"a trainer with runs got a {command.kind.name} command")
        try:
            operation(ops, command)
        except Exception:
            logger.exception("%s of run %s failed (as on rank 0)", command.kind.name, command.run_id)


_OPERATIONS: dict[CommandKind, Callable[[RunOps, Command], object]] = {
    CommandKind.RUN_CREATE: lambda ops, command: ops.create(command.run_id, json.loads(command.payload)),
    CommandKind.RUN_RESTORE: lambda ops, command: ops.restore(command.run_id, json.loads(command.payload)),
    CommandKind.RUN_LOAD: lambda ops, command: ops.load(command.run_id),
    CommandKind.RUN_DELETE: lambda ops, command: ops.delete(command.run_id),
    CommandKind.RUN_TRAIN: lambda ops, command: ops.train(
        command.run_id, QueuedBatch(command.step, command.micro_batches, command.num_loss_tokens)
    ),
    CommandKind.RUN_SAVE: lambda ops, command: ops.save(command.run_id),
    CommandKind.RUN_PUBLISH: lambda ops, command: ops.publish_requests(command.run_id, owner=""),
}


def _encode(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True).encode()
