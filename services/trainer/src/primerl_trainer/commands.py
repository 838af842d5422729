"""Rank 0 tells the other ranks what to do next, batches included, through torch.distributed.

Only rank 0 serves gRPC; the others run `follow` (loop.py), or `follow_runs` (run_ops.py) on a
trainer with runs: they wait for a command, then do their part of it (train a batch, save a
checkpoint, gather weights for a publish; create, load or delete a run) in the same order as
rank 0. Commands travel over a gloo group of their own on the CPU: a rank may wait
hours for the next batch, far beyond the collective timeout the training group keeps, and no
GPU stream is involved. A batch travels as a few tensors per micro-batch, never pickled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from primerl_trainer.batch import MicroBatch

__all__ = ["Command", "CommandChannel", "CommandKind"]

# Waiting for the next command is idle time, not a hang.
_IDLE_TIMEOUT = timedelta(days=365)
_HEADER_SIZE = 6
_META_SIZE = 6
_EXPERT_DTYPES = (torch.uint8, torch.uint16)


class CommandKind(enum.IntEnum):
    TRAIN = 1
    SAVE = 2
    PUBLISH = 3
    STOP = 4
    # A trainer with runs (run_ops.py): one command per collective operation on a run.
    RUN_CREATE = 5
    RUN_RESTORE = 6
    RUN_LOAD = 7
    RUN_DELETE = 8
    RUN_TRAIN = 9
    RUN_SAVE = 10
    RUN_PUBLISH = 11


@dataclass
class Command:
    kind: CommandKind
    # TRAIN: the step the batch is for; PUBLISH: the policy version.
    step: int = 0
    micro_batches: list[MicroBatch] = field(default_factory=list)
    num_loss_tokens: int = 0
    # The RUN_* commands' run, and what else they need (RUN_CREATE, RUN_RESTORE: the run's metadata as JSON).
    run_id: str = ""
    payload: bytes = b""


class CommandChannel:
    """Broadcasts commands from rank 0 (`send`) to every other rank (`receive`). Create it on
    every rank at the same point: making its group is collective."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self._group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if self.world_size > 1 else None

    def send(self, command: Command) -> None:
        assert self.rank == 0, "only rank 0 sends commands"
        if self._group is None:
            return
        run_id = command.run_id.encode()
        header = [
            int(command.kind),
            command.step,
            len(command.micro_batches),
            command.num_loss_tokens,
            len(run_id),
            len(command.payload),
        ]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        if run_id or command.payload:
            self._broadcast(torch.frombuffer(bytearray(run_id + command.payload), dtype=torch.uint8))
        for micro_batch in command.micro_batches:
            self._send_micro_batch(micro_batch)

    def receive(self) -> Command:
        assert self.rank != 0 and self._group is not None, "ranks other than 0 receive commands"
        header = self._broadcast(torch.empty(_HEADER_SIZE, dtype=torch.int64)).tolist()
        kind, step, num_micro_batches, num_loss_tokens, run_id_size, payload_size = header
        data = b""
        if run_id_size or payload_size:
            data = self._broadcast(torch.empty(run_id_size + payload_size, dtype=torch.uint8)).numpy().tobytes()
        micro_batches = [self._receive_micro_batch() for _ in range(num_micro_batches)]
        return Command(
            CommandKind(kind),
            step,
            micro_batches,
            num_loss_tokens,
            run_id=data[:run_id_size].decode(),
            payload=data[run_id_size:],
        )

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=0, group=self._group)
        return tensor

    def _send_micro_batch(self, micro_batch: MicroBatch) -> None:
        num_tokens = micro_batch.num_tokens
        rl = micro_batch.advantages is not None and micro_batch.inference_logprobs is not None
        experts = micro_batch.routed_experts
        layers, top_k = (0, 0) if experts is None else experts.shape[1:]
        dtype_code = 0 if experts is None else _EXPERT_DTYPES.index(experts.dtype)
        has_versions = micro_batch.policy_versions is not None
        self._broadcast(torch.tensor([num_tokens, rl, has_versions, layers, top_k, dtype_code], dtype=torch.int64))
        zeros = torch.zeros(num_tokens)
        ints = [micro_batch.input_ids, micro_batch.position_ids, micro_batch.loss_mask.long()]
        if has_versions:
            ints.append(micro_batch.policy_versions)
        self._broadcast(torch.stack(ints))
        floats = [micro_batch.temperatures]
        if rl:
            floats += [micro_batch.advantages, micro_batch.inference_logprobs]
        self._broadcast(torch.stack([t if t is not None else zeros for t in floats]).float())
        if experts is not None:
            # gloo broadcasts no uint16.
            self._broadcast(experts.to(torch.int32).contiguous())

    def _receive_micro_batch(self) -> MicroBatch:
        meta = self._broadcast(torch.empty(_META_SIZE, dtype=torch.int64)).tolist()
        num_tokens, rl, has_versions, layers, top_k, dtype_code = meta
        ints = self._broadcast(torch.empty(3 + has_versions, num_tokens, dtype=torch.int64))
        floats = self._broadcast(torch.empty(1 + 2 * rl, num_tokens, dtype=torch.float32))
        experts = None
        if layers:
            experts = self._broadcast(torch.empty(num_tokens, layers, top_k, dtype=torch.int32))
            experts = experts.to(_EXPERT_DTYPES[dtype_code])
        return MicroBatch(
            input_ids=ints[0].clone(),
            position_ids=ints[1].clone(),
            loss_mask=ints[2].bool(),
            temperatures=floats[0].clone(),
            advantages=floats[1].clone() if rl else None,
            inference_logprobs=floats[2].clone() if rl else None,
            routed_experts=experts,
            policy_versions=ints[3].clone() if has_versions else None,
        )
