"""Mutual TLS, identities and permissions on a real in-process server (the trainer.v1 contract
served by a servicer that records who reached it): each kind of intruder is refused with the
right status before the handler runs, and what is allowed works end to end."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import subprocess
import sys

import grpc
import pytest

from primerl.common.v1 import service_info_pb2
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common import security
from primerl_common.client import make_channel
from primerl_common.config import ConfigError, TlsConfig
from primerl_common.errors import error_details
from primerl_common.security import _credentials
from primerl_common.security.certificates import Holder, make_authority, make_certificate, make_token, tls_of
from primerl_common.server import GrpcService, ServiceDefinition
from primerl_common.testing import in_process_service

from .servers import ProbeConfig

HERE = pathlib.Path(__file__).parent
SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
PUSH = "/primerl.trainer.v1.TrainerService/PushBatch"
ROLES = {
    "PushBatch": {"orchestrator"},
    "SaveCheckpoint": {"operator"},
    "GetBatchSpec": {"environment"},
    "GetStatus": security.ANY,
    "WatchSteps": {"tenant", "operator"},
    **{name: {"operator"} for name in ("CreateRun", "GetRun", "ListRuns", "PauseRun", "ResumeRun", "DeleteRun")},
}


class Recorder(trainer_pb2_grpc.TrainerServiceServicer):
    """Records each call that reaches it, with its caller."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, security.Caller]] = []

    async def GetServiceInfo(self, request, context):
        return trainer_pb2.GetServiceInfoResponse(info=service_info_pb2.ServiceInfo(service_name="probe"))

    async def GetBatchSpec(self, request, context):
        self.calls.append(("GetBatchSpec", security.caller_of(context)))
        return trainer_pb2.GetBatchSpecResponse()

    async def GetStatus(self, request, context):
        self.calls.append(("GetStatus", security.caller_of(context)))
        return trainer_pb2.GetStatusResponse()

    async def SaveCheckpoint(self, request, context):
        self.calls.append(("SaveCheckpoint", security.caller_of(context)))
        return trainer_pb2.SaveCheckpointResponse(step=1)

    async def PushBatch(self, request_iterator, context):
        async for _ in request_iterator:
            self.calls.append(("PushBatch message", security.caller_of(context)))
        return trainer_pb2.PushBatchResponse()

    async def WatchSteps(self, request, context):
        self.calls.append(("WatchSteps", security.caller_of(context)))
        yield trainer_pb2.WatchStepsResponse(step=trainer_pb2.StepMetrics(step=1))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("certs")
    authority = make_authority(directory)
    for text in ("probe:trainer", "orchestrator", "operator", "gateway", "intruder:trainer"):
        make_certificate(authority, directory, Holder.parse(text))
    make_certificate(authority, directory, Holder("anonymous", ()))  # our CA, but no primerl identity
    other = directory / "other"
    make_certificate(make_authority(other, name="another CA"), other, Holder.parse("operator"))
    (directory / "env-a.token").write_text(make_token(directory, "env-a:environment@gateway"))
    (directory / "tenant.token").write_text(make_token(directory, "tenant-1:tenant"))
    return directory


def definition(recorder: Recorder) -> ServiceDefinition:
    return ServiceDefinition(
        name="probe",
        version="9.9.9",
        servicers=[(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, recorder, SERVICE)],
        permissions=security.method_roles(SERVICE, ROLES),
    )


def mtls_config(certs: pathlib.Path, **server) -> ProbeConfig:
    tls = tls_of(certs, "probe", tokens_file=certs / "tokens.toml")
    return ProbeConfig(server={"host": "127.0.0.1", "port": 0, **server}, tls=tls)


@pytest.fixture
async def served(certs):
    recorder = Recorder()
    async with in_process_service(definition(recorder), mtls_config(certs), client_tls=tls_of(certs, "operator")) as it:
        yield it, recorder


def stub_as(address: str, tls: TlsConfig) -> tuple[grpc.aio.Channel, trainer_pb2_grpc.TrainerServiceStub]:
    channel = make_channel(address, tls=tls, max_attempts=1)
    return channel, trainer_pb2_grpc.TrainerServiceStub(channel)


def bearer(certs: pathlib.Path, name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {(certs / name).read_text().strip()}")]


async def push(stub: trainer_pb2_grpc.TrainerServiceStub, **kwargs) -> None:
    async def messages():
        # After the server had time to refuse the call from its metadata: a message written
        # after the refusal arrived is not sent, but one written while it is on its way fails,
        # and grpc.aio then reports the call INTERNAL ("Failed execute_batch"), not the refusal.
        await asyncio.sleep(0.2)
        for step in range(3):
            yield trainer_pb2.PushBatchRequest(begin=trainer_pb2.BatchBegin(step=step))

    await stub.PushBatch(messages(), timeout=5, **kwargs)


async def test_mtls_end_to_end_with_the_callers_identity(served, certs):
    service, recorder = served
    operator = trainer_pb2_grpc.TrainerServiceStub(service.channel)
    assert (await operator.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())).step == 1
    info = (await operator.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())).info
    assert info.service_name == "probe"
    channel, orchestrator = stub_as(service.address, tls_of(certs, "orchestrator"))
    async with channel:
        await push(orchestrator)
        await orchestrator.GetStatus(trainer_pb2.GetStatusRequest())  # ANY: every authenticated caller
    assert [(name, caller.name, caller.roles) for name, caller in recorder.calls] == [
        ("SaveCheckpoint", "operator", frozenset({"operator"})),
        *[("PushBatch message", "orchestrator", frozenset({"orchestrator"}))] * 3,
        ("GetStatus", "orchestrator", frozenset({"orchestrator"})),
    ]


@pytest.mark.parametrize("who", ["no certificate", "another CA"])
async def test_a_peer_without_a_certificate_of_the_ca_never_gets_a_connection(served, certs, who):
    service, recorder = served
    ca = (certs / "ca.pem").read_bytes()
    if who == "no certificate":
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    else:
        other = certs / "other"
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(other / "operator-key.pem").read_bytes(),
            certificate_chain=(other / "operator.pem").read_bytes(),
        )
    async with grpc.aio.secure_channel(service.address, credentials) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails
        with pytest.raises(grpc.aio.AioRpcError):
            await push(stub)
    # A plaintext client does not get through either.
    async with grpc.aio.insecure_channel(service.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert recorder.calls == []


async def test_a_valid_certificate_with_the_wrong_role_is_refused_naming_the_role(served, certs, caplog):
    service, recorder = served
    channel, intruder = stub_as(service.address, tls_of(certs, "intruder"))
    async with channel:
        with (
            caplog.at_level(logging.WARNING, logger="primerl_common.security._permissions"),
            pytest.raises(grpc.aio.AioRpcError) as refused,
        ):
            await push(intruder)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "orchestrator" in refused.value.details() and PUSH in refused.value.details()
    (info,) = error_details(refused.value)
    assert info.reason == "MISSING_ROLE" and info.metadata["caller"] == "intruder"
    assert recorder.calls == []  # not one message of the stream was read
    assert any("intruder" in r.getMessage() and PUSH in r.getMessage() for r in caplog.records)


async def test_a_certificate_without_a_primerl_identity_is_unauthenticated(served, certs):
    service, recorder = served
    channel, anonymous = stub_as(service.address, tls_of(certs, "anonymous"))
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anonymous.GetStatus(trainer_pb2.GetStatusRequest())
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert recorder.calls == []


async def test_bearer_tokens_missing_wrong_replayed_and_valid(served, certs):
    service, recorder = served
    channel, gateway = stub_as(service.address, tls_of(certs, "gateway"))
    intruder_channel, intruder = stub_as(service.address, tls_of(certs, "intruder"))
    async with channel, intruder_channel:
        request = trainer_pb2.GetBatchSpecRequest()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await gateway.GetBatchSpec(request)  # the gateway's own certificate has no environment role
        assert missing.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "environment" in missing.value.details()
        for metadata, reason in [
            ([("authorization", "Bearer not-a-token")], "UNKNOWN_TOKEN"),
            ([("authorization", "Basic abc")], "BAD_AUTHORIZATION"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await gateway.GetBatchSpec(request, metadata=metadata)
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error_details(wrong.value)[0].reason == reason
        # The environment's token, captured and replayed over another peer's connection.
        with pytest.raises(grpc.aio.AioRpcError) as replayed:
            await intruder.GetBatchSpec(request, metadata=bearer(certs, "env-a.token"))
        assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_details(replayed.value)[0].reason == "TOKEN_REPLAYED"
        with pytest.raises(grpc.aio.AioRpcError) as narrowed:  # a token's roles replace the certificate's
            await push(intruder, metadata=bearer(certs, "tenant.token"))
        assert narrowed.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert recorder.calls == []
        await gateway.GetBatchSpec(request, metadata=bearer(certs, "env-a.token"))
        async for _ in intruder.WatchSteps(trainer_pb2.WatchStepsRequest(), metadata=bearer(certs, "tenant.token")):
            pass
    assert [(name, caller.name, caller.roles, caller.peer, caller.via) for name, caller in recorder.calls] == [
        ("GetBatchSpec", "env-a", frozenset({"environment"}), "gateway", "token"),
        ("WatchSteps", "tenant-1", frozenset({"tenant"}), "intruder", "token"),
    ]


async def test_admin_calls_are_logged_with_the_caller(served, caplog):
    service, _ = served
    with caplog.at_level(logging.INFO, logger="primerl_common.security._permissions"):
        await trainer_pb2_grpc.TrainerServiceStub(service.channel).SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
    assert any("admin call" in r.getMessage() and "operator" in r.getMessage() for r in caplog.records)


async def test_plaintext_has_no_identities_and_enforces_nothing():
    recorder = Recorder()
    config = ProbeConfig(server={"host": "127.0.0.1", "port": 0})  # tls.mode plaintext (servers.py)
    async with in_process_service(definition(recorder), config) as service:
        await push(trainer_pb2_grpc.TrainerServiceStub(service.channel))
    assert {caller for _, caller in recorder.calls} == {security.LOCAL}


async def test_plaintext_off_loopback_and_mtls_without_files_are_config_errors(certs, tmp_path):
    cases = [
        ({"host": "0.0.0.0"}, TlsConfig(mode="plaintext"), "tls.mode"),
        ({"host": "10.1.2.3"}, TlsConfig(mode="plaintext"), "tls.mode"),
        ({"host": "127.0.0.1"}, TlsConfig(), "tls.cert"),
        ({"host": "127.0.0.1"}, tls_of(certs, "probe").model_copy(update={"key": tmp_path / "absent"}), "tls.key"),
    ]
    for server, tls, field in cases:
        service = GrpcService(definition(Recorder()), ProbeConfig(server={**server, "port": 0}, tls=tls))
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            await service.start()


def test_the_binary_refuses_plaintext_off_loopback_even_for_check_config():
    args = [sys.executable, str(HERE / "servers.py"), "--server.host", "0.0.0.0", "--check-config"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=HERE.parent)
    assert result.returncode == 2 and "tls.mode" in result.stderr, result.stderr


async def test_every_served_method_needs_its_roles_under_mtls(certs):
    with pytest.raises(ValueError, match="no roles for"):
        security.method_roles(SERVICE, {"PushBatch": {"orchestrator"}})
    incomplete = definition(Recorder())
    incomplete.permissions = {PUSH: frozenset({"orchestrator"})}
    with pytest.raises(ValueError, match="SaveCheckpoint"):
        await GrpcService(incomplete, mtls_config(certs)).start()


async def test_make_channel_shows_the_process_identity(served, certs, monkeypatch):
    service, recorder = served
    for name in ("MODE", "CERT", "KEY", "CA"):
        monkeypatch.delenv(security.ENV_PREFIX + name, raising=False)
        monkeypatch.setenv(security.ENV_PREFIX + name, "")  # restored after the test
    monkeypatch.setattr(_credentials, "_process", None)
    security.setup_process_tls(tls_of(certs, "orchestrator"))
    async with make_channel(service.address) as channel:
        await push(trainer_pb2_grpc.TrainerServiceStub(channel))
    # A process it starts inherits the identity from the environment.
    monkeypatch.setattr(_credentials, "_process", None)
    assert security.process_tls() == TlsConfig(
        mode="mtls",
        cert=(certs / "orchestrator.pem").resolve(),
        key=(certs / "orchestrator-key.pem").resolve(),
        ca=(certs / "ca.pem").resolve(),
    )
    assert {caller.name for _, caller in recorder.calls} == {"orchestrator"}
