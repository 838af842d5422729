"""`primerl-trainer`: parse the config, set up observability, serve until SIGTERM."""

import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_trainer import __version__
from primerl_trainer.config import TrainerConfig
from primerl_trainer.server import build


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(TrainerConfig, build, version=__version__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
