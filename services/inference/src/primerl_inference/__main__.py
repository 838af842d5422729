"""`primerl-inference`: parse the config, set up observability, serve until SIGTERM (or the
engine's death: then the exit code is 1, for a restart)."""

import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_inference import __version__
from primerl_inference.config import InferenceConfig


def main(argv: Sequence[str] | None = None) -> int:
    code = run_main(InferenceConfig, "primerl_inference.server:build", version=__version__, argv=argv)
    return code or (1 if _engine_died() else 0)


def _engine_died() -> bool:
    # Imported by run_main once the config is valid; never by a config check.
    server = sys.modules.get("primerl_inference.server")
    return server is not None and server.engine_died.is_set()


if __name__ == "__main__":
    sys.exit(main())
