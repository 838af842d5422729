"""Many LoRA runs on one trainer and one replica against as many single-run deployments (CPU).

For each N of --n, two setups, one after the other, each run on the same RL job (the tiny dense
model in float32, LoRA rank --lora-rank, reverse_text with --batch-size rollouts of --max-tokens
tokens a step, --group-size a prompt, async level 1, --steps steps):

- shared: one `primerl up` with [trainer.runs] max_concurrent_runs = N: one trainer, one vLLM
  replica (engine.max_loras = N, which the launcher wires; max_num_seqs --max-num-seqs x N), one
  router, one weight broadcaster. The N runs are made with trainer.v1 CreateRun (each its own
  adapter seed) and fed by N orchestrators (peers.run_id), as tests/test_multi_run.py does.
- separate: N single-run LoRA deployments (`primerl up` each, in a run folder of its own), each
  one trainer, one replica (max_num_seqs --max-num-seqs), router and broadcaster, fed by its own
  orchestrator that uses the trainer's published adapter.

The launch files have no [orchestrator]: this script starts every orchestrator itself, all N at
once once every deployment is SERVING, so that the runs of both setups start together and the
orchestrator processes are the same ones (primerl_launcher.run_orchestrator fills their configs
as the launcher fills its own orchestrator's). The deployments of a setup are started one after
another, each once the one before is SERVING: four vLLM starts at once on 2 cores time out, and
the launcher picks its services' ports free when it wires them (there is no base-port setting),
so a deployment is started only once the one before holds its ports.

Measured per setup, from the trainer (trainer.v1 WatchSteps: each step's finished_at):
- steps/s: the sum over the runs of each run's rate from the end of its step --warmup-steps to
  the end of its last step ((steps - warmup) / that time);
- wall steps/s: every run's steps after the warm-up over the time from the first run's warm-up
  end to the last run's last step (lower where the runs drift apart);
- peak RSS: the most resident memory (VmRSS, from /proc) that every process this script started
  held together (launchers, services, vLLM's processes, orchestrators), sampled every 0.5 s
  from the orchestrators' start to the runs' last step. RSS counts pages that processes share
  (each process's copy of the same libraries' code) once per process; PSS at end (from
  /proc/<pid>/smaps_rollup, once when the last step is trained) shares them out instead.

    .venv/bin/python bench/multi_tenant.py --n 1 2 4 --rounds 3 --output bench/results/multi_tenant-$(date +%F).txt

--rounds R measures each N's two setups R times, back to back, the first of the two swapped every
other round (paired rounds: a slow minute of a shared machine falls on both sides of a ratio as
often as not); each ratio is the median over the rounds.

Last line: RESULT shared_vs_separate_steps=<shared steps/s / separate steps/s at N=4>
memory_ratio=<shared peak RSS / separate peak RSS at N=4> (medians over the rounds; the largest N
measured where 4 is not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import grpc
from rl_vs_trl import TreeSampler, fmt, kill_group, say  # bench/ is on sys.path: this script's folder

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.local_vllm import local_cache_dir, local_vllm_env
from primerl_common.processes import ServiceProcess, free_ports
from primerl_launcher import _toml
from primerl_launcher.run_orchestrator import run_orchestrator_config

REPO = pathlib.Path(__file__).resolve().parents[1]
SETUPS = ("shared", "separate")
GIB = 1 << 30


# --------------------------------------------------------------------------- memory


def rss_bytes(pid: int) -> int:
    """The process's resident set now (/proc/<pid>/statm); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """The process's proportional set size now (/proc/<pid>/smaps_rollup); 0 once it is gone."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps_rollup", "rb") as file:
        for line in file:
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class MemorySampler(TreeSampler):
    """Total RSS of the processes under `root`, `root` itself left out (this script, the same in
    every setup), on TreeSampler's thread and tree walk; no CPU is sampled."""

    def __init__(self, root: int) -> None:
        super().__init__(root)
        self.rss: list[tuple[float, int]] = []  # (time, total bytes)

    def pids(self) -> list[int]:
        return [pid for pid in self._tree() if pid != self.root]

    def sample(self) -> None:
        total = sum(rss_bytes(pid) for pid in self.pids())
        with self._lock:
            self.rss.append((time.time(), total))

    def peak_rss(self, t0: float, t1: float) -> int:
        with self._lock:
            return max((total for t, total in self.rss if t0 <= t <= t1), default=0)

    def pss_now(self) -> int:
        return sum(pss_bytes(pid) for pid in self.pids())


# --------------------------------------------------------------------------- launch files


def launch_file(args: argparse.Namespace, *, num_runs: int | None) -> dict[str, Any]:
    """A `primerl up` launch file without [orchestrator]: a trainer with `num_runs` runs
    ([trainer.runs]), or of one run (None) at --lr, each with its replica, router and broadcaster."""
    trainer: dict[str, Any] = {
        "device": "cpu",
        "seq_len": 1024,
        "model": {"dtype": "float32", "compute_dtype": "float32"},
        "lora": {"enabled": True, "rank": args.lora_rank, "alpha": 2.0 * args.lora_rank},
    }
    if num_runs is None:
        trainer["optimizer"] = {"lr": args.lr}
    else:
        trainer["runs"] = {"max_concurrent_runs": num_runs, "quota": {"max_runs": num_runs}}
    return {
        "launcher": {
            "model": "tiny-dense",
            "cache_dir": str(local_cache_dir() / "launcher"),
            "check_config": False,
            "poll_interval_s": 0.5,
            "start_timeout_s": args.start_timeout_s,
        },
        "trainer": trainer,
        "inference": {
            "engine": {
                "dtype": "float32",
                "enforce_eager": True,
                "max_model_len": 256,
                "max_num_seqs": args.max_num_seqs * (num_runs or 1),
                "kv_cache_gib": args.kv_cache_gib,
            }
        },
        "router": {"health": {"interval_s": 0.5}, "routing": {"no_replica_wait_s": 60.0}},
        "weight_broadcaster": {"push": {"probe_interval_s": 0.5}},
    }


def orchestrator_table(args: argparse.Namespace, *, seed: int) -> dict[str, Any]:
    """What each run's orchestrator does (the rest is filled by run_orchestrator_config)."""
    return {
        "model": {"max_model_len": 256},
        "peers": {"poll_interval_s": 0.2},
        "run": {"max_steps": args.steps, "batch_size": args.batch_size, "max_async_level": 1, "seed": seed},
        "advantage": {"filter_zero_advantage": False},
        "environments": [
            {
                "name": "reverse_text",
                "kind": "reverse_text",
                "group_size": args.group_size,
                "sampling": {"max_tokens": args.max_tokens},
            }
        ],
    }


# --------------------------------------------------------------------------- one setup


@dataclasses.dataclass
class Deployment:
    """One `primerl up` this script started."""

    run_dir: pathlib.Path
    launcher: subprocess.Popen[bytes]
    services: dict[str, Any]


@dataclasses.dataclass
class SetupResult:
    setup: str
    num_runs: int
    round: int = 0
    error: str = ""
    finished: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # run -> finish time by step
    peak_rss: int = 0
    pss_end: int = 0

    def rates(self, warmup: int) -> list[float]:
        return [(len(t) - warmup) / (t[-1] - t[warmup - 1]) for t in self.finished.values()]

    def steps_per_s(self, warmup: int) -> float:
        return math.fsum(self.rates(warmup)) if self.finished and not self.error else math.nan

    def wall_steps_per_s(self, warmup: int) -> float:
        if not self.finished or self.error:
            return math.nan
        t0 = min(t[warmup - 1] for t in self.finished.values())
        t1 = max(t[-1] for t in self.finished.values())
        return sum(len(t) - warmup for t in self.finished.values()) / (t1 - t0)


def service_env() -> dict[str, str]:
    """The tests' vLLM settings (primerl_common.local_vllm), less the KV cache size: the launch
    file's engine.kv_cache_gib says it (the variable would take precedence)."""
    env = {**os.environ, **local_vllm_env()}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def start_deployment(run_dir: pathlib.Path, launch: dict[str, Any], timeout_s: float) -> Deployment:
    """`primerl up` on `launch`, once every service is SERVING (its services.json)."""
    run_dir.mkdir(parents=True)
    config = run_dir.with_suffix(".toml")
    config.write_text(_toml.dumps(launch))
    with run_dir.with_suffix(".log").open("wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "primerl_launcher", "up", "-c", str(config), "--run-dir", str(run_dir)],
            cwd=REPO,
            env=service_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    give_up_at = time.monotonic() + timeout_s
    listing = run_dir / "services.json"
    while not listing.is_file():
        if launcher.poll() is not None:
            raise RuntimeError(f"primerl up exited {launcher.returncode} before SERVING (log {run_dir}.log)")
        if time.monotonic() > give_up_at:
            kill_group(launcher)
            raise RuntimeError(f"primerl up not SERVING after {timeout_s:.0f} s (log {run_dir}.log)")
        time.sleep(0.5)
    return Deployment(run_dir, launcher, json.loads(listing.read_text()))


@dataclasses.dataclass
class Run:
    """One run and the orchestrator that feeds it (not launched yet)."""

    name: str
    trainer: str  # its trainer's address
    run_id: str | None  # None: the trainer's one run
    orchestrator: ServiceProcess


def runs_of(
    setup: str, deployments: list[Deployment], num_runs: int, args: argparse.Namespace, root: pathlib.Path
) -> list[Run]:
    """The setup's runs, each with its orchestrator's config written: on the shared trainer, one
    run a deployment would have (run-0.., made by create_runs); else each deployment's one run."""
    if setup == "shared":
        [shared] = deployments
        placed = [(f"run-{i}", f"run-{i}", shared, root / f"run-{i}") for i in range(num_runs)]
    else:
        placed = [(f"deployment-{i}", None, d, d.run_dir / "orchestrator") for i, d in enumerate(deployments)]
    runs = []
    ports = free_ports(len(placed))
    for index, (name, run_id, deployment, folder) in enumerate(placed):
        folder.mkdir(parents=True, exist_ok=True)
        config = run_orchestrator_config(
            folder / "orchestrator.toml",
            deployment.services,
            orchestrator_table(args, seed=11 * (index + 1)),
            run_id=run_id,
            port=ports[index],
            out_dir=folder,
        )
        process = ServiceProcess(
            [sys.executable, "-m", "primerl_orchestrator", "-c", str(config)],
            port=ports[index],
            name=f"{name}'s orchestrator",
            log_path=folder / "orchestrator.log",
            env=service_env(),
        )
        runs.append(Run(name, deployment.services["trainer"]["address"], run_id, process))
    return runs


async def create_runs(trainer: trainer_pb2_grpc.TrainerServiceStub, runs: list[Run], args: argparse.Namespace) -> None:
    for seed, run in enumerate(runs, start=1):
        spec = trainer_pb2.RunSpec(
            lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank, seed=seed, learning_rate=args.lr
        )
        await trainer.CreateRun(trainer_pb2.CreateRunRequest(run_id=run.run_id, spec=spec))


async def trained_steps(trainer: trainer_pb2_grpc.TrainerServiceStub, run: Run) -> int:
    return (await trainer.GetStatus(trainer_pb2.GetStatusRequest(run_id=run.run_id or ""))).step


async def finish_times(trainer: trainer_pb2_grpc.TrainerServiceStub, run: Run, last_step: int) -> list[float]:
    """When each of the run's steps 1..last_step ended, as its trainer says (WatchSteps)."""
    times: dict[int, float] = {}
    call = trainer.WatchSteps(trainer_pb2.WatchStepsRequest(after_step=-1, run_id=run.run_id or ""))
    try:
        async with asyncio.timeout(60):
            async for response in call:
                times[response.step.step] = response.step.finished_at.ToMicroseconds() / 1e6
                if response.step.step >= last_step:
                    break
    finally:
        call.cancel()
    if sorted(times) != list(range(1, last_step + 1)):
        raise RuntimeError(f"{run.name}: the trainer remembers steps {sorted(times)}, not 1..{last_step}")
    return [times[step] for step in range(1, last_step + 1)]


async def train(
    runs: list[Run],
    deployments: list[Deployment],
    sampler: MemorySampler,
    result: SetupResult,
    args: argparse.Namespace,
) -> None:
    """Every run's orchestrator at once, until every run has trained --steps steps (then stopped);
    fills `result`."""
    channels = {address: make_channel(address) for address in {run.trainer for run in runs}}
    trainers = [trainer_pb2_grpc.TrainerServiceStub(channels[run.trainer]) for run in runs]
    orchestrators = [run.orchestrator for run in runs]
    try:
        if result.setup == "shared":
            await create_runs(trainers[0], runs, args)
        started = time.time()
        for process in orchestrators:
            process.launch()
        await asyncio.gather(*(process.until_serving(args.start_timeout_s) for process in orchestrators))
        give_up_at = time.monotonic() + args.run_timeout_s
        while min(steps := [await trained_steps(*pair) for pair in zip(trainers, runs, strict=True)]) < args.steps:
            for deployment in deployments:
                if deployment.launcher.poll() is not None:
                    code = deployment.launcher.returncode
                    raise RuntimeError(f"primerl up in {deployment.run_dir} exited {code}")
            for process in orchestrators:
                if process.returncode not in (None, 0):
                    raise RuntimeError(f"{process.name} exited {process.returncode} (log {process.log_path})")
            if time.monotonic() > give_up_at:
                raise RuntimeError(f"steps {steps} after {args.run_timeout_s:.0f} s, not {args.steps}")
            await asyncio.sleep(1.0)
        ended = time.time()
        result.pss_end = sampler.pss_now()
        result.peak_rss = sampler.peak_rss(started, ended)
        for trainer, run in zip(trainers, runs, strict=True):
            result.finished[run.name] = await finish_times(trainer, run, args.steps)
    finally:
        for process in orchestrators:
            with contextlib.suppress(TimeoutError):
                await process.stop(grace_s=20)
        for channel in channels.values():
            await channel.close()


def run_setup(setup: str, num_runs: int, args: argparse.Namespace, out: pathlib.Path) -> SetupResult:
    """One setup: its deployments started one after another, its runs trained, all stopped."""
    result = SetupResult(setup, num_runs)
    root = out / f"{setup}-{num_runs}"
    deployments: list[Deployment] = []
    with MemorySampler(os.getpid()) as sampler:
        try:
            if setup == "shared":
                launches = {"up": launch_file(args, num_runs=num_runs)}
            else:
                launches = {f"up-{i}": launch_file(args, num_runs=None) for i in range(num_runs)}
            for name, launch in launches.items():
                deployments.append(start_deployment(root / name, launch, args.start_timeout_s + 60))
            say(f"  {len(deployments)} deployment(s) SERVING; {num_runs} orchestrator(s) start")
            runs = runs_of(setup, deployments, num_runs, args, root)
            asyncio.run(train(runs, deployments, sampler, result, args))
        except (RuntimeError, TimeoutError, OSError, grpc.RpcError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:400]
        finally:
            for deployment in deployments:
                kill_group(deployment.launcher, grace_s=60)
    return result


# --------------------------------------------------------------------------- report


def gib(value: int) -> str:
    return fmt(value / GIB if value else math.nan, 2)


def table(results: list[SetupResult], warmup: int) -> list[str]:
    lines = [
        f"{'N':>2} {'round':>5} {'setup':<9} {'steps/s':>8} {'wall steps/s':>12} {'s/step a run':>12} "
        f"{'peak RSS GiB':>12} {'PSS GiB at end':>14}"
    ]
    for result in results:
        if result.error:
            lines.append(f"{result.num_runs:>2} {result.round:>5} {result.setup:<9} FAILED: {result.error}")
            continue
        per_run = [1 / rate for rate in result.rates(warmup)]
        lines.append(
            f"{result.num_runs:>2} {result.round:>5} {result.setup:<9} {fmt(result.steps_per_s(warmup), 3):>8} "
            f"{fmt(result.wall_steps_per_s(warmup), 3):>12} {fmt(math.fsum(per_run) / len(per_run), 2):>12} "
            f"{gib(result.peak_rss):>12} {gib(result.pss_end):>14}"
        )
    return lines


def ratios(results: list[SetupResult], warmup: int) -> dict[int, list[tuple[float, float, float]]]:
    """N -> for each round, shared/separate steps/s, peak RSS and PSS at end (NaN where either failed)."""
    by = {(r.setup, r.num_runs, r.round): r for r in results}
    out: dict[int, list[tuple[float, float, float]]] = {}
    for n, round_ in sorted({(r.num_runs, r.round) for r in results}):
        shared, separate = by.get(("shared", n, round_)), by.get(("separate", n, round_))
        if shared is None or separate is None or shared.error or separate.error:
            out.setdefault(n, []).append((math.nan, math.nan, math.nan))
            continue
        out.setdefault(n, []).append(
            (
                shared.steps_per_s(warmup) / separate.steps_per_s(warmup),
                shared.peak_rss / separate.peak_rss,
                shared.pss_end / separate.pss_end,
            )
        )
    return out


def median(values: list[float]) -> float:
    """The median of the finite values (NaN when none is)."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return math.nan
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2


def machine() -> str:
    """The CPU model, CPU count and memory, from /proc."""
    model, memory = "?", 0
    with contextlib.suppress(OSError, ValueError):
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
        meminfo = pathlib.Path("/proc/meminfo").read_text().splitlines()
        memory = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024
    return f"{model}, {os.cpu_count()} CPUs, {gib(memory)} GiB memory"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4], help="concurrent runs (default 1 2 4)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="default: both")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="paired rounds: each N's two setups measured once a round, in the other order every other round; "
        "the ratios are the medians over the rounds (default 1)",
    )
    parser.add_argument("--steps", type=int, default=10, help="steps of every run (default 10)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="a run's steps before its window (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="rollouts trained a step (default 8)")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts a prompt (default 4)")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens a rollout samples (default 12)")
    parser.add_argument("--lora-rank", type=int, default=8, help="every run's LoRA rank (default 8)")
    parser.add_argument("--lr", type=float, default=5e-3, help="every run's learning rate (default 5e-3)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="a replica's, per run it serves (default 16)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="every replica's KV cache (default 0.25)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0, help="per deployment's start (default 600)")
    parser.add_argument("--run-timeout-s", type=float, default=900.0, help="per setup's training (default 900)")
    parser.add_argument("--out-dir", type=pathlib.Path, help="default: runs/multi_tenant-<date-time>")
    parser.add_argument("--output", type=pathlib.Path, help="also write the report (what follows the runs) here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not 1 <= args.warmup_steps < args.steps:
        parser.error("--warmup-steps must be at least 1 and below --steps")
    out = (args.out_dir or REPO / "runs" / datetime.datetime.now().strftime("multi_tenant-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    job = (
        f"tiny-dense float32, LoRA rank {args.lora_rank}, {args.batch_size} rollouts x {args.max_tokens} tokens a "
        f"step, {args.steps} steps a run, window from each run's step {args.warmup_steps} to its last; {machine()}"
    )
    say(f"bench/multi_tenant.py: N {' '.join(map(str, args.n))}, {args.rounds} round(s); {job}; output in {out}")
    results = []
    for round_ in range(1, args.rounds + 1):
        # Paired: the setups of one N back to back, the first of them swapped every other round.
        setups = args.setups if round_ % 2 else args.setups[::-1]
        for num_runs in args.n:
            for setup in setups:
                say(f"\n== round {round_}: N={num_runs} {setup} (load average {load_average()})")
                result = run_setup(setup, num_runs, args, out / f"round-{round_}")
                result.round = round_
                results.append(result)
                say(table(results[-1:], args.warmup_steps)[-1])

    report = [
        "",
        f"== {job}; load average at the end {load_average()}",
        *table(results, args.warmup_steps),
    ]
    by_n = ratios(results, args.warmup_steps)
    medians = {}
    for n, rounds in by_n.items():
        medians[n] = steps, rss, pss = (median([r[i] for r in rounds]) for i in range(3))
        each = " ".join(fmt(r[0], 3) for r in rounds)
        report.append(
            f"N={n}: shared/separate steps/s {fmt(steps, 3)} (median of rounds: {each}), "
            f"peak RSS {fmt(rss, 3)}, PSS at end {fmt(pss, 3)}"
        )
    at = 4 if 4 in medians else max(medians)
    if at != 4:
        report.append(f"(no N=4 measured: the RESULT is N={at}'s)")
    steps, rss, _ = medians[at]
    report += ["", f"RESULT shared_vs_separate_steps={fmt(steps, 3)} memory_ratio={fmt(rss, 3)}"]
    (out / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    for line in report:
        say(line)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(report).lstrip("\n") + "\n")
    return 0 if not any(r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
