"""`primerl-inference`: parse the config, set up observability, serve until SIGTERM."""

import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_inference import __version__
from primerl_inference.config import InferenceConfig


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(InferenceConfig, "primerl_inference.server:build", version=__version__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
