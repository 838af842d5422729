"""primerl.trainer.v1.TrainerService: proto <-> domain translation only."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
from google.protobuf import timestamp_pb2

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common import security
from primerl_common.errors import FailedPrecondition, InvalidArgument, ServiceError
from primerl_common.server import ServiceDefinition
from primerl_trainer import metrics as prometheus
from primerl_trainer.batch import micro_batch_from_proto
from primerl_trainer.loop import StepRecord
from primerl_trainer.run_service import RunFeed, RunService
from primerl_trainer.run_settings import RunSettings, RunView
from primerl_trainer.service import BatchHeader, IncomingBatch, TrainingService

__all__ = ["TrainerServicer"]

_MODES = {"rl": trainer_pb2.TRAINING_MODE_RL, "sft": trainer_pb2.TRAINING_MODE_SFT}
_MODE_NAMES = {value: name for name, value in _MODES.items()} | {trainer_pb2.TRAINING_MODE_UNSPECIFIED: "rl"}
_RUN_STATES = {
    "active": trainer_pb2.RUN_STATE_ACTIVE,
    "paused": trainer_pb2.RUN_STATE_PAUSED,
    "failed": trainer_pb2.RUN_STATE_FAILED,
}


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """`service`: a TrainingService (one run), or a RunService (runs.max_concurrent_runs > 0),
    whose batch RPCs go to the run their run_id names, for its owner or an operator."""

    def __init__(self, definition: ServiceDefinition, service: TrainingService | RunService) -> None:
        self._definition = definition
        self._service = service

    def _feed(self, run_id: str, context: grpc.aio.ServicerContext) -> TrainingService | RunFeed:
        if isinstance(self._service, RunService):
            return self._service.feed(run_id, security.caller_of(context))
        if run_id:
            raise FailedPrecondition(
                f"this trainer trains one run (runs.max_concurrent_runs = 0): leave run_id empty, not {run_id!r}",
                reason="RUNS_DISABLED",
                subject="run_id",
            )
        return self._service

    def _runs(self) -> RunService:
        if not isinstance(self._service, RunService):
            raise FailedPrecondition(
                "this trainer trains one run: set runs.max_concurrent_runs > 0 for the run API",
                reason="RUNS_DISABLED",
                subject="runs.max_concurrent_runs",
            )
        return self._service

    async def GetServiceInfo(
        self, request: trainer_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetServiceInfoResponse:
        return trainer_pb2.GetServiceInfoResponse(info=self._definition.info())

    async def GetBatchSpec(
        self, request: trainer_pb2.GetBatchSpecRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetBatchSpecResponse:
        feed = self._feed(request.run_id, context)
        spec = feed.spec
        info = feed.queue_info()
        return trainer_pb2.GetBatchSpecResponse(
            seq_len=spec.seq_len,
            router_replay=spec.router_replay,
            num_moe_layers=spec.num_moe_layers,
            num_experts_per_token=spec.num_experts_per_token,
            num_experts=spec.num_experts,
            vocab_size=spec.vocab_size,
            max_queued_batches=info.max_queued_batches,
            next_step=info.next_step,
            num_hidden_layers=spec.num_hidden_layers or 0,
            mode=_MODES[info.mode],
            image_token_id=spec.image_token_id,
            patches_per_image_token=spec.patches_per_image_token,
            lora_adapter=spec.lora_adapter,
        )

    async def PushBatch(
        self, request_iterator: AsyncIterator[trainer_pb2.PushBatchRequest], context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushBatchResponse:
        try:
            return await self._push_batch(request_iterator, context)
        except ServiceError as exc:
            prometheus.observe_refused_batch(exc.code.name)
            raise

    async def _push_batch(
        self, request_iterator: AsyncIterator[trainer_pb2.PushBatchRequest], context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PushBatchResponse:
        service: TrainingService | RunFeed | None = None
        batch: IncomingBatch | None = None
        async for request in request_iterator:
            item = request.WhichOneof("item")
            if item == "begin":
                if batch is not None:
                    raise InvalidArgument("a second begin in one PushBatch stream", field="begin")
                begin = request.begin
                service = self._feed(begin.run_id, context)
                batch = service.begin_batch(
                    BatchHeader(
                        step=begin.step,
                        num_micro_batches=begin.num_micro_batches,
                        num_samples=begin.num_samples,
                        num_loss_tokens=begin.num_loss_tokens,
                        min_policy_version=begin.min_policy_version,
                        max_policy_version=begin.max_policy_version,
                    )
                )
            elif item == "micro_batch":
                if batch is None or service is None:
                    raise InvalidArgument("the stream must start with begin", field="begin")
                input_ids = request.micro_batch.input_ids.header
                batch.account(num_tokens=math.prod(input_ids.shape), num_bytes=request.ByteSize())
                batch.add(
                    micro_batch_from_proto(request.micro_batch, service.spec, mode=service.mode, index=batch.next_index)
                )
            else:
                raise InvalidArgument("an empty PushBatchRequest (neither begin nor micro_batch)", field="item")
        if batch is None or service is None:
            raise InvalidArgument("the stream ended without begin", field="begin")
        step, num_queued = service.commit_batch(batch)
        return trainer_pb2.PushBatchResponse(
            step=step, num_micro_batches=len(batch.micro_batches), num_queued_batches=num_queued
        )

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetStatusResponse:
        if isinstance(self._service, RunService) and not request.run_id:
            status = self._service.status()
        else:
            status = self._feed(request.run_id, context).status()
        response = trainer_pb2.GetStatusResponse(
            mode=_MODES[status.mode],
            step=status.step,
            published_policy_version=status.published_policy_version,
            num_queued_batches=status.num_queued_batches,
            training=status.training,
            last_checkpoint_step=status.last_checkpoint_step,
            last_publish_error=status.last_publish_error,
        )
        if status.last_step is not None:
            response.last_step.CopyFrom(_step_metrics(status.last_step))
        return response

    async def WatchSteps(
        self, request: trainer_pb2.WatchStepsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.WatchStepsResponse]:
        async for record in self._feed(request.run_id, context).watch_steps(request.after_step):
            yield trainer_pb2.WatchStepsResponse(step=_step_metrics(record))

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        step, path = await self._feed(request.run_id, context).save_checkpoint()
        return trainer_pb2.SaveCheckpointResponse(step=step, path=path)

    # Runs.

    async def CreateRun(
        self, request: trainer_pb2.CreateRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.CreateRunResponse:
        spec = request.spec
        if spec.mode not in _MODE_NAMES:
            raise InvalidArgument(f"unknown training mode {spec.mode}", field="spec.mode")
        settings = RunSettings(
            lora_rank=spec.lora_rank,
            lora_alpha=spec.lora_alpha,
            seed=spec.seed,
            mode=_MODE_NAMES[spec.mode],  # type: ignore[arg-type]
            **{
                name: getattr(spec, name)
                for name in ("learning_rate", "weight_decay", "max_grad_norm", "warmup_steps")
                if spec.HasField(name)
            },
        )
        view = await self._runs().create_run(request.run_id, settings, security.caller_of(context), owner=request.owner)
        return trainer_pb2.CreateRunResponse(run=_run_proto(view))

    async def GetRun(
        self, request: trainer_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetRunResponse:
        return trainer_pb2.GetRunResponse(
            run=_run_proto(self._runs().get_run(request.run_id, security.caller_of(context)))
        )

    async def ListRuns(
        self, request: trainer_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ListRunsResponse:
        views = self._runs().list_runs(security.caller_of(context))
        return trainer_pb2.ListRunsResponse(runs=[_run_proto(view) for view in views])

    async def PauseRun(
        self, request: trainer_pb2.PauseRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.PauseRunResponse:
        view = self._runs().pause_run(request.run_id, security.caller_of(context))
        return trainer_pb2.PauseRunResponse(run=_run_proto(view))

    async def ResumeRun(
        self, request: trainer_pb2.ResumeRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ResumeRunResponse:
        view = await self._runs().resume_run(request.run_id, security.caller_of(context))
        return trainer_pb2.ResumeRunResponse(run=_run_proto(view))

    async def DeleteRun(
        self, request: trainer_pb2.DeleteRunRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.DeleteRunResponse:
        await self._runs().delete_run(request.run_id, security.caller_of(context))
        return trainer_pb2.DeleteRunResponse()


def _run_proto(view: RunView) -> trainer_pb2.Run:
    settings = view.settings
    spec = trainer_pb2.RunSpec(
        lora_rank=settings.lora_rank, lora_alpha=settings.alpha, seed=settings.seed, mode=_MODES[settings.mode]
    )
    for name in ("learning_rate", "weight_decay", "max_grad_norm", "warmup_steps"):
        if (value := getattr(settings, name)) is not None:
            setattr(spec, name, value)
    created_at = timestamp_pb2.Timestamp()
    created_at.FromNanoseconds(int(view.created_at * 1e9))
    return trainer_pb2.Run(
        run_id=view.run_id,
        owner=view.owner,
        spec=spec,
        state=_RUN_STATES[view.state],
        step=view.step,
        next_step=view.next_step,
        num_queued_batches=view.num_queued_batches,
        published_policy_version=view.published_version,
        last_checkpoint_step=view.last_checkpoint_step,
        error=view.error,
        created_at=created_at,
    )


def _step_metrics(record: StepRecord) -> trainer_pb2.StepMetrics:
    finished_at = timestamp_pb2.Timestamp()
    finished_at.FromNanoseconds(int(record.finished_at * 1e9))
    return trainer_pb2.StepMetrics(
        step=record.step, metrics=record.metrics, finished_at=finished_at, policy_version=record.policy_version
    )
