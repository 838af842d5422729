"""The trainer as the orchestrator uses it: what batches must look like, which step it expects,
and PushBatch with retries that never feed one step twice.

A push is retried while the trainer's queue is full (RESOURCE_EXHAUSTED) or the trainer is
unreachable (UNAVAILABLE, e.g. restarting). A retry told STEP_ALREADY_QUEUED or
STEP_ALREADY_TRAINED means an earlier attempt got through: the step is done. A trainer that
expects another step (STEP_OUT_OF_ORDER: it restarted from an older checkpoint and lost its
queue, or another orchestrator fed it) raises StepMismatch with the step it expects.

On a trainer with runs (many LoRA runs on one backbone), every call names the run this
orchestrator feeds (`run_id`): its batch spec, steps and queue are that run's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details, field_violations
from primerl_common.tensors import tensor_to_proto
from primerl_orchestrator.packing import PackedBatch

__all__ = ["BatchSpec", "StepMismatch", "TrainerError", "TrainerFeed"]

logger = logging.getLogger(__name__)

# Retried: a trainer busy (RESOURCE_EXHAUSTED), away (UNAVAILABLE), slow (DEADLINE_EXCEEDED), or
# stopping: a trainer restarted (SIGTERM) cancels the calls still open when its grace ends, and
# the caller sees CANCELLED (its own cancellation raises asyncio.CancelledError instead). A batch
# pushed again after it got through is told so (STEP_ALREADY_QUEUED / _TRAINED).
_RETRIED = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)
_MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class BatchSpec:
    seq_len: int
    router_replay: bool
    num_hidden_layers: int
    num_experts_per_token: int
    vocab_size: int
    next_step: int
    # A vision-language model's image token (None: the trainer's model takes no images).
    image_token_id: int | None = None


class TrainerError(Exception):
    """The trainer refused a batch for a reason a retry cannot fix."""


class StepMismatch(Exception):
    def __init__(self, step: int, expected_step: int) -> None:
        super().__init__(f"the trainer expects the batch of step {expected_step}, not {step}")
        self.step = step
        self.expected_step = expected_step


class TrainerFeed:
    """`lora_adapter`: the adapter this run generates with, which the trainer must be the one
    training and publishing (rollouts of another policy would be trained as if they were its).
    `run_id`: the run fed on a trainer with runs (its adapter is named by it); '' for a trainer
    of one run."""

    def __init__(
        self, address: str, *, push_timeout_s: float = 300.0, lora_adapter: str = "", run_id: str = ""
    ) -> None:
        self.address = address
        self.run_id = run_id
        self._lora_adapter = lora_adapter
        self._push_timeout_s = push_timeout_s
        self._channel = make_channel(address)
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    @property
    def _trainer(self) -> str:
        """The trainer (and the run) as error messages name it."""
        return f"the trainer at {self.address}" + (f" (run {self.run_id!r})" if self.run_id else "")

    async def close(self) -> None:
        await self._channel.close()

    async def batch_spec(self) -> BatchSpec:
        """The trainer's batch spec, waiting (with backoff) until it answers, and on a trainer
        with runs until the run exists (services start in any order: the orchestrator of a run
        may be up before the run is created)."""
        backoff = 0.2
        while True:
            try:
                spec = await self._stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest(run_id=self.run_id), timeout=10)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and self.run_id:
                    logger.warning(
                        "waiting for run %r to be created on the trainer at %s (trainer.v1 CreateRun)",
                        self.run_id,
                        self.address,
                    )
                    backoff = _MAX_BACKOFF_S
                elif exc.code() not in _RETRIED:
                    self._raise_for_runs(exc)
                    raise
                else:
                    logger.info("waiting for %s (%s)", self._trainer, exc.code().name)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
        if spec.mode == trainer_pb2.TRAINING_MODE_SFT:
            raise TrainerError(f"{self._trainer} trains on an SFT dataset and takes no batches")
        if spec.lora_adapter != self._lora_adapter:
            trains = f"LoRA adapter {spec.lora_adapter!r}" if spec.lora_adapter else "whole weights"
            generates = f"LoRA adapter {self._lora_adapter!r}" if self._lora_adapter else "the base model"
            if self.run_id:
                raise TrainerError(
                    f"{self._trainer} trains and publishes {trains}, and rollouts are generated with "
                    f"{generates}: a run's rollouts must be generated with its adapter, named by its run id"
                )
            raise TrainerError(
                f"{self._trainer} trains and publishes {trains}, and model.lora_adapter says "
                f"rollouts are generated with {generates}: set model.lora_adapter to the trainer's "
                "publish.adapter_name (publish.kind 'adapter'), or leave both unset"
            )
        return BatchSpec(
            seq_len=spec.seq_len,
            router_replay=spec.router_replay,
            # Trainers that predate num_hidden_layers have MoE layers only.
            num_hidden_layers=spec.num_hidden_layers or spec.num_moe_layers,
            num_experts_per_token=spec.num_experts_per_token,
            vocab_size=spec.vocab_size,
            next_step=spec.next_step,
            image_token_id=spec.image_token_id if spec.HasField("image_token_id") else None,
        )

    async def completed_step(self) -> int:
        """Optimizer steps the trainer has completed: the latest policy version it made."""
        try:
            status = await self._stub.GetStatus(trainer_pb2.GetStatusRequest(run_id=self.run_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            self._raise_for_runs(exc)
            raise
        return status.step

    def _raise_for_runs(self, exc: grpc.aio.AioRpcError) -> None:
        """TrainerError when `exc` says the trainer and peers.run_id disagree about runs: a retry
        would fail the same way."""
        code, reason, _, _ = _failure(exc)
        if code == grpc.StatusCode.FAILED_PRECONDITION and reason == "RUNS_DISABLED":
            raise TrainerError(
                f"the trainer at {self.address} trains one run and takes no run id: unset peers.run_id "
                f"(now {self.run_id!r})"
            ) from None
        if code == grpc.StatusCode.INVALID_ARGUMENT and not self.run_id and "run_id" in field_violations(exc):
            raise TrainerError(
                f"the trainer at {self.address} trains many runs: set peers.run_id to the run this orchestrator "
                f"feeds ({exc.details()})"
            ) from None
        if code == grpc.StatusCode.NOT_FOUND and self.run_id:
            raise TrainerError(f"{self._trainer}: {exc.details()} (deleted?)") from None

    async def push(self, step: int, batch: PackedBatch) -> None:
        """Queues `batch` as the trainer's step `step`; returns once the trainer holds it."""
        requests = _push_requests(step, batch, run_id=self.run_id)
        backoff = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._stub.PushBatch(iter(requests), timeout=self._push_timeout_s)
                logger.info(
                    "pushed the batch of step %d (%d queued at the trainer)",
                    step,
                    response.num_queued_batches,
                    extra={"step": step, "num_micro_batches": len(batch.micro_batches)},
                )
                return
            except grpc.aio.AioRpcError as exc:
                code, reason, metadata, retry_after_s = _failure(exc)
                if code == grpc.StatusCode.FAILED_PRECONDITION and reason in (
                    "STEP_ALREADY_QUEUED",
                    "STEP_ALREADY_TRAINED",
                ):
                    if attempt == 1:
                        raise StepMismatch(step, int(metadata.get("next_step", step + 1))) from None
                    logger.info("the batch of step %d got through on an earlier attempt", step)
                    return
                if code == grpc.StatusCode.FAILED_PRECONDITION and reason == "STEP_OUT_OF_ORDER":
                    raise StepMismatch(step, int(metadata["next_step"])) from None
                # LIMIT_EXCEEDED: the batch is past one of the trainer's batch_limits; it would be again.
                if code not in _RETRIED or reason == "LIMIT_EXCEEDED":
                    self._raise_for_runs(exc)
                    raise TrainerError(
                        f"{self._trainer} refused the batch of step {step}: {code.name}: {exc.details()}"
                    ) from None
                delay = retry_after_s if retry_after_s is not None else backoff
                logger.info("trainer busy or away (%s); pushing step %d again in %.1fs", code.name, step, delay)
            await asyncio.sleep(delay)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)


def _push_requests(step: int, batch: PackedBatch, *, run_id: str = "") -> list[trainer_pb2.PushBatchRequest]:
    begin = trainer_pb2.BatchBegin(
        run_id=run_id,
        step=step,
        num_micro_batches=len(batch.micro_batches),
        num_samples=batch.num_samples,
        num_loss_tokens=batch.num_loss_tokens,
        min_policy_version=batch.min_policy_version,
        max_policy_version=batch.max_policy_version,
    )
    requests = [trainer_pb2.PushBatchRequest(begin=begin)]
    for micro_batch in batch.micro_batches:
        message = trainer_pb2.MicroBatch(
            **{name: tensor_to_proto(tensor, name=name) for name, tensor in micro_batch.named_tensors().items()}
        )
        requests.append(trainer_pb2.PushBatchRequest(micro_batch=message))
    return requests


def _failure(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str, dict[str, str], float | None]:
    reason, metadata, retry_after_s = "", {}, None
    for detail in error_details(exc):
        if isinstance(detail, error_details_pb2.ErrorInfo):
            reason, metadata = detail.reason, dict(detail.metadata)
        elif isinstance(detail, error_details_pb2.RetryInfo):
            retry_after_s = detail.retry_delay.ToTimedelta().total_seconds()
    return exc.code(), reason, metadata, retry_after_s
