"""The `primerl` command: `primerl up [-c FILE]` runs a whole RL system from one TOML
file (without -c: the embedded demo); `primerl demo-config` prints that demo file."""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import io
import pathlib
import signal
import sys
from collections.abc import Sequence

from primerl_launcher.run import Launcher, default_run_dir
from primerl_launcher.spec import LaunchConfigError, LaunchFile, parse_launch_file, read_launch_file

__all__ = ["demo_config_text", "main"]

EXIT_CONFIG, EXIT_INTERRUPTED = 2, 130


def demo_config_text() -> str:
    return importlib.resources.files("primerl_launcher").joinpath("demo.toml").read_text()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="primerl", description="primerl: asynchronous RL for LLMs")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser(
        "up",
        help="run the services of one TOML file and their RL loop",
        description="Starts every service of the launch file ([orchestrator], [trainer], [inference] or "
        "[[inference]], [router], [weight_broadcaster], [kvstore]; [launcher] and [warm_start] configure the "
        "launcher), follows the run to its end and stops them. Without -c: the embedded demo "
        "(`primerl demo-config` prints it).",
    )
    up.add_argument("-c", "--config", type=pathlib.Path, help="launch file (TOML); default: the embedded demo")
    up.add_argument("--run-dir", type=pathlib.Path, help="where configs, logs, metrics and the plot go")
    commands.add_parser("demo-config", help="print the embedded demo launch file")
    return parser


def _load(config: pathlib.Path | None) -> LaunchFile:
    if config is not None:
        return read_launch_file(config)
    import tomllib

    return parse_launch_file(tomllib.loads(demo_config_text()))


async def _up(launch: LaunchFile, run_dir: pathlib.Path) -> int:
    launcher = Launcher(launch, run_dir)
    task = asyncio.current_task()
    assert task is not None

    def interrupt(sig: signal.Signals) -> None:
        if launcher.interrupt():
            print(f"\n{sig.name}: stopping every service (again to kill them)", file=sys.stderr, flush=True)
            task.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt, sig)
    try:
        return await launcher.up()
    except asyncio.CancelledError:
        if not launcher.interrupted:
            raise
        print("interrupted: every service stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress and errors (stderr) stay in order
    if args.command == "demo-config":
        print(demo_config_text(), end="")
        return 0
    try:
        launch = _load(args.config)
        run_dir = args.run_dir or default_run_dir(launch.launcher)
        return asyncio.run(_up(launch, run_dir))
    except LaunchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
