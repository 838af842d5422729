"""The `primerl` command: `primerl up [-c FILE]` runs a whole RL system from one TOML
file (without -c: the embedded demo); `primerl eval CHECKPOINT -c FILE` runs that file's
[[orchestrator.evals]] on a saved checkpoint; `primerl samples RUN_DIR --step N` shows a
step's rollouts; `primerl demo-config` prints the demo file."""

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
    evaluate = commands.add_parser(
        "eval",
        help="run the [[orchestrator.evals]] of a launch file on a saved checkpoint",
        description="Serves CHECKPOINT (a Hugging Face model folder, e.g. the trainer's export) with the launch "
        "file's [inference] and [router] alone, plays its [[orchestrator.evals]] on it, prints a table and "
        "writes the results as JSON.",
    )
    evaluate.add_argument("checkpoint", type=pathlib.Path, help="model folder (config.json, weights, tokenizer)")
    evaluate.add_argument("-c", "--config", type=pathlib.Path, help="launch file (TOML); default: the embedded demo")
    evaluate.add_argument("--run-dir", type=pathlib.Path, help="where configs and logs go")
    evaluate.add_argument("--output", type=pathlib.Path, help="results JSON; default: RUN_DIR/evals.json")
    samples = commands.add_parser(
        "samples",
        help="show one step's rollouts of a run (prompt, completion, reward, advantage)",
        description="Prints the rollouts of step N as the orchestrator wrote them (output.samples_dir), or writes "
        "them as an HTML page (the prompts' images shown from their files in the samples folder).",
    )
    samples.add_argument("run_dir", type=pathlib.Path, help="the run directory of `primerl up`")
    samples.add_argument("--step", type=int, required=True)
    samples.add_argument("--html", type=pathlib.Path, help="write an HTML page here instead of printing")
    commands.add_parser("demo-config", help="print the embedded demo launch file")
    return parser


def _samples(run_dir: pathlib.Path, step: int, html_path: pathlib.Path | None) -> int:
    from primerl_launcher.samples_view import (
        SamplesNotFound,
        find_samples_dir,
        format_samples,
        read_samples,
        write_samples_page,
    )

    try:
        rows = read_samples(run_dir, step)
    except SamplesNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if html_path is None:
        print(format_samples(rows))
        return 0
    write_samples_page(rows, html_path, samples_dir=find_samples_dir(run_dir), title=f"{run_dir.name}: step {step}")
    print(f"{len(rows)} samples of step {step}: {html_path}")
    return 0


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
    if args.command == "samples":
        return _samples(args.run_dir, args.step, args.html)
    try:
        launch = _load(args.config)
        run_dir = args.run_dir or default_run_dir(launch.launcher)
        if args.command == "eval":
            from primerl_launcher.evaluate import evaluate_checkpoint

            return asyncio.run(evaluate_checkpoint(launch, args.checkpoint, run_dir, output=args.output))
        return asyncio.run(_up(launch, run_dir))
    except LaunchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
