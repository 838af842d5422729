"""The trainer, the orchestrator and the inference service served with mutual TLS in this
process and attacked as tests/test_security_services.py attacks the others (tests/security_attacks.py):
each RPC that changes state refused to every intruder with the status that fits, the state as
before, the caller it is for let through; the inference service's sealed weight push too."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import grpc
import pytest
import torch

from primerl.common.v1 import generation_pb2, tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.tensors import iter_tensor_chunks
from primerl_common.testing import bare_server, eventually
from primerl_launcher.tiny_model import make_tiny_model, save_tokenizer
from tests.security_attacks import (
    DENIED,
    HOLDERS,
    REPO,
    UNAUTHENTICATED,
    Target,
    attack,
    client_stream,
    served,
    server_stream,
    service_tls,
    token,
    unary,
)

# --- trainer --------------------------------------------------------------------------------


async def test_trainer(certs, tmp_path_factory):
    from primerl_trainer.config import TrainerConfig
    from primerl_trainer.server import build

    model = make_tiny_model(tmp_path_factory.getbasetemp() / "security-tiny-dense", kind="dense", dtype="float32")
    config = TrainerConfig(
        server={"host": "127.0.0.1", "port": 0, "drain_delay_s": 0.0, "grace_s": 5.0},
        tls=service_tls(certs, "trainer"),
        model={"path": str(model), "dtype": "float32", "compute_dtype": "float32"},
        seq_len=64,
        checkpoint={"dir": str(tmp_path_factory.mktemp("checkpoints")), "save_on_stop": False},
    )
    async with served(await build(config), config, certs) as target:
        orchestrator = trainer_pb2_grpc.TrainerServiceStub(target.channel("orchestrator"))
        before = await orchestrator.GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
        batch = [
            trainer_pb2.PushBatchRequest(begin=trainer_pb2.BatchBegin(step=before.next_step, num_micro_batches=10**9))
        ]
        Stub = trainer_pb2_grpc.TrainerServiceStub
        for rpc, allowed, invoke in [
            ("PushBatch", {"orchestrator"}, client_stream(Stub, "PushBatch", lambda: batch)),
            ("SaveCheckpoint", {"operator"}, unary(Stub, "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest())),
            (
                "GetBatchSpec",
                {"orchestrator", "operator"},
                unary(Stub, "GetBatchSpec", trainer_pb2.GetBatchSpecRequest()),
            ),
        ]:
            await attack(target, f"/primerl.trainer.v1.TrainerService/{rpc}", allowed, invoke)
        assert await orchestrator.GetBatchSpec(trainer_pb2.GetBatchSpecRequest()) == before
        status = await trainer_pb2_grpc.TrainerServiceStub(target.channel("tenant-1")).GetStatus(
            trainer_pb2.GetStatusRequest()
        )
        assert status.step == 0


# --- orchestrator ---------------------------------------------------------------------------


def _stand_ins():
    path = REPO / "services" / "orchestrator" / "tests" / "stand_ins.py"
    spec = importlib.util.spec_from_file_location("orchestrator_stand_ins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_orchestrator(certs, tmp_path_factory):
    from primerl_orchestrator.config import OrchestratorConfig
    from primerl_orchestrator.server import build

    stand_ins = _stand_ins()
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(tokenizer)
    async with (
        bare_server(
            functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, stand_ins.StandInTrainer())
        ) as trainer_at,
        bare_server(
            functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, stand_ins.StandInRouter())
        ) as router_at,
    ):
        # Its peers here are plaintext stand-ins: this process has no identity of its own.
        config = OrchestratorConfig(
            server={"host": "127.0.0.1", "port": 0},
            tls=service_tls(certs, "orchestrator"),
            peers={"router": router_at, "trainer": trainer_at, "poll_interval_s": 0.05},
            model={"path": tokenizer, "max_model_len": 64},
            environments=[{"name": "guess", "group_size": 2}],
            run={"batch_size": 2, "max_steps": 3},
        )
        async with served(await build(config), config, certs) as target:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(target.channel("operator"))

            async def status():
                return await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())

            async def running():
                # ... and knows the policy version its peers serve (-1 until its first poll of them)
                now = await status()
                return now.state == orchestrator_pb2.RUN_STATE_RUNNING and now.policy_version >= 0

            await eventually(running, timeout_s=30, what="the run is running at a known policy version")
            before = await status()
            Stub = orchestrator_pb2_grpc.OrchestratorServiceStub
            start = orchestrator_pb2.StartEpisodeRequest(
                environment="guess", task=orchestrator_pb2.Task(task_id="evil")
            )
            for rpc, allowed, invoke in [
                ("PauseRun", {"operator"}, unary(Stub, "PauseRun", orchestrator_pb2.PauseRunRequest())),
                ("ResumeRun", {"operator"}, unary(Stub, "ResumeRun", orchestrator_pb2.ResumeRunRequest())),
                ("StartEpisode", {"environment"}, unary(Stub, "StartEpisode", start)),
                (
                    "NextEpisode",
                    {"environment"},
                    unary(Stub, "NextEpisode", orchestrator_pb2.NextEpisodeRequest(environment="guess")),
                ),
                (
                    "Generate",
                    {"environment"},
                    unary(Stub, "Generate", orchestrator_pb2.GenerateRequest(episode_id="x")),
                ),
                (
                    "FinishEpisode",
                    {"environment"},
                    unary(Stub, "FinishEpisode", orchestrator_pb2.FinishEpisodeRequest(episode_id="x", reward=1.0)),
                ),
                (
                    "ListEnvironments",
                    {"environment"},
                    unary(Stub, "ListEnvironments", orchestrator_pb2.ListEnvironmentsRequest()),
                ),
            ]:
                await attack(target, f"/primerl.orchestrator.v1.OrchestratorService/{rpc}", allowed, invoke)
            assert await status() == before
            # An environment (its token, over its own connection) plays; the operator pauses.
            environment = orchestrator_pb2_grpc.OrchestratorServiceStub(target.channel(HOLDERS["environment"]))
            metadata = [("authorization", f"Bearer {token(certs, 'environment')}")]
            episodes = await environment.StartEpisode(start, metadata=metadata, timeout=10)
            assert len(episodes.episodes) == 2
            await stub.PauseRun(orchestrator_pb2.PauseRunRequest())
            assert (await status()).state == orchestrator_pb2.RUN_STATE_PAUSED


# --- inference ------------------------------------------------------------------------------


async def test_inference(certs, tmp_path_factory):
    from primerl_inference.config import InferenceConfig
    from primerl_inference.server import build

    model = make_tiny_model(tmp_path_factory.getbasetemp() / "security-tiny-inference", kind="dense", dtype="float32")
    config = InferenceConfig(
        server={"host": "127.0.0.1", "port": 0, "sealed_port": 0},
        tls=service_tls(certs, "inference"),
        engine={"model": str(model), "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 4},
    )
    async with served(await build(config), config, certs) as target:
        router = inference_pb2_grpc.InferenceServiceStub(target.channel("router"))
        before = (await router.GetLoad(inference_pb2.GetLoadRequest())).load
        Stub = inference_pb2_grpc.InferenceServiceStub
        update = [inference_pb2.UpdateWeightsRequest(begin=inference_pb2.WeightUpdateBegin(policy_version=99))]
        generate = inference_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                prompt_token_ids=[1, 2, 3], sampling=generation_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
            )
        )
        adapter = [inference_pb2.LoadAdapterRequest(spec=inference_pb2.AdapterSpec(name="evil"))]
        for rpc, allowed, invoke in [
            ("UpdateWeights", {"weight_broadcaster"}, client_stream(Stub, "UpdateWeights", lambda: update)),
            ("PauseGeneration", {"operator"}, unary(Stub, "PauseGeneration", inference_pb2.PauseGenerationRequest())),
            (
                "ResumeGeneration",
                {"operator"},
                unary(Stub, "ResumeGeneration", inference_pb2.ResumeGenerationRequest()),
            ),
            (
                "ResetPrefixCache",
                {"router", "operator"},
                unary(Stub, "ResetPrefixCache", inference_pb2.ResetPrefixCacheRequest()),
            ),
            ("LoadAdapter", {"weight_broadcaster", "operator"}, client_stream(Stub, "LoadAdapter", lambda: adapter)),
            (
                "UnloadAdapter",
                {"weight_broadcaster", "operator"},
                unary(Stub, "UnloadAdapter", inference_pb2.UnloadAdapterRequest(name="evil")),
            ),
            ("Generate", {"router"}, server_stream(Stub, "Generate", generate)),
        ]:
            await attack(target, f"/primerl.inference.v1.InferenceService/{rpc}", allowed, invoke)
        after = (await router.GetLoad(inference_pb2.GetLoadRequest())).load
        assert after.policy_version == before.policy_version and not after.paused
        tokens = [
            token_id async for reply in router.Generate(generate, timeout=60) for token_id in reply.output.token_ids
        ]
        assert len(tokens) == 2
        await sealed_push_attacked_then_taken(target, model)


def model_tensors(model: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for path in sorted(model.glob("*.safetensors")) for name, t in load_file(path).items()}


async def sealed_push_attacked_then_taken(target: Target, model: pathlib.Path) -> None:
    """UpdateWeights as sealed streams on the replica's sealed port: sessions only for the
    broadcaster's role, a stream under a guessed key refused, then the broadcaster's push of the
    model's tensors served as the new version."""
    import os

    from primerl_common.sealed_streams import SealedCaller
    from primerl_common.security.sealed import StreamKey

    method = "/primerl.inference.v1.InferenceService/UpdateWeights"
    load = inference_pb2_grpc.InferenceServiceStub(target.channel("router")).GetLoad
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await SealedCaller(target.channel("router"), "127.0.0.1").open(method, 1, timeout_s=10)
    assert denied.value.code() == DENIED and "weight_broadcaster" in denied.value.details()
    tensors = model_tensors(model)
    begin = inference_pb2.WeightUpdateBegin(
        policy_version=7,
        format=tensor_pb2.WEIGHT_FORMAT_HF,
        num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )
    requests = [
        inference_pb2.UpdateWeightsRequest(begin=begin).SerializeToString(),
        *(
            inference_pb2.UpdateWeightsRequest(chunk=chunk).SerializeToString()
            for chunk in iter_tensor_chunks(tensors.items(), chunk_bytes=1 << 20)
        ),
    ]
    broadcaster = SealedCaller(target.channel("weight_broadcaster"), "127.0.0.1")
    try:
        port, (guessed, taken) = await broadcaster.open(method, 2, timeout_s=10)
        forged = StreamKey(guessed.session_id, os.urandom(32), method)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await broadcaster.call(port, forged, 0, requests, inference_pb2.UpdateWeightsResponse, timeout_s=60)
        assert refused.value.code() == UNAUTHENTICATED
        assert (await load(inference_pb2.GetLoadRequest())).load.policy_version != 7
        response = await broadcaster.call(port, taken, 1, requests, inference_pb2.UpdateWeightsResponse, timeout_s=120)
        assert response.policy_version == 7
        assert (await load(inference_pb2.GetLoadRequest())).load.policy_version == 7
    finally:
        await broadcaster.close()
