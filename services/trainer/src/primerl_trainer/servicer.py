"""primerl.trainer.v1.TrainerService: proto <-> domain translation only."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
from google.protobuf import timestamp_pb2

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.errors import InvalidArgument, ServiceError
from primerl_common.server import ServiceDefinition
from primerl_trainer import metrics as prometheus
from primerl_trainer.batch import micro_batch_from_proto
from primerl_trainer.loop import StepRecord
from primerl_trainer.service import BatchHeader, IncomingBatch, TrainingService

__all__ = ["TrainerServicer"]

_MODES = {"rl": trainer_pb2.TRAINING_MODE_RL, "sft": trainer_pb2.TRAINING_MODE_SFT}


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, definition: ServiceDefinition, service: TrainingService) -> None:
        self._definition = definition
        self._service = service

    async def GetServiceInfo(
        self, request: trainer_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetServiceInfoResponse:
        return trainer_pb2.GetServiceInfoResponse(info=self._definition.info())

    async def GetBatchSpec(
        self, request: trainer_pb2.GetBatchSpecRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetBatchSpecResponse:
        spec = self._service.spec
        info = self._service.queue_info()
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
            return await self._push_batch(request_iterator)
        except ServiceError as exc:
            prometheus.observe_refused_batch(exc.code.name)
            raise

    async def _push_batch(
        self, request_iterator: AsyncIterator[trainer_pb2.PushBatchRequest]
    ) -> trainer_pb2.PushBatchResponse:
        service = self._service
        batch: IncomingBatch | None = None
        async for request in request_iterator:
            item = request.WhichOneof("item")
            if item == "begin":
                if batch is not None:
                    raise InvalidArgument("a second begin in one PushBatch stream", field="begin")
                begin = request.begin
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
                if batch is None:
                    raise InvalidArgument("the stream must start with begin", field="begin")
                input_ids = request.micro_batch.input_ids.header
                batch.account(num_tokens=math.prod(input_ids.shape), num_bytes=request.ByteSize())
                batch.add(
                    micro_batch_from_proto(request.micro_batch, service.spec, mode=service.mode, index=batch.next_index)
                )
            else:
                raise InvalidArgument("an empty PushBatchRequest (neither begin nor micro_batch)", field="item")
        if batch is None:
            raise InvalidArgument("the stream ended without begin", field="begin")
        step, num_queued = service.commit_batch(batch)
        return trainer_pb2.PushBatchResponse(
            step=step, num_micro_batches=len(batch.micro_batches), num_queued_batches=num_queued
        )

    async def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetStatusResponse:
        status = self._service.status()
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
        async for record in self._service.watch_steps(request.after_step):
            yield trainer_pb2.WatchStepsResponse(step=_step_metrics(record))

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        step, path = await self._service.save_checkpoint()
        return trainer_pb2.SaveCheckpointResponse(step=step, path=path)


def _step_metrics(record: StepRecord) -> trainer_pb2.StepMetrics:
    finished_at = timestamp_pb2.Timestamp()
    finished_at.FromNanoseconds(int(record.finished_at * 1e9))
    return trainer_pb2.StepMetrics(
        step=record.step, metrics=record.metrics, finished_at=finished_at, policy_version=record.policy_version
    )
