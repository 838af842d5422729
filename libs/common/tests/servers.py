"""A real primerl service for the bootstrap tests: the trainer.v1 contract
served by a servicer whose methods exercise the error mapping and drain."""

from __future__ import annotations

import asyncio
import sys

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.config import ServiceConfig, TlsConfig, service_settings
from primerl_common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from primerl_common.server import ServiceDefinition, run_main


class ProbeConfig(ServiceConfig):
    """A test service."""

    service_name = "probe"
    model_config = service_settings("probe")
    slow_call_s: float = 2.0
    tls: TlsConfig = TlsConfig(mode="plaintext")  # served on loopback by the tests


class ProbeServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, definition: ServiceDefinition, slow_call_s: float) -> None:
        self.definition = definition
        self.slow_call_s = slow_call_s

    async def GetServiceInfo(self, request, context):
        return trainer_pb2.GetServiceInfoResponse(info=self.definition.info())

    async def SaveCheckpoint(self, request, context):
        # Long enough for a SIGTERM to arrive while it runs.
        await asyncio.sleep(self.slow_call_s)
        return trainer_pb2.SaveCheckpointResponse(step=7, path="/done")

    async def GetStatus(self, request, context):
        # The error to raise is picked by the caller's metadata.
        if dict(context.invocation_metadata()).get("fail") == "precondition":
            raise FailedPrecondition("policy version 3 is not newer than 5", subject="policy_version")
        raise InvalidArgument("must be finite, got nan", field="micro_batch.advantages")

    # GetBatchSpec is left to the generated base class: UNIMPLEMENTED.

    async def PushBatch(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        raise ResourceExhausted("queue full (4 batches)", retry_after_s=1.5)

    async def WatchSteps(self, request, context):
        for step in range(3):
            yield trainer_pb2.WatchStepsResponse(step=trainer_pb2.StepMetrics(step=step))
        raise RuntimeError("secret internal detail")


async def build_probe(config: ProbeConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="probe", version="9.9.9", servicers=[], capabilities=["probe.slow"])
    servicer = ProbeServicer(definition, config.slow_call_s)
    descriptor = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
    definition.servicers = [(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer, descriptor)]
    return definition


if __name__ == "__main__":
    sys.exit(run_main(ProbeConfig, build_probe, version="9.9.9"))
