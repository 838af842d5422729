"""Builds the trainer's ServiceDefinition from its config (rank 0; the other ranks follow it)."""

from __future__ import annotations

import asyncio

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common import security
from primerl_common.server import ServiceDefinition
from primerl_trainer import __version__
from primerl_trainer.config import TrainerConfig
from primerl_trainer.run_service import RunService
from primerl_trainer.runtime import TrainingRuntime, build_runtime, shutdown_runtime
from primerl_trainer.service import TrainingService
from primerl_trainer.servicer import TrainerServicer
from primerl_trainer.sft_data import SFTDataset, load_sft_samples

__all__ = ["ONE_RUN_ROLES", "ROLES", "build"]

# Who may call what (primerl_common.security): the orchestrator pushes batches, operators
# checkpoint on demand, anyone authenticated reads status and step metrics. Tenants create and
# steer their runs (runs.max_concurrent_runs > 0); every RPC that names a run is then refused
# unless the caller owns it or is an operator (run_service.py).
_TENANTS = {security.TENANT, security.OPERATOR}
ROLES = {
    "GetBatchSpec": {security.ORCHESTRATOR, security.OPERATOR, security.TENANT},
    "PushBatch": {security.ORCHESTRATOR},
    "GetStatus": security.ANY,
    "WatchSteps": security.ANY,
    "SaveCheckpoint": _TENANTS,
    "CreateRun": _TENANTS,
    "GetRun": {security.TENANT, security.OPERATOR, security.ORCHESTRATOR},
    "ListRuns": {security.TENANT, security.OPERATOR, security.ORCHESTRATOR},
    "PauseRun": _TENANTS,
    "ResumeRun": _TENANTS,
    "DeleteRun": _TENANTS,
}
# A trainer of one run has no tenants: its run is the deployment's own.
ONE_RUN_ROLES = {
    method: roles if roles is security.ANY else set(roles) - {security.TENANT} for method, roles in ROLES.items()
}


async def build(config: TrainerConfig) -> ServiceDefinition:
    # Before the model: a bad dataset line fails the start at once.
    sft_dataset = _sft_dataset(config)
    runtime = build_runtime(config)
    service: TrainingService | RunService
    try:
        service = RunService(runtime) if config.runs.enabled else TrainingService(runtime, sft_dataset=sft_dataset)
    except BaseException:
        shutdown_runtime(runtime)
        raise

    async def stop() -> None:
        await service.stop()
        await asyncio.to_thread(shutdown_runtime, runtime)

    definition = ServiceDefinition(
        name="trainer",
        version=__version__,
        servicers=[],
        capabilities=_capabilities(runtime),
        attributes={
            "model": config.model.path,
            "mode": config.mode,
            "device": str(runtime.device),
            "world_size": str(runtime.world_size),
        },
        on_start=[service.start],
        on_drain=[service.drain],
        on_stop=[stop],
    )
    servicer = TrainerServicer(definition, service)
    descriptor = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
    definition.servicers = [(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer, descriptor)]
    definition.permissions = security.method_roles(descriptor, ROLES if config.runs.enabled else ONE_RUN_ROLES)
    return definition


def _sft_dataset(config: TrainerConfig) -> SFTDataset | None:
    sft = config.sft
    if sft.dataset is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    samples = load_sft_samples(sft.dataset, tokenizer, seq_len=config.seq_len)
    return SFTDataset(
        samples,
        seq_len=config.seq_len,
        batch_size=sft.batch_size,
        epochs=sft.epochs,
        max_steps=sft.max_steps,
        shuffle=sft.shuffle,
        seed=sft.seed,
    )


def _capabilities(runtime: TrainingRuntime) -> list[str]:
    config = runtime.config
    capabilities = [f"trainer.mode.{config.mode}"]
    if runtime.spec.router_replay:
        capabilities.append("trainer.router_replay")
    if config.lora.enabled:
        capabilities.append("trainer.lora")
    if config.runs.enabled:
        capabilities.append("trainer.runs")
    if config.publish.weight_broadcaster is not None:
        capabilities.append(f"trainer.publish.{config.publish.kind}")
    return capabilities
