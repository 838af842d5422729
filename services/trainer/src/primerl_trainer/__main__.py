"""`primerl-trainer`: parse the config, set up observability, serve until SIGTERM.

Under torchrun rank 0 serves gRPC and the other ranks follow its commands (loop.follow)."""

import logging
import os
import signal
import sys
from collections.abc import Sequence

from primerl_common.server import prepare, run_main
from primerl_trainer import __version__
from primerl_trainer.config import TrainerConfig
from primerl_trainer.loop import follow
from primerl_trainer.process_group import launched_by_torchrun
from primerl_trainer.runtime import build_runtime, shutdown_runtime
from primerl_trainer.server import build
from primerl_trainer.service import training_failed

logger = logging.getLogger("primerl_trainer")


def main(argv: Sequence[str] | None = None) -> int:
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return follower_main(argv)
    code = run_main(TrainerConfig, build, version=__version__, argv=argv)
    return code or (1 if training_failed.is_set() else 0)


def follower_main(argv: Sequence[str] | None = None) -> int:
    """A rank other than 0: same config, no server; stops when rank 0 says so (or fails)."""
    # One metrics port per host: rank 0's.
    config = prepare(TrainerConfig, version=__version__, argv=argv, serve_metrics=False)
    if isinstance(config, int):
        return config
    # torchrun forwards SIGTERM to every rank; these stop when rank 0, draining, tells them to.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runtime = build_runtime(config)
    try:
        follow(runtime)
    finally:
        shutdown_runtime(runtime)
    logger.info("rank %d stopped", runtime.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
