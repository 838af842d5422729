"""`python -m primerl_orchestrator.environments.verifiers_process --orchestrator=HOST:PORT
--environment=NAME --seed=N --options=JSON`: loads the verifiers environment the options name
and plays its episodes until the run is over (exit 0). Started, and restarted when it dies, by
the orchestrator (environments/processes.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from primerl.orchestrator.v1 import orchestrator_pb2_grpc
from primerl_common.client import make_channel
from primerl_orchestrator.environments.verifiers_env import VerifiersEnvironment

logger = logging.getLogger("primerl_orchestrator.environments.verifiers_process")


async def play(*, orchestrator: str, name: str, seed: int, options: VerifiersEnvironment.Options) -> None:
    # Imported here: verifiers takes seconds to import, and the arguments are checked first.
    import verifiers as vf

    from primerl_orchestrator.environments.verifiers_process.player import DatasetRows, EpisodePlayer

    environment = vf.load_environment(options.module, **options.args)
    rows = DatasetRows(environment, split=options.split, seed=seed, shuffle=options.shuffle)
    logger.info(
        "environment %s: %s (%s) from %s, %d rows of its %s dataset",
        name,
        type(environment).__name__,
        ", ".join(f"{k}={v!r}" for k, v in options.args.items()) or "no arguments",
        options.module,
        len(rows.stream()),
        options.split,
    )
    async with make_channel(orchestrator) as channel:
        player = EpisodePlayer(
            environment,
            rows,
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel),
            name=name,
            max_concurrent_groups=options.max_concurrent_groups,
            turn_timeout_s=options.turn_timeout_s,
        )
        await player.run()
    logger.info("environment %s: the run is over", name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primerl_orchestrator.environments.verifiers_process")
    parser.add_argument("--orchestrator", required=True, help="host:port of the orchestrator")
    parser.add_argument("--environment", required=True, help="the environment's name in the orchestrator")
    parser.add_argument("--seed", type=int, default=0, help="seed of the order of the dataset's rows")
    parser.add_argument("--options", required=True, help="the environment's options (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s environment {args.environment} %(name)s: %(message)s",
    )
    options = VerifiersEnvironment.Options.model_validate_json(args.options)
    # Before verifiers (and datasets, huggingface_hub) are imported: they read these once.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if options.hub_offline:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    asyncio.run(play(orchestrator=args.orchestrator, name=args.environment, seed=args.seed, options=options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
