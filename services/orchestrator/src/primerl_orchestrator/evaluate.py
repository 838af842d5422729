"""`python -m primerl_orchestrator.evaluate -c orchestrator.toml --output results.json`: the
config's [[evals]], each played once through its router (whatever model the replicas serve,
e.g. a saved checkpoint), no trainer; the results as JSON (what `primerl eval` runs).

An eval of an environment played by a process of its own (verifiers) is played by that process,
as in training: the orchestrator's API is served on a free port (server.host) for it, with
evaluation episodes only, and the process is stopped once the evals are done."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common import security
from primerl_common.config import ConfigError, load_config
from primerl_common.server import GrpcService, ServiceDefinition
from primerl_orchestrator import __version__
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.environments.processes import EnvironmentProcess, local_address
from primerl_orchestrator.evals import EvalResult, Evaluator, Immediately
from primerl_orchestrator.generation import RouterGeneration
from primerl_orchestrator.rendering import PromptRenderer
from primerl_orchestrator.run import Run
from primerl_orchestrator.server import ROLES
from primerl_orchestrator.servicer import OrchestratorServicer

__all__ = ["evaluate_all", "main"]

logger = logging.getLogger(__name__)


async def evaluate_all(
    config: OrchestratorConfig, *, policy_version: int, max_sample_records: int = 8
) -> list[EvalResult]:
    peers = config.peers
    renderer = PromptRenderer.from_config(config.model)
    generation = RouterGeneration(peers.router, timeout_s=peers.generate_timeout_s, retry_s=peers.router_retry_s)
    # Evaluation episodes only: its dispatch never opens for training.
    run = Run(config, renderer, generation)
    try:
        evaluator = Evaluator(
            config,
            renderer,
            generation,
            versions_served=False,
            episodes=run.evals,
            max_sample_records=max_sample_records,
        )

        async def evaluate_each() -> list[EvalResult]:
            return [
                await evaluator.evaluate(evaluation, policy_version=policy_version, admission=Immediately())
                for evaluation in config.evals
            ]

        played = sorted(
            {e.environment for e in config.evals if e.environment and run.environments[e.environment].process}
        )
        if not played:
            return await evaluate_each()
        async with _environment_processes(config, run, played) as failed:
            evaluating = asyncio.ensure_future(evaluate_each())
            failing = asyncio.ensure_future(failed.wait())
            try:
                await asyncio.wait([evaluating, failing], return_when=asyncio.FIRST_COMPLETED)
            finally:
                failing.cancel()
                if not evaluating.done():
                    evaluating.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await evaluating
            if not evaluating.done() or evaluating.cancelled():
                raise RuntimeError(f"the evaluation stopped: {run.error}")
            return evaluating.result()
    finally:
        await generation.close()


@contextlib.asynccontextmanager
async def _environment_processes(config: OrchestratorConfig, run: Run, names: list[str]):
    """The API served for the processes of environments `names`, and those processes; yields an
    event set if one of them dies for good."""
    server = config.server.model_copy(update={"port": 0})
    # The processes started here inherit this identity (PRIMERL_TLS_*), as a service's do.
    security.setup_process_tls(config.tls)
    definition = ServiceDefinition(name="orchestrator", version=__version__, servicers=[])
    servicer = OrchestratorServicer(definition, run)
    descriptor = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"]
    definition.servicers = [(orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server, servicer, descriptor)]
    definition.permissions = security.method_roles(descriptor, ROLES)
    service = GrpcService(definition, config.model_copy(update={"server": server}))
    port = await service.start()
    failed = asyncio.Event()

    def fail(error: str) -> None:
        run.fail(error)
        failed.set()

    processes = [
        EnvironmentProcess(
            name,
            run.environments[name].process,
            orchestrator=local_address(server.model_copy(update={"port": port})),
            abandon=functools.partial(run.abandon_episodes, name),
            fail=fail,
        )
        for name in names
    ]
    try:
        for process in processes:
            process.start()
        yield failed
    finally:
        # NextEpisode answers that the run is over: each process exits on its own.
        run.finish()
        await asyncio.gather(*(process.stop(grace_s=10.0) for process in processes))
        await service.stop(grace_s=1.0)


def result_json(result: EvalResult) -> dict[str, Any]:
    return {**result.record(), "samples": [dataclasses.asdict(sample) for sample in result.samples]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output", type=pathlib.Path, required=True, help="where the results go (JSON)")
    parser.add_argument("--policy-version", type=int, default=0, help="the version the replicas serve")
    parser.add_argument("--max-samples", type=int, default=8, help="sample rollouts kept per eval")
    ours, rest = parser.parse_known_args(argv)
    try:
        config = load_config(OrchestratorConfig, rest, prog="python -m primerl_orchestrator.evaluate")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not config.evals:
        print("error: the config has no [[evals]]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = asyncio.run(evaluate_all(config, policy_version=ours.policy_version, max_sample_records=ours.max_samples))
    ours.output.parent.mkdir(parents=True, exist_ok=True)
    ours.output.write_text(json.dumps({"evals": [result_json(r) for r in results]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
