"""`primerl-router`: parse the config, set up observability, serve until SIGTERM."""

import asyncio
import sys
from collections.abc import Sequence

from primerl_common.server import run_main
from primerl_router import __version__
from primerl_router.config import RouterConfig

try:
    import uvloop
except ImportError:  # the asyncio loop then: the same behaviour, more CPU per call
    uvloop = None


def main(argv: Sequence[str] | None = None) -> int:
    if uvloop is not None:
        # The router's CPU per forwarded call is mostly the event loop's and grpc.aio's: on
        # uvloop it spends 6-13% less (bench/router_overhead.py at concurrency 64).
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return run_main(RouterConfig, "primerl_router.server:build", version=__version__, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
