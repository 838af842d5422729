"""`primerl-trainer`: parse the config, set up observability, serve until SIGTERM.

Under torchrun rank 0 serves gRPC and the other ranks follow its commands (loop.follow, or
run_ops.follow_runs on a trainer with runs).
`primerl-trainer plan ...` is the capacity planner (primerl_trainer.planner), which trains nothing.

Nothing that imports torch is imported before the config is valid: `--check-config` and `plan`
answer in well under a second.
"""

import logging
import os
import signal
import sys
from collections.abc import Sequence

from primerl_common.server import prepare, run_main
from primerl_trainer import __version__
from primerl_trainer.config import TrainerConfig

logger = logging.getLogger("primerl_trainer")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["plan"]:
        from primerl_trainer.planner.cli import main as plan_main

        return plan_main(args[1:])
    # torchrun's environment (process_group.launched_by_torchrun, which imports torch).
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["RANK"]) != 0:
        return follower_main(args)
    code = run_main(TrainerConfig, "primerl_trainer.server:build", version=__version__, argv=args)
    return code or (1 if _training_failed() else 0)


def _training_failed() -> bool:
    # The server's build imports the service module; a config check never does.
    service = sys.modules.get("primerl_trainer.service")
    return service is not None and service.training_failed.is_set()


def follower_main(argv: Sequence[str] | None = None) -> int:
    """A rank other than 0: same config, no server; stops when rank 0 says so (or fails)."""
    # One metrics port per host: rank 0's.
    config = prepare(TrainerConfig, version=__version__, argv=argv, serve_metrics=False)
    if isinstance(config, int):
        return config
    from primerl_trainer.loop import follow
    from primerl_trainer.run_ops import follow_runs
    from primerl_trainer.runtime import build_runtime, shutdown_runtime

    # torchrun forwards SIGTERM to every rank; these stop when rank 0, draining, tells them to.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runtime = build_runtime(config)
    try:
        (follow_runs if config.runs.enabled else follow)(runtime)
    finally:
        shutdown_runtime(runtime)
    logger.info("rank %d stopped", runtime.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
