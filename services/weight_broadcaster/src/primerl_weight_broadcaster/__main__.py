"""`primerl-weight-broadcaster`: parse the config, set up observability, serve until SIGTERM."""

import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_weight_broadcaster import __version__
from primerl_weight_broadcaster.config import WeightBroadcasterConfig


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(WeightBroadcasterConfig, "primerl_weight_broadcaster.server:build", version=__version__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
