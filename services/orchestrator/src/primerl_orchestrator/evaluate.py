"""`python -m primerl_orchestrator.evaluate -c orchestrator.toml --output results.json`: the
config's [[evals]], each played once through its router (whatever model the replicas serve,
e.g. a saved checkpoint), no trainer; the results as JSON (what `primerl eval` runs)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from primerl_common.config import ConfigError, load_config
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.evals import EvalResult, Evaluator, Immediately
from primerl_orchestrator.generation import RouterGeneration
from primerl_orchestrator.rendering import PromptRenderer

__all__ = ["evaluate_all", "main"]

logger = logging.getLogger(__name__)


async def evaluate_all(
    config: OrchestratorConfig, *, policy_version: int, max_sample_records: int = 8
) -> list[EvalResult]:
    peers = config.peers
    renderer = PromptRenderer(config.model.path, max_model_len=config.model.max_model_len)
    generation = RouterGeneration(peers.router, timeout_s=peers.generate_timeout_s, retry_s=peers.router_retry_s)
    try:
        evaluator = Evaluator(
            config, renderer, generation, versions_served=False, max_sample_records=max_sample_records
        )
        return [
            await evaluator.evaluate(evaluation, policy_version=policy_version, admission=Immediately())
            for evaluation in config.evals
        ]
    finally:
        await generation.close()


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
