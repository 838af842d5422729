"""Builds the trainer's ServiceDefinition from its config."""

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_trainer import __version__
from primerl_trainer.config import TrainerConfig
from primerl_trainer.servicer import TrainerServicer


async def build(config: TrainerConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="trainer", version=__version__, servicers=[])
    servicer = TrainerServicer(definition)
    descriptor = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
    definition.servicers = [(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer, descriptor)]
    return definition
