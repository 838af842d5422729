"""Pushes under mutual TLS to a replica serving a sealed port go as sealed streams (its keys
handed out over mTLS, the bytes on the sealed port) and arrive whole; a replica without one is
pushed over mTLS. The broadcaster in process with its own certificate;
replicas as stand-ins served by primerl's GrpcService, as the inference service serves them."""

from __future__ import annotations

import pathlib

import pytest
import torch

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common import security
from primerl_common.config import ServiceConfig, service_settings
from primerl_common.security import _credentials
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.security.sealed import SEALED_SESSION_METADATA
from primerl_common.server import ServiceDefinition
from primerl_common.testing import in_process_service
from primerl_weight_broadcaster.config import WeightBroadcasterConfig
from primerl_weight_broadcaster.server import build
from primerl_weight_broadcaster.wire import UPDATE_WEIGHTS_METHOD

from .helpers import FAST_PUSH, publish, wait_for
from .test_spill import StandInReplica

DESCRIPTOR = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
TENSORS = {f"layer.{i}.weight": torch.full((64, 64), float(i)) for i in range(6)}


class ReplicaConfig(ServiceConfig):
    """A stand-in replica's config."""

    service_name = "replica"
    model_config = service_settings("replica")


class RecordingReplica(StandInReplica):
    """Records, per UpdateWeights call, whether it came as a sealed stream and from whom."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, str]] = []

    async def UpdateWeights(self, request_iterator, context):
        sealed = SEALED_SESSION_METADATA in dict(context.invocation_metadata())
        self.calls.append((sealed, security.caller_of(context).name))
        return await super().UpdateWeights(request_iterator, context)


@pytest.fixture
def certs(tmp_path: pathlib.Path, monkeypatch) -> pathlib.Path:
    authority = make_authority(tmp_path)
    for text in ("weight_broadcaster", "inference-0", "trainer"):
        make_certificate(authority, tmp_path, Holder.parse(text))
    # The broadcaster's channels to replicas show its certificate (a service process's identity).
    monkeypatch.setattr(_credentials, "_process", None)
    security.setup_process_tls(tls_of(tmp_path, "weight_broadcaster"), export=False)
    return tmp_path


def replica_definition(replica: RecordingReplica, *, sealed: bool) -> ServiceDefinition:
    return ServiceDefinition(
        name="inference",
        version="0",
        servicers=[(inference_pb2_grpc.add_InferenceServiceServicer_to_server, replica, DESCRIPTOR)],
        permissions={f"/{DESCRIPTOR.full_name}/{m.name}": security.ANY for m in DESCRIPTOR.methods},
        sealed_methods=[UPDATE_WEIGHTS_METHOD] if sealed else [],
    )


@pytest.mark.parametrize("sealed_port", [True, False])
async def test_pushes_go_as_sealed_streams_where_the_replica_serves_a_sealed_port(certs, sealed_port):
    replica = RecordingReplica()
    replica_config = ReplicaConfig(
        server={"host": "127.0.0.1", "port": 0, "sealed_port": 0 if sealed_port else None},
        tls=tls_of(certs, "inference-0"),
    )
    definition = replica_definition(replica, sealed=sealed_port)
    async with in_process_service(definition, replica_config, client_tls=tls_of(certs, "trainer")) as served:
        config = WeightBroadcasterConfig(
            server={"host": "127.0.0.1", "port": 0},
            tls=tls_of(certs, "weight_broadcaster"),
            push=FAST_PUSH,
            replicas=[{"replica_id": "r", "address": served.address}],
        )
        async with in_process_service(await build(config), config, client_tls=tls_of(certs, "trainer")) as broadcaster:
            stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(broadcaster.channel)
            await publish(stub, 1, TENSORS)
            await wait_for(stub, 1, 1)
    assert replica.policy_version == 1
    assert all(torch.equal(replica.tensors[name], t) for name, t in TENSORS.items()) and len(replica.tensors) == 6
    assert replica.calls == [(sealed_port, "weight_broadcaster")]
