"""`primerl-orchestrator`: parse the config, set up observability, serve until SIGTERM."""

import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_orchestrator import __version__
from primerl_orchestrator.config import OrchestratorConfig


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(OrchestratorConfig, "primerl_orchestrator.server:build", version=__version__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
