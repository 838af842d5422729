"""Builds the orchestrator's ServiceDefinition from its config."""

from __future__ import annotations

import asyncio
import contextlib
import functools

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common import security
from primerl_common.server import ServiceDefinition
from primerl_orchestrator import __version__
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.environments.processes import EnvironmentProcess, local_address
from primerl_orchestrator.generation import RouterGeneration
from primerl_orchestrator.kv_namespaces import KvNamespaceSweeper
from primerl_orchestrator.loop import BatchLoop
from primerl_orchestrator.rendering import PromptRenderer
from primerl_orchestrator.run import Run
from primerl_orchestrator.servicer import OrchestratorServicer
from primerl_orchestrator.trainer_client import TrainerFeed
from primerl_orchestrator.versions import BroadcasterVersions, TrainerVersions, VersionSource

__all__ = ["ROLES", "build"]


# Who may call what (primerl_common.security): environments call the environment API only;
# operators pause and resume; anyone authenticated reads the run's status.
ROLES = {
    "ListEnvironments": {security.ENVIRONMENT},
    "NextEpisode": {security.ENVIRONMENT},
    "StartEpisode": {security.ENVIRONMENT},
    "Generate": {security.ENVIRONMENT},
    "FinishEpisode": {security.ENVIRONMENT},
    "GetRunStatus": security.ANY,
    "PauseRun": {security.OPERATOR},
    "ResumeRun": {security.OPERATOR},
}


async def build(config: OrchestratorConfig) -> ServiceDefinition:
    peers = config.peers
    renderer = PromptRenderer.from_config(config.model)
    adapter = config.lora_adapter
    generation = RouterGeneration(
        peers.router, timeout_s=peers.generate_timeout_s, retry_s=peers.router_retry_s, lora_adapter=adapter
    )
    trainer = TrainerFeed(peers.trainer, lora_adapter=adapter, run_id=peers.run_id)
    versions: VersionSource
    if peers.weight_broadcaster is not None:
        versions = BroadcasterVersions(peers.weight_broadcaster, min_replicas=peers.min_replicas, adapter_name=adapter)
    else:
        versions = TrainerVersions(trainer, poll_interval_s=peers.poll_interval_s)
    run = Run(config, renderer, generation)
    sweeper = None
    if peers.kv_cache_pool is not None:
        sweeper = KvNamespaceSweeper(
            generation.in_flight,
            router=peers.router,
            kvstore=peers.kv_cache_pool,
            model=peers.kv_cache_pool_model,
            interval_s=peers.kv_namespace_sweep_s,
        )
    loop = BatchLoop(config, run, trainer, versions)
    running: list[asyncio.Task[None]] = []
    # The programs playing process environments (verifiers ones), through this server's API.
    processes = [
        EnvironmentProcess(
            name,
            env.process,
            orchestrator=local_address(config.server),
            abandon=functools.partial(run.abandon_episodes, name),
            fail=run.fail,
        )
        for name, env in run.environments.items()
        if env.process is not None
    ]

    async def start() -> None:
        running.append(asyncio.create_task(loop.run()))
        if sweeper is not None:
            running.append(asyncio.create_task(sweeper.run()))
        for process in processes:
            process.start()

    async def drain() -> None:
        run.drain()
        await asyncio.gather(*(process.stop() for process in processes))

    async def stop() -> None:
        await asyncio.gather(*(process.stop() for process in processes))
        for task in running:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await generation.close()
        if sweeper is not None:
            await sweeper.close()
        await versions.close()
        await trainer.close()

    definition = ServiceDefinition(
        name="orchestrator",
        version=__version__,
        servicers=[],
        capabilities=[
            "orchestrator.environments.external",
            "orchestrator.environments.builtin",
            "orchestrator.environments.process",
        ],
        attributes={
            "environments": ",".join(env.name for env in config.environments),
            "router": peers.router,
            "trainer": peers.trainer,
            **({"run_id": peers.run_id} if peers.run_id else {}),
            "max_steps": str(config.run.max_steps),
        },
        on_start=[start],
        on_drain=[drain],
        on_stop=[stop],
    )
    servicer = OrchestratorServicer(definition, run)
    descriptor = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"]
    definition.servicers = [(orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server, servicer, descriptor)]
    definition.permissions = security.method_roles(descriptor, ROLES)
    return definition
