"""Each service binary, as a user starts it: --help, health, GetServiceInfo,
an RPC it does not implement yet, and a clean exit on SIGTERM that lets a call
in flight complete."""

import asyncio
import importlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_launcher.tiny_model import make_tiny_model

# service -> (proto service, an RPC the skeleton does not implement yet, its request);
# None where the service implements every RPC of its contract.
SERVICES = {
    "orchestrator": ("OrchestratorService", None, None),
    "trainer": ("TrainerService", None, None),
    "inference": ("InferenceService", None, None),
    "router": ("RouterService", None, None),
    "weight_broadcaster": ("WeightBroadcasterService", None, None),
    "kvstore": ("KvStoreService", None, None),
}

# service -> an implemented RPC answered without any other service, and its request.
IMPLEMENTED = {
    "orchestrator": ("GetRunStatus", "GetRunStatusRequest"),
    "trainer": ("GetStatus", "GetStatusRequest"),
    "inference": ("GetLoad", "GetLoadRequest"),
    "router": ("ListReplicas", "ListReplicasRequest"),
    "weight_broadcaster": ("GetStatus", "GetStatusRequest"),
    "kvstore": ("GetStats", "GetStatsRequest"),
}


def start_flags(service: str, tmp_path: pathlib.Path) -> list[str]:
    """What a service needs besides its port to start: the trainer trains a (tiny) model, the
    inference serves one (float32 and eager: quick to start on CPU)."""
    if service == "inference":
        model = make_tiny_model(tmp_path / "tiny-dense", kind="dense")
        return ["--engine.model", str(model), "--engine.dtype", "float32", "--engine.enforce_eager", "true"]
    if service == "trainer":
        model = make_tiny_model(tmp_path / "tiny-dense", kind="dense")
        return ["--model.path", str(model), "--model.dtype", "float32", "--model.compute_dtype", "float32"]
    if service == "orchestrator":
        # The model's tokenizer and one external environment; no peer listens at the
        # addresses, so it serves while it waits for the trainer.
        model = make_tiny_model(tmp_path / "tiny-dense", kind="dense")
        router, trainer = (f"127.0.0.1:{free_port()}" for _ in range(2))
        environments = '[{"name": "guess"}]'
        return [
            *("--model.path", str(model), "--environments", environments),
            *("--peers.router", router, "--peers.trainer", trainer),
        ]
    return []


def binary(service: str) -> str:
    # Console scripts sit beside the interpreter in a venv, also when it is not on PATH.
    search = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")])
    path = shutil.which(f"primerl-{service.replace('_', '-')}", path=search)
    assert path, f"console script of {service} is not installed"
    return path


def modules(service: str):
    pb2 = importlib.import_module(f"primerl.{service}.v1.{service}_pb2")
    pb2_grpc = importlib.import_module(f"primerl.{service}.v1.{service}_pb2_grpc")
    return pb2, pb2_grpc


@pytest.mark.parametrize("service", SERVICES)
def test_help(service):
    result = subprocess.run([binary(service), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--server.port" in result.stdout and "--config" in result.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_unknown_config_key_fails_naming_it(service, tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nportt = 1\n")
    result = subprocess.run([binary(service), "-c", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "server.portt: unknown key" in result.stderr


@pytest.mark.parametrize("service", SERVICES)
async def test_serves_health_info_and_stops_on_sigterm(service, tmp_path):
    proto_service, unimplemented, request_name = SERVICES[service]
    pb2, pb2_grpc = modules(service)
    port = free_port()
    args = [binary(service), "--server.host", "127.0.0.1", "--server.port", str(port), "--server.drain_delay_s", "0.2"]
    args += start_flags(service, tmp_path)
    async with ServiceProcess(args, port=port) as process:
        async with make_channel(process.address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=f"primerl.{service}.v1.{proto_service}")
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING

            stub = getattr(pb2_grpc, f"{proto_service}Stub")(channel)
            info = (await stub.GetServiceInfo(pb2.GetServiceInfoRequest())).info
            assert info.service_name == service
            assert info.package_version == importlib.metadata.version(f"primerl-{service.replace('_', '-')}")
            assert f"primerl.{service}.v1" in info.api_versions

            if unimplemented is not None:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await getattr(stub, unimplemented)(getattr(pb2, request_name)())
                assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
                # Still serving after the refused call.
                assert (await stub.GetServiceInfo(pb2.GetServiceInfoRequest())).info.service_name == service
            if service in IMPLEMENTED:
                method, request = IMPLEMENTED[service]
                await getattr(stub, method)(getattr(pb2, request)())

            # A call in flight when SIGTERM arrives completes: a reflection stream
            # stays open across the signal and is still answered while draining.
            requests: asyncio.Queue = asyncio.Queue()

            async def request_stream():
                while (request := await requests.get()) is not None:
                    yield request

            reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(request_stream())
            await requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            await reflection.read()
            process.terminate()
            await asyncio.sleep(0.5)
            await requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            reply = await reflection.read()
            assert f"primerl.{service}.v1.{proto_service}" in {s.name for s in reply.list_services_response.service}
            await requests.put(None)
            assert await reflection.code() == grpc.StatusCode.OK
        assert await process.wait(30) == 0, process.output()
        assert "Traceback" not in process.output()


async def test_inference_killed_outright_takes_its_engine_process_with_it(tmp_path):
    """SIGKILL (a crash, the OOM killer) gives the service no chance to stop vLLM's engine
    process; it must not live on holding the model and KV cache memory."""
    port = free_port()
    args = [binary("inference"), "--server.host", "127.0.0.1", "--server.port", str(port)]
    async with ServiceProcess([*args, *start_flags("inference", tmp_path)], port=port) as process:
        assert process.pid is not None
        engine = _children(process.pid)
        assert engine, "the engine core runs in a child process"
        process.kill()
        await process.wait()
        deadline = asyncio.get_running_loop().time() + 30
        while any(map(_alive, engine)):
            assert asyncio.get_running_loop().time() < deadline, f"engine processes {engine} outlived the service"
            await asyncio.sleep(0.2)


def _children(pid: int) -> list[int]:
    return [int(child) for child in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    return pathlib.Path(f"/proc/{pid}").exists()
