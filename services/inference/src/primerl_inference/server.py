"""Builds the inference's ServiceDefinition from its config."""

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.server import ServiceDefinition
from primerl_inference import __version__
from primerl_inference.config import InferenceConfig
from primerl_inference.servicer import InferenceServicer


async def build(config: InferenceConfig) -> ServiceDefinition:
    definition = ServiceDefinition(name="inference", version=__version__, servicers=[])
    servicer = InferenceServicer(definition)
    descriptor = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    definition.servicers = [(inference_pb2_grpc.add_InferenceServiceServicer_to_server, servicer, descriptor)]
    return definition
