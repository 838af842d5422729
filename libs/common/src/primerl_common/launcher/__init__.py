"""`primerl up`: the six services of a run started from one TOML file, followed and stopped.

Services are separate processes (`python -m primerl_<service>`), each configured by its
own table of the launch file; the launcher talks to them only through their gRPC APIs.
"""

from primerl_common.launcher.cli import main

__all__ = ["main"]
