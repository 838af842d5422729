import asyncio
import contextlib
import pathlib
import socket
import subprocess
import sys
import urllib.request

import grpc
import psutil
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details, field_violations
from primerl_common.processes import ServiceProcess, free_port, free_ports
from primerl_common.server import channel_options, server_options
from primerl_common.testing import in_process_service

from .servers import ProbeConfig, build_probe

HERE = pathlib.Path(__file__).parent


@pytest.fixture
async def probe():
    config = ProbeConfig(server={"host": "127.0.0.1", "port": 0, "grace_s": 5}, slow_call_s=0.5)
    async with in_process_service(await build_probe(config), config) as served:
        yield served.service, served.channel


async def test_health_info_and_reflection(probe):
    _, channel = probe
    health = health_pb2_grpc.HealthStub(channel)
    for name in ["", "primerl.trainer.v1.TrainerService"]:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = (await trainer_pb2_grpc.TrainerServiceStub(channel).GetServiceInfo(trainer_pb2.GetServiceInfoRequest())).info
    assert info.service_name == "probe"
    assert info.package_version == "9.9.9"
    assert list(info.api_versions) == ["primerl.trainer.v1"]
    assert list(info.capabilities) == ["probe.slow"]
    assert info.instance_id and info.started_at.seconds > 0

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {svc.name async for reply in replies for svc in reply.list_services_response.service}
    assert {"primerl.trainer.v1.TrainerService", "grpc.health.v1.Health"} <= names


async def test_domain_errors_map_to_status_with_details(probe):
    _, channel = probe
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetStatus(trainer_pb2.GetStatusRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "micro_batch.advantages: must be finite, got nan"
    assert field_violations(info.value) == {"micro_batch.advantages": "must be finite, got nan"}

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetStatus(trainer_pb2.GetStatusRequest(), metadata=(("fail", "precondition"),))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    [precondition] = [d for d in error_details(info.value) if isinstance(d, error_details_pb2.PreconditionFailure)]
    assert precondition.violations[0].subject == "policy_version"

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.PushBatch(iter([trainer_pb2.PushBatchRequest(begin=trainer_pb2.BatchBegin(step=1))]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    [retry] = [d for d in error_details(info.value) if isinstance(d, error_details_pb2.RetryInfo)]
    assert retry.retry_delay.ToNanoseconds() == 1_500_000_000


async def test_unexpected_error_is_internal_without_trace(probe):
    _, channel = probe
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for reply in stub.WatchSteps(trainer_pb2.WatchStepsRequest()):
            received.append(reply.step.step)
    assert received == [0, 1, 2]  # what was streamed before the failure arrives
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in info.value.details() and "Traceback" not in info.value.details()
    # The service keeps serving.
    reply = await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())
    assert reply.info.service_name == "probe"


async def test_unobserved_method_keeps_its_error_mapping_without_server_metrics():
    config = ProbeConfig(server={"host": "127.0.0.1", "port": 0})
    definition = await build_probe(config)
    definition.unobserved_methods = ["/primerl.trainer.v1.TrainerService/GetStatus"]

    def handled(method: str, code: str) -> float:
        labels = {"service": "primerl.trainer.v1.TrainerService", "method": method, "code": code}
        return REGISTRY.get_sample_value("primerl_grpc_server_handled_total", labels) or 0.0

    before = handled("GetStatus", "INVALID_ARGUMENT"), handled("GetServiceInfo", "OK")
    async with in_process_service(definition, config) as served:
        stub = trainer_pb2_grpc.TrainerServiceStub(served.channel)
        for _ in range(2):  # the mapping, wrapped at the first call, serves the next ones
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetStatus(trainer_pb2.GetStatusRequest())
            assert field_violations(info.value) == {"micro_batch.advantages": "must be finite, got nan"}
        await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())
    assert (handled("GetStatus", "INVALID_ARGUMENT"), handled("GetServiceInfo", "OK")) == (before[0], before[1] + 1)


def test_servers_admit_the_keepalive_pings_of_clients():
    client, server = dict(channel_options(1 << 20)), dict(server_options(1 << 20))
    # A server answers pings that come more often than it admits with GOAWAY "too_many_pings":
    # keepalive pings come a keepalive time apart, less the delay of a late one, which is at
    # most the keepalive timeout (then its sender closes the connection). test_keepalive.py
    # idles a real pair past the keepalive time.
    admitted = server["grpc.http2.min_ping_interval_without_data_ms"]
    assert 0 < admitted <= client["grpc.keepalive_time_ms"] - client["grpc.keepalive_timeout_ms"]
    assert client["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.http2.max_pings_without_data"] == 0  # keepalive pings on a quiet stream too


async def test_unimplemented_rpc(probe):
    _, channel = probe
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.details() == "primerl.trainer.v1.TrainerService/GetBatchSpec is not implemented by probe 9.9.9"
    # The service keeps serving.
    assert (await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest())).info.package_version == "9.9.9"


async def test_in_process_stop_lets_inflight_call_finish(probe):
    service, channel = probe
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    call = asyncio.ensure_future(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest()))
    await asyncio.sleep(0.1)
    await service.stop(grace_s=5)
    assert (await call).path == "/done"


async def test_sigterm_drains_inflight_call_then_exits_cleanly():
    port = free_port()
    args = [sys.executable, str(HERE / "servers.py"), "--server.host", "127.0.0.1", "--server.port", str(port)]
    args += ["--server.drain_delay_s", "1", "--slow_call_s", "2", "--observability.log_json", "false"]
    async with ServiceProcess(args, port=port) as service:
        async with make_channel(service.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            call = asyncio.ensure_future(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=20))
            await asyncio.sleep(0.5)  # the call is running in the server
            service.terminate()
            await asyncio.sleep(0.3)
            status = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await call).path == "/done"  # the in-flight call completed
        assert await service.wait(20) == 0
        output = service.output()
    assert "stopped probe" in output, output
    assert "Traceback" not in output, output


# A stream still open when grpc.aio's stop(grace) returns leaves its call task pending; an
# event loop closed then cancels it, and grpc prints it as an unhandled exception.
_OPEN_STREAM_AT_EXIT = """
import asyncio, sys, grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from primerl_common.server import _rpc_tasks_settle

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    await watch.read()
    await server.stop(0.2)
    if sys.argv[1] == "settle":
        await _rpc_tasks_settle(timeout_s=2.0)

asyncio.run(main())
"""


def test_call_tasks_left_at_stop_end_without_a_traceback_once_settled():
    # Without the wait (the script's argument "exit") 5 of 10 runs printed grpc's traceback here.
    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-c", _OPEN_STREAM_AT_EXIT, "settle"], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr


async def test_sigterm_with_calls_open_past_the_grace_exits_cleanly():
    # A router's health Watch never ends by itself, and this SaveCheckpoint outlasts the grace: gRPC
    # cancels both, and the service process exits 0 without a traceback.
    port = free_port()
    args = [sys.executable, str(HERE / "servers.py"), "--server.host", "127.0.0.1", "--server.port", str(port)]
    args += ["--server.drain_delay_s", "0", "--server.grace_s", "0.5", "--slow_call_s", "30"]
    async with ServiceProcess([*args, "--observability.log_json", "false"], port=port) as service:
        async with make_channel(service.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            call = asyncio.ensure_future(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=20))
            await asyncio.sleep(0.5)  # the call is running in the server
            service.terminate()
            assert await service.wait(20) == 0
            with pytest.raises(grpc.aio.AioRpcError):
                await call
        output = service.output()
    assert "stopped probe" in output, output
    assert "Traceback" not in output, output


def test_check_config_validates_and_exits_without_serving(tmp_path):
    config = tmp_path / "all.toml"
    config.write_text("[probe]\nslow_call_s = 1.0\n[bad]\nslow_call_s = -1\nport = 3\n")
    base = [sys.executable, str(HERE / "servers.py"), "-c", str(config), "--check-config"]
    ok = subprocess.run(
        [*base, "--config-section", "probe", "--server.host=127.0.0.1"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and "configuration is valid" in ok.stdout, ok.stderr
    bad = subprocess.run([*base, "--config-section", "bad"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "[bad]" in bad.stderr and "port: unknown key" in bad.stderr, bad.stderr


def test_check_config_does_not_import_a_build_given_by_name(capsys):
    from primerl_common.server import run_main

    from .servers import ProbeConfig

    # --check-config never imports the server module (here: one that does not exist).
    argv = ["--check-config", "--server.host=127.0.0.1"]  # plaintext (ProbeConfig's tls) on loopback only
    assert run_main(ProbeConfig, "no_such_module:build", version="0", argv=argv) == 0
    assert "configuration is valid" in capsys.readouterr().out


def _listening(pid: int, port: int) -> set[str]:
    """The addresses a process listens on at `port` (TCP)."""
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


async def test_the_metrics_endpoint_listens_on_its_configured_address_only():
    """observability.metrics_host is the one address the Prometheus endpoint binds; unset, it is
    server.host's. (All of 127.0.0.0/8 is this host's, but a socket bound to one of its
    addresses refuses connections to another.)"""
    named, unset, named_metrics, unset_metrics = free_ports(4)

    def probe(host: str, port: int, metrics_port: int, metrics_host: str | None = None) -> list[str]:
        args = [sys.executable, str(HERE / "servers.py"), "--observability.log_json", "false"]
        args += ["--server.host", host, "--server.port", str(port), "--observability.metrics_port", str(metrics_port)]
        return args + (["--observability.metrics_host", metrics_host] if metrics_host else [])

    processes = [
        # metrics on an address other than the server's; metrics_host unset: server.host's
        ServiceProcess(probe("127.0.0.1", named, named_metrics, "127.0.0.2"), port=named),
        ServiceProcess(probe("127.0.0.3", unset, unset_metrics), address=f"127.0.0.3:{unset}"),
    ]
    async with contextlib.AsyncExitStack() as stack:
        for process in processes:
            await stack.enter_async_context(process)
        expected = {named_metrics: "127.0.0.2", unset_metrics: "127.0.0.3"}
        for process, (port, host) in zip(processes, expected.items(), strict=True):
            assert _listening(process.pid, port) == {host}, process.output()
            body = await asyncio.to_thread(lambda h=host, p=port: _get(f"http://{h}:{p}/metrics"))
            assert b"process_" in body or b"python_info" in body
            for elsewhere in {"127.0.0.1", "127.0.0.2", "127.0.0.3"} - {host}:
                with pytest.raises(OSError):
                    await asyncio.to_thread(socket.create_connection, (elsewhere, port), 2)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()
