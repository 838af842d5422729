"""`primerl-inference`: parse the config, set up observability, serve until SIGTERM."""

import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_inference import __version__
from primerl_inference.config import InferenceConfig
from primerl_inference.server import build


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(InferenceConfig, build, version=__version__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
